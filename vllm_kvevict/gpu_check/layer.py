"""One attention layer under a policy, stepped twice: the checked path and the reference.

Checked (what the served FlexAttention path runs, minus vLLM): per layer, heads that keep every KV
attend over a paged cache with the head mask's block masks (`flex/block_mask.py`), one
`flex_attention` call per kind of head (full, streaming), as
`integration/attention/flex_attention.py` does; heads that evict tokens attend over their compacted
pages by physical position, patched scoring's question rows as extra rows sharing their request's
pages (as `flex_token.py`), then each chunk is scored and selected by the policy object
(`SnapKVPolicy.score` / `.select`, what `compress_chunks` calls) and its kept K/V written back after
the kept past.

Reference (`reference/`: `visibility`, `attend`, `streaming_cut`, `observation_scores`,
`select_kept`, `LayerKV`): per request, an explicit cache at true positions, the runner's
update rule (`reference/runner.py`), masked dense attention in float32. No attention code is
shared: the two sides meet only in the policy's answers (which heads stream, what a layer keeps).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.attention.flex_attention as flex_module
from torch.nn.attention.flex_attention import flex_attention

from vllm_kvevict.flex import FLEX_RECOMPILE_LIMIT
from vllm_kvevict.flex.block_mask import head_mask_block_mask, paged_queries
from vllm_kvevict.policies import KVPolicy
from vllm_kvevict.reference.attention import LayerKV, attend, streaming_cut, visibility
from vllm_kvevict.reference.eviction import observation_scores, select_kept

PAGE = 16     # vLLM's default block size on CUDA
Q_BLOCK = 16  # vLLM's FlexAttention query block with paged KV (torch >= 2.9)


@functools.cache
def compiled_flex_attention():
    """Compiled once per process, as vLLM compiles it (whole graph)."""
    allow_check_compiles()
    return torch.compile(flex_attention, fullgraph=True)


def allow_check_compiles() -> None:
    """The check compiles every policy, dtype and timing shape in one process (a served worker
    compiles one policy's, under FLEX_RECOMPILE_LIMIT): dynamo's limits would stop it midway."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit,
                                               16 * FLEX_RECOMPILE_LIMIT)
    torch._dynamo.config.accumulated_recompile_limit = max(
        torch._dynamo.config.accumulated_recompile_limit, 64 * FLEX_RECOMPILE_LIMIT)


def compile_counter():
    """Graphs compiled from now on (a cell's own: those earlier cells left are reused)."""
    stats = torch._dynamo.utils.counters["stats"]
    start = stats["unique_graphs"]
    return lambda: stats["unique_graphs"] - start


def kernel(device: str, compiled: bool, vllm_options: bool = True):
    """flex_attention as vLLM calls it: compiled whole-graph; on CUDA with the kernel blocks of
    the mask's blocks (vLLM's `get_kernel_options` with direct build; `vllm_options=False`:
    torch's own choice of kernel and blocks, a timing experiment). Eager: torch's unfused
    implementation (scores materialized), run op by op: without torch's debug switch it is
    traced anew for every input shape, seconds each on a CPU."""
    if not compiled:
        flex_module._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = True
    fn = compiled_flex_attention() if compiled else flex_attention
    options = ({"BLOCK_M": Q_BLOCK, "BLOCK_N": PAGE, "FORCE_USE_FLEX_ATTENTION": True}
               if compiled and device.startswith("cuda") and vllm_options else None)

    def run(q, cache_k, cache_v, mask, scale):
        """q [Hq, T, d], caches [slots, H, d] -> [Hq, T, d]."""
        return fn(q[None], cache_k.transpose(0, 1)[None], cache_v.transpose(0, 1)[None],
                  block_mask=mask, scale=scale, enable_gqa=True, kernel_options=options)[0]
    return run


@dataclass
class Row:
    """One request's part of a step: `count` tokens from `start`; `question`: patched scoring's
    rows after a non-final chunk (the prompt's last k tokens)."""

    index: int
    start: int
    count: int
    prompt: int
    q: torch.Tensor              # [Hq, count + question, d]
    k: torch.Tensor              # [H, count + question, d]
    v: torch.Tensor
    question: int = 0

    @property
    def prefill(self) -> bool:
        return self.start < self.prompt

    @property
    def final(self) -> bool:
        return self.start + self.count >= self.prompt


@dataclass
class LayerSetup:
    policy: KVPolicy
    layer: int
    streaming: torch.Tensor      # bool [H]
    evicting: torch.Tensor       # bool [H]: heads whose chunks are compressed
    scale: float
    capacity: tuple[int, int]    # mask tables (tokens, rows): one compilation per size


def kv_heads_to_q(heads: torch.Tensor, group: int) -> torch.Tensor:
    return (heads[:, None] * group + torch.arange(group, device=heads.device)).flatten()


@dataclass
class CheckedLayer:
    """The checked path's state: a paged cache at logical positions (heads keeping every KV)
    and one compacted by eviction (evicting heads), both over `table`'s scattered pages."""

    setup: LayerSetup
    table: torch.Tensor                      # int32 [R, P]
    cache: list[torch.Tensor]                # K, V [pages * PAGE, H, d]
    compact: list[torch.Tensor]              # K, V: the evicting heads' compacted cache
    physical: list[int]                      # per request: compacted length
    kept: list[torch.Tensor] = field(default_factory=list)  # per request: positions [He, n]
    last_choice: dict = field(default_factory=dict)  # per request: its last chunk's `select`

    def write(self, cache, row: int, where: torch.Tensor, k, v) -> None:
        slots = self.table[row].long()[where // PAGE] * PAGE + where % PAGE
        cache[0][slots], cache[1][slots] = k.transpose(0, 1), v.transpose(0, 1)

    def step(self, run, rows: list[Row]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Outputs of the step's tokens [Hq, T, d] and of the evicting heads' question rows."""
        s, device = self.setup, rows[0].q.device
        hq, group = rows[0].q.shape[0], rows[0].q.shape[0] // s.streaming.numel()
        out = torch.empty(hq, sum(r.count for r in rows), rows[0].q.shape[-1],
                          dtype=rows[0].q.dtype, device=device)
        for r in rows:
            self.write(self.cache, r.index, torch.arange(r.start, r.start + r.count,
                                                         device=device), r.k[:, :r.count],
                       r.v[:, :r.count])
        keeping = ~s.evicting
        for streaming in (False, True):
            heads = (keeping & (s.streaming == streaming)).nonzero().flatten()
            if heads.numel():
                qh = kv_heads_to_q(heads, group)
                out[qh] = self._heads(run, rows, heads, streaming)
        question = None
        if bool(s.evicting.any()):
            heads = s.evicting.nonzero().flatten()
            steps, question = self._evicting(run, rows, heads)
            out[kv_heads_to_q(heads, group)] = steps
        return out, question

    def _heads(self, run, rows, heads, streaming: bool) -> torch.Tensor:
        s = self.setup
        batch = paged_queries([r.start for r in rows], [r.count for r in rows],
                              self.table[[r.index for r in rows]], PAGE,
                              self.cache[0].shape[0] // PAGE, [r.prompt for r in rows])
        batch = _to(batch, rows[0].q.device)
        cfg = s.policy.config
        mask = head_mask_block_mask(batch, torch.full((1,), streaming, device=rows[0].q.device),
                                    cfg.sink, cfg.window, q_block=Q_BLOCK,
                                    token_capacity=s.capacity[0], row_capacity=s.capacity[1])
        group = rows[0].q.shape[0] // s.streaming.numel()
        q = torch.cat([r.q[:, :r.count] for r in rows], 1)[kv_heads_to_q(heads, group)]
        return run(q, self.cache[0][:, heads], self.cache[1][:, heads], mask, s.scale)

    def _evicting(self, run, rows, heads):
        """Token eviction's attention over the compacted past, then the chunks' compression."""
        s, device = self.setup, rows[0].q.device
        group = rows[0].q.shape[0] // s.streaming.numel()
        qh = kv_heads_to_q(heads, group)
        extra = [r for r in rows if r.question]
        # (physical start, queries, request): the step's rows, then the question rows
        starts, counts, table_rows = zip(
            *[(self.physical[r.index], r.count, r.index) for r in rows],
            *[(self.physical[r.index] + r.count, r.question, r.index) for r in extra])
        for r in rows:
            n = r.count + r.question
            where = self.physical[r.index] + torch.arange(n, device=device)
            self.write(self.compact, r.index, where, r.k[:, :n], r.v[:, :n])
        batch = _to(paged_queries(list(starts), list(counts), self.table[list(table_rows)], PAGE,
                                  self.compact[0].shape[0] // PAGE), device)
        mask = head_mask_block_mask(batch, torch.zeros(1, dtype=torch.bool, device=device), 0, 0,
                                    q_block=Q_BLOCK, token_capacity=s.capacity[0],
                                    row_capacity=s.capacity[1])
        q = torch.cat([r.q[:, :r.count] for r in rows] + [r.q[:, r.count:] for r in extra], 1)
        out = run(q[qh], self.compact[0][:, heads], self.compact[1][:, heads], mask, s.scale)
        steps = sum(r.count for r in rows)
        for r in rows:
            self._compress(r, heads, qh)
        return out[:, :steps], (out[:, steps:] if extra else None)

    def _compress(self, r: Row, heads, qh) -> None:
        """What `compress_chunks` does for one chunk: score, select, keep after the past."""
        p, before = self.setup.policy, self.physical[r.index]
        device = r.q.device
        if not r.prefill:
            self.physical[r.index] += 1
            self.kept[r.index] = torch.cat([self.kept[r.index], torch.full(
                (heads.numel(), 1), r.start, device=device)], 1)
            return
        c = r.count
        keep = p.chunk_keep(self.setup.layer, c, r.final)
        if r.question:
            obs_q, offset = r.q[qh, c:], c
        else:
            num_obs = p.config.observation_rows(c)
            obs_q, offset = r.q[qh, c - num_obs:c], c - num_obs
        scores = p.score(obs_q, r.k[heads, :c], obs_offset=offset, window=keep.window)
        idx = p.select(scores, keep.selected, c, keep.window).to(device)    # [He, kept]
        gather = idx[..., None].expand(-1, -1, r.k.shape[-1])
        k_kept = torch.gather(r.k[heads, :c], 1, gather)
        v_kept = torch.gather(r.v[heads, :c], 1, gather)
        where = before + torch.arange(idx.shape[1], device=device)
        self._store_kept(r.index, heads, where, k_kept, v_kept)
        self.physical[r.index] = before + idx.shape[1]
        self.kept[r.index] = torch.cat([self.kept[r.index], r.start + idx], 1)
        self.last_choice[r.index] = idx


    def _store_kept(self, row: int, heads: torch.Tensor, where: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor) -> None:
        """The kept K/V [He, n, d] of the evicting `heads` at compacted slots `where` [n]."""
        slots = self.table[row].long()[where // PAGE] * PAGE + where % PAGE
        self.compact[0][slots[:, None], heads], self.compact[1][slots[:, None], heads] = \
            k.transpose(0, 1), v.transpose(0, 1)


def _to(batch, device):
    return type(batch)(**{k: v.to(device) if isinstance(v, torch.Tensor) else v
                          for k, v in vars(batch).items()})


def reference_step(setup: LayerSetup, cache: LayerKV, r: Row,
                   checked_choice: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
    """The reference runner's update for one request's step (`ReferenceRunner.forward`):
    outputs [Hq, count + question, d] at true positions (the cache keeps the past and what the
    policy keeps of the chunk, streaming heads cut to sink + window), and the heads where the
    checked path's `checked_choice` of this chunk was taken as a tie (`adopt_ties`)."""
    cfg, device = setup.policy.config, r.q.device
    positions = torch.arange(r.start, r.start + r.count + r.question, device=device)
    past = cache.positions.shape[1]
    keys, values, key_pos = cache.with_new(r.k, r.v, positions)
    seen = visibility(positions, key_pos, r.start, setup.streaming, cfg.sink, cfg.window)
    out = attend(r.q, keys, values, seen, setup.scale)
    stored = past + r.count
    keep = torch.ones(setup.streaming.numel(), stored, dtype=torch.bool, device=device)
    ties = 0
    if r.prefill and bool(setup.evicting.any()):
        kept, ties = _reference_chunk_kept(setup, r, checked_choice)
        keep[:, past:] = kept | ~setup.evicting.view(-1, 1)
    key_pos = key_pos[:, :stored]
    keep &= streaming_cut(key_pos, r.start + r.count, setup.streaming, cfg.sink, cfg.window)
    cache.store(keys[:, :stored], values[:, :stored], key_pos, keep)
    return out, ties


def _reference_chunk_kept(setup: LayerSetup, r: Row,
                          checked_choice: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """Bool [H, c]: `ReferenceRunner.chunk_tokens_kept` on this step's q and k (ties adopted
    from the checked path's choice), and the number of heads adopted."""
    cfg, c = setup.policy.config, r.count
    budget = setup.policy.chunk_keep(setup.layer, c, r.final)
    if r.question:
        obs, offset = r.q[:, c:], c
    else:
        n = min(cfg.obs_window, c)
        obs, offset = r.q[:, c - n:c], c - n
    scores = observation_scores(obs, r.k[:, :c], offset, num_candidates=c - budget.window,
                                pool_kernel=cfg.pool_kernel)
    chosen = select_kept(scores, budget.selected, c, budget.window)
    ties = 0
    if checked_choice is not None:
        heads = setup.evicting.nonzero().flatten().to(chosen.device)
        chosen[heads], ties = adopt_ties(scores[heads], chosen[heads],
                                         checked_choice.to(chosen.device), budget.selected)
    keep = torch.zeros(setup.streaming.numel(), c, dtype=torch.bool, device=r.q.device)
    return keep.scatter(1, chosen.to(r.q.device), True), ties


TIE_RTOL = 1e-5  # of a head's largest score: float32 scoring summed in another order


def adopt_ties(scores: torch.Tensor, chosen: torch.Tensor, other: torch.Tensor,
               selected: int) -> tuple[torch.Tensor, int]:
    """`chosen` (the reference's top `selected` by `scores`, then the window) with each head's
    row replaced by `other` where `other` is a top-`selected` too up to TIE_RTOL: its lowest
    chosen score at most that far below the highest it left out. On a GPU the two paths score
    in different kernels, and a near-tie at the cut can fall either way; a larger gap stays a
    mismatch. Returns the rows and the number of heads replaced."""
    mask = torch.zeros_like(scores, dtype=torch.bool).scatter(1, other[:, :selected], True)
    differs = (chosen != other).any(dim=1)
    if not bool(differs.any()):
        return chosen, 0
    low = scores.masked_fill(~mask, float("inf")).min(dim=1).values
    high = scores.masked_fill(mask, float("-inf")).max(dim=1).values
    tie = differs & (high - low <= TIE_RTOL * scores.abs().max(dim=1).values)
    return torch.where(tie[:, None], other, chosen), int(tie.sum())
