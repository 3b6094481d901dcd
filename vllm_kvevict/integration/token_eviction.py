"""Chunked token eviction (snapkv, pyramidkv) with real memory: kept KVs are compacted forward
and the freed tail blocks go back to vLLM's block pool during the request.

The layers are split into KV-cache groups (`LayerGroups`; one block table per request and
group, see tiers.py): one group for snapkv, one per tier of layers for pyramidkv. Two sides agree
on one deterministic ledger per group (`allocation_evicted[g]`):
- scheduler (engine core): in group g a request holds blocks for `computed -
  allocation_evicted[g]` tokens (+ the chunk it runs); when a prefill chunk of length c has run,
  allocation_evicted[g] grows by c - max kept_l over the group's layers l, and the group's tail
  blocks past its new physical length are freed.
- worker: per layer the physical length (kept tokens). New tokens are written at physical
  positions in the layer's group's block row, the kernel sees physical seq_lens, and after each
  prefill chunk a layer rewrites its kept tokens (per KV head, gathered from the forward's own
  K/V tensors, RoPE already applied) at [phys_before, phys_before + kept). At the end of the step
  the worker drops the same tail blocks from vLLM's (append-only) worker-side block lists of
  every group, so both sides keep identical block lists and vLLM appends the next step's blocks
  after the kept ones.
With `eviction_chunk` E set, an eviction chunk [s, s + E) may be prefilled over several engine
steps (the scheduler never lets a step cross its end, see `TokenEvictionScheduler.step_cap`):
the steps before its last one only append; the last one scores and compacts the whole chunk,
reading the earlier steps' K/V back from the paged cache (`paged_layout.py`).
Logical positions (RoPE of new tokens) are vLLM's own and never change. Within a group the
layers share the block row sized for the group's largest layer, each using its own physical
length.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vllm_kvevict.integration.admission import GrowthReserve
from vllm_kvevict.policies import KVPolicy


class RequestPolicies:
    """The served policy, with a request's `vllm_xargs` overrides (kv_sparsity, kv_obs_window)
    applied; one policy object per distinct setting."""

    def __init__(self, policy: KVPolicy):
        self.base = policy
        self._cache: dict = {}

    def __call__(self, extra_args) -> KVPolicy:
        from vllm_kvevict.integration.request_stats import effective_config
        from vllm_kvevict.policies import build_policy

        cfg, overrides = effective_config(self.base.config, extra_args)
        if not overrides:
            return self.base
        key = tuple(sorted(overrides.items()))
        if key not in self._cache:
            self._cache[key] = build_policy(cfg, self.base.num_layers, self.base.num_kv_heads)
        return self._cache[key]


@dataclass(frozen=True)
class LayerGroups:
    """Which vLLM KV-cache group (one block table per request) holds each layer's KV."""

    of_layer: tuple[int, ...]

    @classmethod
    def single(cls, num_layers: int) -> "LayerGroups":
        return cls((0,) * num_layers)

    @classmethod
    def tiers(cls, num_layers: int, num_tiers: int) -> "LayerGroups":
        """Runs of num_layers / num_tiers consecutive layers (as tiers.py declares them)."""
        size = num_layers // num_tiers
        return cls(tuple(layer // size for layer in range(num_layers)))

    @property
    def num_groups(self) -> int:
        return max(self.of_layer, default=0) + 1

    def layers(self, group: int) -> list[int]:
        return [l for l, g in enumerate(self.of_layer) if g == group]


def chunk_kept_per_layer(policy: KVPolicy, chunk_len: int, is_final: bool) -> list[int]:
    return [policy.chunk_keep(layer, chunk_len, is_final).kept
            for layer in range(policy.num_layers)]


def group_evictions_of(kept: list[int], chunk_len: int, groups: LayerGroups) -> list[int]:
    """Per group: slots a chunk gives back = chunk length - the most any of its layers keeps."""
    most = [0] * groups.num_groups
    for layer, k in enumerate(kept):
        g = groups.of_layer[layer]
        most[g] = max(most[g], k)
    return [chunk_len - m for m in most]


def group_evictions(policy: KVPolicy, chunk_len: int, is_final: bool,
                    groups: LayerGroups) -> list[int]:
    """Tokens of a prefill chunk whose slots the request gives back, per KV-cache group (the
    same in both processes)."""
    return group_evictions_of(chunk_kept_per_layer(policy, chunk_len, is_final), chunk_len,
                              groups)


def allocation_eviction(policy: KVPolicy, chunk_len: int, is_final: bool) -> int:
    """group_evictions with all layers in one group."""
    return chunk_len - max(chunk_kept_per_layer(policy, chunk_len, is_final))


def eviction_chunk_len(config, computed: int, step_len: int) -> int:
    """Tokens of the eviction chunk that a prefill step [computed, computed + step_len) belongs
    to, up to the step's end (the step itself when no `eviction_chunk` is set). A step that
    crosses an eviction boundary is a bug of the scheduler's cap: raise, never guess."""
    e, end = config.eviction_chunk, computed + step_len
    if e is None:
        return step_len
    start = (end - 1) // e * e
    if computed < start:
        raise RuntimeError(f"vllm-kvevict: a prefill step [{computed}, {end}) crosses the "
                           f"eviction chunk boundary {start} (eviction_chunk {e})")
    return end - start


# ------------------------------------------------------------------------------------------
# worker side
# ------------------------------------------------------------------------------------------
@dataclass
class RequestLedger:
    """Worker-side record of one request."""

    evicted: list[int]              # per layer: logical - physical tokens
    allocation_evicted: list[int]   # per KV-cache group: the scheduler's count (slots given back)


@dataclass
class EvictionJob:
    """One eviction chunk to compress after attention. Its last `end - start` tokens are this
    step's batch tokens [start, end); the `chunk_len - (end - start)` before them ran in earlier
    steps (decoupled eviction chunk) and are read back from the paged cache."""

    req_id: str
    row: int
    computed: int                 # logical tokens before this step
    start: int
    end: int
    is_final: bool
    phys_before: list[int]        # per layer: physical length before the eviction chunk
    keep: list                    # per layer: ChunkKeep
    chunk_len: int = 0            # tokens of the eviction chunk (this step's and earlier ones)
    question: list[int] = field(default_factory=list)  # patched: the prompt's last k tokens
    policy: KVPolicy | None = None  # the request's (served policy + its overrides)
    question_start: int = 0       # their rows in the extended token axis [T, T + Q)


@dataclass
class TokenStepPlan:
    num_reqs: int
    query_start_loc: torch.Tensor    # int32 [num_reqs + 1]
    block_table: torch.Tensor        # int32 [G, num_reqs, width]: the request's blocks per group
    seq_lens: torch.Tensor           # int32 [L, num_reqs]: physical length incl. this step
    slots: torch.Tensor              # int64 [L, T]: physical slot of each new token
    jobs: list[EvictionJob]
    block_size: int
    layer_group: tuple[int, ...] = ()  # KV-cache group (block table) of each layer
    valid: bool = True
    kernel_schedules: dict = field(default_factory=dict)
    # Patched scoring: the question tokens run as extra rows after the batch's T tokens.
    num_tokens: int = 0                    # T
    question_ids: torch.Tensor | None = None        # long [Q]
    question_positions: torch.Tensor | None = None  # long [Q]
    question_offset: int = 0               # where they sit in the model's token axis

    @property
    def num_questions(self) -> int:
        return 0 if self.question_ids is None else int(self.question_ids.shape[0])

    def table(self, layer: int) -> torch.Tensor:
        """[num_reqs, width]: the block rows of the layer's group."""
        return self.block_table[self.layer_group[layer]]

    def physical_slots(self, layer: int, row: int, positions: torch.Tensor) -> torch.Tensor:
        bs = self.block_size
        return self.table(layer)[row, positions // bs].long() * bs + positions % bs


class TokenEvictionWorker:
    def __init__(self, policy: KVPolicy, block_size: int, groups: LayerGroups | None = None):
        self.policy = policy
        self.policy_for = RequestPolicies(policy)
        self.block_size = block_size
        self.groups = groups or LayerGroups.single(policy.num_layers)
        self.ledgers: dict[str, RequestLedger] = {}

    def release(self, req_ids) -> None:
        for req_id in req_ids or ():
            self.ledgers.pop(req_id, None)

    def plan(self, req_ids: list[str], computed: list[int], query_lens: list[int],
             prompt_lens: list[int], block_ids: list[list[list[int]]],
             prompt_ids=None, extra_args=None) -> TokenStepPlan:
        """block_ids[row][group]: the row's block ids in each KV-cache group;
        prompt_ids(row) -> the row's prompt token ids (needed by patched scoring only);
        extra_args(row) -> the request's sampling extra_args (per-request overrides)."""
        L, bs, G = self.policy.num_layers, self.block_size, self.groups.num_groups
        rows, jobs = len(req_ids), []
        seq_lens = torch.zeros(L, rows, dtype=torch.int32)
        phys_before = torch.zeros(L, rows, dtype=torch.long)
        for r, (req_id, a, c, n) in enumerate(zip(req_ids, computed, query_lens, prompt_lens)):
            led = self.ledgers.get(req_id)
            if led is None or a == 0:  # new, or restarted after preemption
                led = self.ledgers[req_id] = RequestLedger(evicted=[0] * L,
                                                           allocation_evicted=[0] * G)
            before = torch.tensor([a - e for e in led.evicted])
            phys_before[:, r] = before
            seq_lens[:, r] = (before + c).int()
            if a + c > n:  # decode
                continue
            chunk_len = eviction_chunk_len(self.policy.config, a, c)  # raises on a crossing
            if self.policy.config.is_eviction_point(a + c, n):  # compress the chunk
                policy = self.policy_for(extra_args(r) if extra_args else None)
                is_final = a + c == n
                question = []
                if policy.config.patched and not is_final:
                    question = list(prompt_ids(r)[n - min(policy.config.obs_window, n):])
                jobs.append(EvictionJob(
                    req_id=req_id, row=r, computed=a, start=0, end=0, is_final=is_final,
                    phys_before=(before - (chunk_len - c)).tolist(), question=question,
                    policy=policy, chunk_len=chunk_len,
                    keep=[policy.chunk_keep(l, chunk_len, is_final) for l in range(L)]))
        width = max((len(b) for row in block_ids for b in row), default=1) or 1
        table = torch.zeros(G, rows, width, dtype=torch.int32)
        for r, row in enumerate(block_ids):
            for g, b in enumerate(row[:G]):
                table[g, r, : len(b)] = torch.tensor(b, dtype=torch.int32)
        q_start = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(),
                               dtype=torch.int32)
        for job in jobs:
            job.start, job.end = int(q_start[job.row]), int(q_start[job.row + 1])
        token_row = torch.repeat_interleave(torch.arange(rows), torch.tensor(query_lens))
        token_off = torch.arange(len(token_row)) - q_start[:-1].long()[token_row]
        pos = phys_before[:, token_row] + token_off            # [L, T]
        plan = TokenStepPlan(num_reqs=rows, query_start_loc=q_start, block_table=table,
                             seq_lens=seq_lens, slots=None, jobs=jobs, block_size=bs,
                             layer_group=self.groups.of_layer, num_tokens=len(token_row))
        patched = [j for j in jobs if j.question]
        if patched:
            self._add_questions(plan, patched, token_row, pos, phys_before)
        else:
            plan.slots = self._slots(table, token_row, pos)
        return plan

    def _slots(self, table: torch.Tensor, token_row: torch.Tensor, pos: torch.Tensor):
        """[L, T] physical slots: token t of layer l at pos[l, t] in its row of l's group."""
        bs = self.block_size
        group = torch.tensor(self.groups.of_layer, dtype=torch.long).unsqueeze(1)   # [L, 1]
        blocks = table[group, token_row.unsqueeze(0), pos // bs]                    # [L, T]
        return blocks.long() * bs + pos % bs

    def _add_questions(self, plan, patched, token_row, pos, phys_before) -> None:
        """Patched scoring: each non-final chunk's question (the prompt's last k tokens) runs as
        extra rows at logical positions right after the chunk and physical slots right after
        it (the scheduler reserved them); the kernel sees them as extra sequences that share
        their request's block rows. Their KVs end up past the kept length: dropped."""
        ids, positions, rows, offs = [], [], [], []
        q_lens, seq_extra = [], []
        start = plan.num_tokens
        for job in patched:
            k, c = len(job.question), job.end - job.start
            job.question_start = start
            start += k
            ids += job.question
            positions += range(job.computed + c, job.computed + c + k)
            rows += [job.row] * k
            offs.append(torch.arange(k) + c)
            q_lens.append(k)
            seq_extra.append(phys_before[:, job.row] + c + k)
        rows_t = torch.tensor(rows)
        q_pos = phys_before[:, rows_t] + torch.cat(offs)                    # [L, Q]
        all_rows = torch.cat([token_row, rows_t])
        all_pos = torch.cat([pos, q_pos], dim=1)
        plan.slots = self._slots(plan.block_table, all_rows, all_pos)
        plan.question_ids = torch.tensor(ids, dtype=torch.long)
        plan.question_positions = torch.tensor(positions, dtype=torch.long)
        ends = plan.query_start_loc[-1].item() + torch.tensor(q_lens).cumsum(0)
        plan.query_start_loc = torch.cat([plan.query_start_loc, ends.int()])
        plan.seq_lens = torch.cat([plan.seq_lens, torch.stack(seq_extra, 1).int()], dim=1)
        plan.block_table = torch.cat([plan.block_table,
                                      plan.block_table[:, [j.row for j in patched]]], dim=1)
        plan.num_reqs += len(patched)

    def finish_step(self, plan: TokenStepPlan, request_block_ids, row_block_counts) -> None:
        """After the forward: book the compressed chunks and drop the tail blocks from vLLM's
        worker-side block lists, exactly as the scheduler frees them before its next step.

        request_block_ids(req_id) -> the request's block-id lists, one per group (mutable);
        row_block_counts[g]: the persistent batch's per-row block counts of group g (mutable)."""
        bs = self.block_size
        for job in plan.jobs:
            led = self.ledgers[job.req_id]
            c, chunk_len = job.end - job.start, job.chunk_len
            kept = [k.kept for k in job.keep]
            led.evicted = [e + chunk_len - k for e, k in zip(led.evicted, kept)]
            freed = group_evictions_of(kept, chunk_len, self.groups)
            led.allocation_evicted = [a + f for a, f in zip(led.allocation_evicted, freed)]
            per_group = request_block_ids(job.req_id)
            if per_group is None:
                continue
            for g, ids in enumerate(per_group):
                own = -(-(job.computed + c - led.allocation_evicted[g]) // bs)
                if len(ids) > own:
                    del ids[own:]
                    row_block_counts[g][job.row] = own


# ------------------------------------------------------------------------------------------
# scheduler side
# ------------------------------------------------------------------------------------------
class TokenEvictionScheduler(GrowthReserve):
    """Engine-core side of the ledger: translates vLLM's logical token counts to physical ones
    per KV-cache group for block allocation, frees each group's tail blocks after each
    compressed chunk, caps admission (`GrowthReserve` with compressed peak sizes)."""

    def __init__(self, policy: KVPolicy, chunk_size: int, groups: LayerGroups | None = None,
                 reserve_growth: bool = True):
        super().__init__(reserve_growth)
        self.policy = policy
        self.policy_for = RequestPolicies(policy)
        self.chunk_size = chunk_size
        self.groups = groups or LayerGroups.single(policy.num_layers)
        self.allocation_evicted: dict[str, list[int]] = {}
        self.pending: dict[str, tuple[int, bool, KVPolicy]] = {}
        self._evictions: dict[tuple, list[int]] = {}

    def evictions(self, policy: KVPolicy, chunk_len: int, is_final: bool) -> list[int]:
        """group_evictions, memoised (policies are cached objects, one per setting)."""
        key = (id(policy), chunk_len, is_final)
        out = self._evictions.get(key)
        if out is None:
            if len(self._evictions) > 4096:
                self._evictions.clear()
            out = self._evictions[key] = group_evictions(policy, chunk_len, is_final,
                                                         self.groups)
        return out

    def physical(self, req_id: str, num_tokens: int, group: int = 0) -> int:
        evicted = self.allocation_evicted.get(req_id)
        return num_tokens - (evicted[group] if evicted else 0)

    def peak_tokens(self, request, num_tokens: int) -> list[int]:
        """Per group, the peak slots a request of `num_tokens` tokens needs: the compressed
        prompt before a chunk, that chunk and its patched question, and every token after the
        prompt (decode tokens are never evicted)."""
        n, c = request.num_prompt_tokens, self.chunk_size
        policy = self.request_policy(request)
        question = min(policy.config.obs_window, n) if policy.config.patched else 0
        G = self.groups.num_groups
        done, kept, peak = 0, [0] * G, [0] * G
        while done < n:
            step = min(c, n - done)
            final = done + step == n
            freed = self.evictions(policy, step, final)
            for g in range(G):
                peak[g] = max(peak[g], kept[g] + step + (0 if final else question))
                kept[g] += step - freed[g]
            done += step
        return [min(num_tokens, max(p, k + num_tokens - n)) for p, k in zip(peak, kept)]

    def before_schedule(self) -> None:
        """Apply the evictions of the chunks scheduled last step (their forward precedes any
        forward of this step, so the freed blocks are safe to hand out now)."""
        if self.scheduler is None:
            return
        managers = self.scheduler.kv_cache_manager.coordinator.single_type_managers
        for req_id, (chunk_len, is_final, policy) in list(self.pending.items()):
            del self.pending[req_id]
            request = self.scheduler.requests.get(req_id)
            held = [m.req_to_blocks.get(req_id) for m in managers]
            if request is None or not any(held):
                self.allocation_evicted.pop(req_id, None)
                continue
            freed = self.evictions(policy, chunk_len, is_final)
            evicted = self.allocation_evicted.setdefault(req_id, [0] * len(managers))
            for g, (manager, blocks) in enumerate(zip(managers, held)):
                evicted[g] += freed[g]
                keep = -(-self.physical(req_id, request.num_computed_tokens, g)
                         // manager.block_size)
                if blocks and len(blocks) > keep:
                    tail = blocks[keep:]
                    del blocks[keep:]
                    manager.block_pool.free_blocks(reversed(tail))

    def after_schedule(self, scheduler_output) -> None:
        for req_id in getattr(scheduler_output, "preempted_req_ids", None) or ():
            self.forget(req_id)
        for req_id in scheduler_output.finished_req_ids:
            self.forget(req_id)
        self.forget_finished(scheduler_output)
        for req_id, c in scheduler_output.num_scheduled_tokens.items():
            request = self.scheduler.requests.get(req_id)
            if request is None:
                continue
            before, n = request.num_computed_tokens - c, request.num_prompt_tokens
            if before == 0:
                self.allocation_evicted.pop(req_id, None)
            policy = self.request_policy(request)
            if policy.config.is_eviction_point(before + c, n):
                self.pending[req_id] = (eviction_chunk_len(policy.config, before, c),
                                        before + c == n, policy)

    def step_cap(self, request, num_computed: int, num_new: int) -> int:
        """`replay_cap`, then with an `eviction_chunk`: a prefill step never crosses the end b
        of its eviction chunk, and when the chunk's own last queries score it (naive mode, and
        the prompt's final chunk) its last step holds them whole: a step ends at b or at most
        at b - obs_window (0 = wait for a step with budget for the rest)."""
        num_new = self.replay_cap(request, num_computed, num_new)
        config, n = self.policy.config, request.num_prompt_tokens
        e, a = config.eviction_chunk, num_computed
        if e is None or num_new <= 0 or a >= n:
            return num_new
        start = a // e * e
        end = min(start + e, n)
        if a + num_new >= end:
            return end - a
        policy = self.request_policy(request)
        own_queries = not policy.config.patched or end == n
        last_start = end - (min(policy.config.obs_window, end - start) if own_queries else 0)
        if a + num_new <= last_start:
            return num_new
        return last_start - a if a < last_start else 0

    def forget(self, req_id: str) -> None:
        self.allocation_evicted.pop(req_id, None)
        self.pending.pop(req_id, None)

    def request_policy(self, request) -> KVPolicy:
        params = getattr(request, "sampling_params", None)
        return self.policy_for(getattr(params, "extra_args", None))
