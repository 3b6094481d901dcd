"""The head-pages Triton kernel (`kernels/head_pages.py`) as a checked path, a timed path and a
CUDA-graph replay, for gpu_check.

Checked (`KernelLayer`, in `cells.run_case(..., path="kernel")`): the same steps, rows and
reference as the FlexAttention path's cells, but each (request, KV head) owns its pages of one
pool, as the kernel reads them: heads keeping every KV by logical page (a streaming head's pages
outside its sink and window are freed after each step: its table then points at a page of NaN),
evicting heads over their compacted pages (the kept past in order, then the chunk), patched
scoring's question rows as extra requests sharing their request's pages; full, streaming and
compacted heads in one launch per step. Every slot the kernel must not read holds NaN.

Timed (`KernelStep`, `kernel_call`): the timing cells' shapes over per-head pools (the full
context by logical page, and the compacted 30%), one launch per layer; on CUDA a decode kind is
also timed as a CUDA-graph replay (`graph_ms`: the launch without Python's wrapper).

`graph_replay`: one decode step captured in a CUDA graph (preallocated split workspace, no host
sync) and replayed on new inputs, equal to the eager step.

On the CPU the kernel runs only in Triton's interpreter (TRITON_INTERPRET=1 before Triton is
first imported; `python -m vllm_kvevict.gpu_check` sets it when CUDA is absent).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from vllm_kvevict.gpu_check.layer import PAGE, CheckedLayer, LayerSetup, Row, kv_heads_to_q

try:
    import triton
    from triton.runtime.interpreter import InterpretedFunction

    from vllm_kvevict.kernels.head_pages import (auto_splits, head_pages_attention,
                                                 split_workspace)
    NO_TRITON = None
except ImportError as exc:  # a box with torch alone (.venv-torch): the rest of gpu_check runs
    NO_TRITON = f"skipped: Triton is not installed here ({exc})"

OPTION_NAMES = ("block_n", "block_m", "num_warps", "num_stages", "num_splits")
CPU_DECODE_SPLITS = 4  # on the CPU, decode steps exercise the split-KV path and its combine
GRAPH_NOT_ON_CPU = ("skipped: CUDA graphs need a CUDA device; this run is on {device}, so the "
                    "decode step's capture and replay were not checked")


def parse_options(text: str | None) -> dict:
    """`block_n=64,num_splits=8` -> {"block_n": 64, "num_splits": 8} (`OPTION_NAMES`)."""
    out = {}
    for item in filter(None, (text or "").split(",")):
        name, _, value = item.partition("=")
        if name not in OPTION_NAMES or not value.strip().isdigit():
            raise ValueError(f"kernel option {item!r}: expected NAME=INT with NAME one of "
                             f"{', '.join(OPTION_NAMES)}")
        out[name] = int(value)
    return out


def interpreter_problem(device: str) -> str | None:
    """Why the kernel cannot run on `device` in this process (None: it can)."""
    if NO_TRITON:
        return NO_TRITON
    if device.startswith("cuda"):
        return None
    if os.environ.get("TRITON_INTERPRET") != "1" or not isinstance(
            triton.language.standard.sum, InterpretedFunction):
        return ("skipped: on the CPU the kernel runs only in Triton's interpreter: set "
                "TRITON_INTERPRET=1 before Triton is first imported (python -m "
                "vllm_kvevict.gpu_check does when CUDA is absent)")
    return None


@dataclass
class KernelRun:
    """head_pages_attention with the run's options: decode-only steps split the KV over
    `num_splits` of the options, else `decode_splits` (None: the kernel's `auto_splits`);
    prefill and mixed steps use one split."""

    options: dict = field(default_factory=dict)
    decode_splits: int | None = None

    def __call__(self, q, k_pool, v_pool, table, lengths, qsl, streaming, sink, window, scale,
                 max_query_len):
        opts = dict(self.options)
        splits = opts.pop("num_splits", None) or self.decode_splits
        splits = splits if max_query_len == 1 else 1
        return head_pages_attention(q, k_pool, v_pool, table, lengths, qsl,
                                    streaming=streaming, sink=sink, window=window, scale=scale,
                                    max_query_len=max_query_len, num_splits=splits, **opts)


def kernel_run(device: str, options: dict | None = None) -> KernelRun:
    return KernelRun(dict(options or {}), None if device.startswith("cuda")
                     else CPU_DECODE_SPLITS)


@dataclass
class KernelLayer(CheckedLayer):
    """The kernel's state for one layer: `cache` is the pool (K, V [num_pages, PAGE, d]),
    `table` the kernel's int32 [R, H, P] page table (freed streaming pages -> `poison`),
    `pages` the pages each (request, head) owns (int64 [R, H, P]), written through."""

    pages: torch.Tensor | None = None
    poison: int = 0

    def put(self, row: int, where: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            heads: torch.Tensor | None = None) -> None:
        """K/V [h, n, d] of `heads` (None: all) at slots `where` [h, n] of their own pages."""
        own = self.pages[row] if heads is None else self.pages[row][heads]
        pages = torch.gather(own, 1, where // PAGE)
        self.cache[0][pages, where % PAGE] = k
        self.cache[1][pages, where % PAGE] = v

    def _store_kept(self, row, heads, where, k, v) -> None:
        self.put(row, where.expand(heads.numel(), -1), k, v, heads)

    def step(self, run, rows: list[Row]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One launch for every head and row (question rows: extra requests); then token
        eviction's compression and the streaming heads' freed pages."""
        s, device = self.setup, rows[0].q.device
        heads_n = s.streaming.numel()
        group = rows[0].q.shape[0] // heads_n
        evict = s.evicting.to(device)
        extra = [r for r in rows if r.question]
        for r in rows:
            n = torch.arange(r.count + r.question, device=device)
            where = torch.where(evict[:, None], self.physical[r.index] + n, r.start + n)
            self.put(r.index, where, r.k, r.v)

        def lengths(r: Row, more: int) -> torch.Tensor:
            return torch.where(evict, self.physical[r.index] + r.count + more,
                               r.start + r.count + more)
        counts = [r.count for r in rows] + [r.question for r in extra]
        out = run(torch.cat([r.q[:, :r.count] for r in rows] + [r.q[:, r.count:] for r in extra],
                            1).transpose(0, 1).contiguous(),
                  self.cache[0], self.cache[1],
                  self.table[[r.index for r in rows] + [r.index for r in extra]],
                  torch.stack([lengths(r, 0) for r in rows] + [lengths(r, r.question)
                                                               for r in extra]).int(),
                  torch.tensor([0] + counts, device=device).cumsum(0).int(),
                  s.streaming.to(device=device, dtype=torch.int32), s.policy.config.sink,
                  s.policy.config.window, s.scale, max(counts)).transpose(0, 1)
        steps, question = sum(r.count for r in rows), None
        if bool(evict.any()):
            heads = evict.nonzero().flatten()
            qh = kv_heads_to_q(heads, group)
            question = out[qh, steps:] if extra else None
            for r in rows:
                self._compress(r, heads, qh)
        self._free_streaming(rows)
        return out[:, :steps], question

    def _free_streaming(self, rows: list[Row]) -> None:
        """A streaming head's pages wholly after its sink and before any later chunk's window
        (as vLLM frees them): the table points at the NaN page."""
        s, cfg = self.setup, self.setup.policy.config
        streaming = (s.streaming & ~s.evicting).to(self.table.device)
        logical = torch.arange(self.table.shape[2], device=self.table.device)
        for r in rows:
            free = (logical * PAGE >= cfg.sink) & (
                (logical + 1) * PAGE <= r.start + r.count - cfg.window)
            self.table[r.index][streaming[:, None] & free[None]] = self.poison


def new_kernel_layer(setup: LayerSetup, sizes, shape, gen, device: str, dtype) -> KernelLayer:
    """A NaN-filled pool with each (request, KV head)'s own pages, scattered (room for its
    prompt, decode tokens and question rows), plus the NaN page freed entries point at."""
    heads, d = shape[1], shape[3]
    per = [-(-(n + sizes.decode + sizes.obs_window) // PAGE) for n in sizes.prompts]
    total = heads * sum(per) + 1
    perm = torch.randperm(total, generator=gen)
    pages = torch.full((len(per), heads, max(per)), int(perm[-1]), dtype=torch.long)
    used = 0
    for r, n in enumerate(per):
        pages[r, :, :n] = perm[used:used + heads * n].view(heads, n)
        used += heads * n
    pool = [torch.full((total, PAGE, d), float("nan"), dtype=dtype, device=device)
            for _ in range(2)]
    evicting = int(setup.evicting.sum())
    return KernelLayer(setup, pages.to(device=device, dtype=torch.int32), pool, pool,
                       [0] * len(per), [torch.zeros(evicting, 0, dtype=torch.long,
                                                    device=device) for _ in per],
                       pages=pages.to(device), poison=int(perm[-1]))


# -- timing -------------------------------------------------------------------------------

KINDS = ("kernel-dense", "kernel-prulong-0.7", "kernel-snapkv-0.7", "kernel-streaming",
         "kernel-prulong-0.7+snapkv")


@dataclass
class KernelStep:
    """Per layer one pool holding each (request, KV head)'s pages of the whole context (by
    logical page) and of the compacted 30% (`kept` slots, past then the step), the tables into
    it, and the step's queries [tokens, Hq, d]."""

    q: torch.Tensor
    pools: list                   # per layer: (K, V) [pages, PAGE, d]
    full: torch.Tensor            # int32 [B, H, P]: logical pages
    compact: torch.Tensor         # int32 [B, H, P]: compacted pages (P padded)
    n: int                        # context + tokens
    kept: int                     # compacted past + tokens
    tokens: int


def make_kernel_step(q_heads_first: torch.Tensor, batch: int, context: int, tokens: int,
                     kv_heads: int, layers: int, keep: float) -> KernelStep:
    """From the timing step's queries [Hq, B * T, d]: random pools (the tables scattered)."""
    device, dtype, d = q_heads_first.device, q_heads_first.dtype, q_heads_first.shape[-1]
    n, kept = context + tokens, int(keep * context) + tokens
    per, per_c = -(-n // PAGE), -(-kept // PAGE)
    total = batch * kv_heads * (per + per_c)
    perm = torch.randperm(total, device=device).int()
    full = perm[:batch * kv_heads * per].view(batch, kv_heads, per)
    compact = torch.zeros(batch, kv_heads, per, dtype=torch.int32, device=device)
    compact[:, :, :per_c] = perm[batch * kv_heads * per:].view(batch, kv_heads, per_c)
    pools = [tuple(torch.randn(total, PAGE, d, device=device, dtype=dtype) for _ in range(2))
             for _ in range(layers)]
    return KernelStep(q_heads_first.transpose(0, 1).contiguous(), pools, full, compact, n,
                      kept, tokens)


def kernel_bytes_per_token(kv_heads: int, head_dim: int, elem: int) -> int:
    """A pool's bytes per context token (K and V, every KV head, page table aside)."""
    return 2 * kv_heads * head_dim * elem


class KernelCall:
    """One kernel kind's step over `layers` layers: one launch per layer (`__call__`); on CUDA
    `capture()` records the same launches in a CUDA graph (workspace preallocated)."""

    def __init__(self, kind: str, ks: KernelStep, full_kv: list[int], layers: int,
                 options: dict, sink: int, window: int, scale: float):
        b, heads = ks.full.shape[:2]
        device = ks.q.device
        self.ks, self.layers, self.kind = ks, layers, kind
        self.qsl = (torch.arange(b + 1, device=device) * ks.tokens).int()
        self.opts = dict(options)
        self.splits = (self.opts.pop("num_splits", None)
                       or auto_splits(b, heads, ks.tokens, device)) if ks.tokens == 1 else 1
        self.opts.pop("num_splits", None)
        self.args = []
        heads_idx = torch.arange(heads, device=device)
        for layer in range(layers):
            f = {"kernel-dense": heads, "kernel-snapkv-0.7": heads,
                 "kernel-streaming": 0}.get(kind, full_kv[layer])
            streaming = (heads_idx >= f).int()
            compacted = kind.endswith("snapkv-0.7") or kind.endswith("+snapkv")
            full_rows = (heads_idx < f)[None, :, None] & compacted
            table = torch.where(full_rows, ks.compact, ks.full).contiguous()
            lengths = torch.where(full_rows[..., 0], ks.kept, ks.n).int().expand(b, heads)
            self.args.append((table, lengths.contiguous(), streaming))
        self.sink, self.window, self.scale = sink, window, scale
        self.workspace = (split_workspace(ks.q.shape[0], ks.q.shape[1], ks.q.shape[2],
                                          self.splits, device) if self.splits > 1 else None)
        self.out = torch.empty_like(ks.q)

    def __call__(self) -> torch.Tensor:
        for layer, (table, lengths, streaming) in enumerate(self.args):
            k, v = self.ks.pools[layer]
            head_pages_attention(self.ks.q, k, v, table, lengths, self.qsl,
                                 streaming=streaming, sink=self.sink, window=self.window,
                                 scale=self.scale, max_query_len=self.ks.tokens,
                                 num_splits=self.splits, out=self.out,
                                 workspace=self.workspace, **self.opts)
        return self.out

    def capture(self):
        """The launches captured in a CUDA graph (after an eager warm-up); returns replay."""
        self()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self()
        return graph.replay


# -- a decode step captured in a CUDA graph ------------------------------------------------

def graph_replay(device: str, options: dict | None = None, batch: int = 8,
                 context: int = 4096, dtype=torch.bfloat16) -> dict:
    """A Llama-3.1-8B-shaped decode step (2 of 8 KV heads full, 6 streaming; sink 64, window
    256) run eagerly with host syncs made errors, captured in a CUDA graph, then replayed on a
    next step's inputs (new queries, one more token per head, other heads streaming) copied
    into the captured tensors: its output must equal the eager step's on those inputs,
    bit for bit. CPU: skipped, and the result says so."""
    base = {"check": "cuda-graph decode replay", "batch": batch, "context": context}
    if not device.startswith("cuda"):
        return dict(base, passed=None, status=GRAPH_NOT_ON_CPU.format(device=device))
    heads, group, d = 8, 4, 128
    gen = torch.Generator(device=device).manual_seed(0)
    per = -(-(context + 2) // PAGE)
    pool = [torch.randn(batch * heads * per, PAGE, d, device=device, dtype=dtype,
                        generator=gen) for _ in range(2)]
    table = torch.randperm(batch * heads * per, device=device, generator=gen).int().view(
        batch, heads, per)
    q = torch.randn(batch, heads * group, d, device=device, dtype=dtype, generator=gen)
    lengths = torch.full((batch, heads), context + 1, dtype=torch.int32, device=device)
    streaming = (torch.arange(heads, device=device) >= 2).int()
    qsl = torch.arange(batch + 1, device=device, dtype=torch.int32)
    opts = dict(options or {})
    splits = opts.pop("num_splits", None) or auto_splits(batch, heads, 1, device)
    workspace = split_workspace(batch, heads * group, d, splits, device) if splits > 1 else None
    out = torch.empty_like(q)

    def step():
        return head_pages_attention(q, pool[0], pool[1], table, lengths, qsl,
                                    streaming=streaming, sink=64, window=256,
                                    max_query_len=1, num_splits=splits, out=out,
                                    workspace=workspace, **opts)
    torch.cuda.set_sync_debug_mode("error")  # a host sync in the step raises here
    try:
        step()
        torch.cuda.synchronize()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    first = out.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    q.copy_(torch.randn(q.shape, device=device, dtype=dtype, generator=gen))
    lengths.add_(1)
    streaming.copy_((torch.arange(heads, device=device) % 2).int())
    graph.replay()
    torch.cuda.synchronize()
    replayed = out.clone()
    eager = head_pages_attention(q, pool[0], pool[1], table, lengths, qsl, streaming=streaming,
                                 sink=64, window=256, max_query_len=1, num_splits=splits,
                                 **opts)
    diff = float((replayed.float() - eager.float()).abs().max())
    moved = not torch.equal(replayed, first)
    return dict(base, splits=splits, max_diff=diff, inputs_changed_output=moved,
                passed=diff == 0.0 and moved and bool(torch.isfinite(replayed).all()),
                status="ok")
