"""Sink + window K/V of streaming heads, per request, outside vLLM's paged pool.

Semantics (`policies/streaming.py`): a streaming head running a prefill chunk [a, a + c) sees
the sink (first s tokens), the last W tokens before a, and the chunk causally; afterwards it keeps
sink + last W. The tokens it may see before a are exactly positions [0, a) if a <= s + W, else
[0, s) and [a - W, a). A decode query at position q (q >= the prompt length) sees the sink,
[q - W, q) and itself, as when tokens are decoded one at a time; so a step that runs several
decode queries of one request (speculative decoding: the last sampled token and K drafts) gives
each its own kernel row (below).

Layout: per layer a plain tensor [slots * (s + W + K), heads, head_dim] for K and for V, where
K is the speculative slack (num_speculative_tokens, 0 without speculation). Position p of a
request lives at ring slot p (p < s) or s + (p - s) mod (W + K). A verification step writes all
its 1 + K tokens, and vLLM then rolls back the rejected ones; a rejected position p lands on the
slot of p - (W + K), which every later step's window has already left (with a ring of W slots it
would land on p - W, still inside the next step's window). Reads therefore go by the ring slot
of each visible position. Each step:
  1. lay out, per kernel row, [visible past tokens | this step's visible tokens] in a zeroed
     scratch paged cache (through vLLM's reshape-and-cache op, which knows the kernel's packed
     layouts) and run vLLM's own CPU kernel causally: it places query i at seq_len - q_len + i.
     A prefill chunk is one row of its c queries (exactly the chunk's streaming mask); each
     decode query of a multi-query step is a row of its own with one query, holding only what
     that query sees;
  2. write this step's tokens that may stay visible into their ring slots.
The index bookkeeping (`StepPlan`) is computed once per engine step and shared by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vllm_kvevict.integration.fp8 import grid_values, is_fp8, quantize


@dataclass
class StepPlan:
    """Per-step indices shared by every layer (built from the batch's rows). A batch row (one
    request) gives one kernel row, or several when it runs more than one decode query."""

    num_reqs: int                   # kernel rows
    seq_lens: torch.Tensor          # int32 [num_reqs]: laid-out tokens per kernel row
    query_start_loc: torch.Tensor   # int32 [num_reqs + 1] (queries stay in batch order)
    block_table: torch.Tensor       # int32 [num_reqs, max_blocks] into the scratch cache
    scratch_slots: torch.Tensor     # int64 [sum(seq_lens)]: scratch slot of each laid-out token
    prefix_dst: torch.Tensor        # long: rows of the laid-out tensor that come from the store
    prefix_src: torch.Tensor        # long: their store rows
    chunk_dst: torch.Tensor         # long: rows of the laid-out tensor that come from the step
    chunk_src: torch.Tensor         # long: their token indices in the batch
    keep_src: torch.Tensor          # long: step token indices (in the batch) kept after the step
    keep_dst: torch.Tensor          # long: their store rows
    max_seq_len: int
    # pool storage (sink_window.py): the position and batch row of each prefix_dst token
    prefix_pos: torch.Tensor = None
    prefix_row: torch.Tensor = None
    valid: bool = True
    # vLLM kernel work schedules for this step, per streaming-head count (filled lazily)
    kernel_schedules: dict = field(default_factory=dict)


def ring_slot(positions: torch.Tensor, sink: int, ring: int) -> torch.Tensor:
    """Store slot (within a request) of each position: sink slots, then a ring of `ring`."""
    return torch.where(positions < sink, positions, sink + (positions - sink) % ring)


def visible_before(a: int, sink: int, window: int, anchor: int | None = None) -> torch.Tensor:
    """Positions < a that a streaming head sees from a query at a whose chunk starts at
    `anchor` (default a): the sink and [anchor - W, a)."""
    lo = a - window if anchor is None else anchor - window
    if lo <= sink:
        return torch.arange(a)
    return torch.cat([torch.arange(sink), torch.arange(lo, a)])


def build_step_plan(slots: list[int], computed: list[int], query_lens: list[int],
                    sink: int, window: int, block_size: int,
                    prompt_lens: list[int] | None = None, slack: int = 0,
                    questions: list[tuple[int, int, int]] = (),
                    chunk: int | None = None) -> StepPlan:
    """Indices for one step. Row r: request in store slot `slots[r]`, `computed[r]` tokens
    already processed, `query_lens[r]` tokens in this step (a prefill chunk, one decode token,
    or a verification step of 1 + K decode tokens). Queries at positions >= `prompt_lens[r]`
    of a multi-query row each get their own kernel row (None: every row is a chunk, as
    without speculation). `slack`: the ring's K extra slots (see the module docstring).
    `questions`: (row, k, first index) of patched scoring's question tokens (a head mask with
    a token policy), k extra tokens after the batch's, at positions right after row r's chunk:
    a kernel row each, [visible past | the chunk | the question], that nothing commits.
    `chunk`: canonical chunks (pool storage): prompt positions are chunked at multiples of
    `chunk` whatever vLLM's steps are, so a step's prompt queries are split there, and a piece
    of chunk [kE, ...) sees the sink, [kE - W, kE) and the chunk so far (None: the step is
    the chunk)."""
    ring = window + slack
    cap = sink + ring
    seq_lens, q_start, blocks = [], [0], []
    scratch_slots, prefix_dst, prefix_src, chunk_dst, chunk_src = [], [], [], [], []
    prefix_pos, prefix_row = [], []
    keep_src, keep_dst = [], []
    laid = 0        # rows of the laid-out tensor so far
    next_block = 1  # block 0 stays unused (mirrors vLLM's null block)

    def kernel_row(row: int, past: torch.Tensor, past_src: torch.Tensor,
                   step_src: torch.Tensor, q_len: int) -> None:
        nonlocal laid, next_block
        v, n = len(past_src), len(past_src) + len(step_src)
        nblocks = -(-n // block_size)
        row_blocks = list(range(next_block, next_block + nblocks))
        next_block += nblocks
        blocks.append(row_blocks)
        scratch_slots.append(torch.tensor(row_blocks).repeat_interleave(block_size)[:n]
                             * block_size + torch.arange(n) % block_size)
        prefix_dst.append(laid + torch.arange(v))
        prefix_src.append(past_src)
        prefix_pos.append(past)
        prefix_row.append(torch.full((v,), row))
        chunk_dst.append(laid + v + torch.arange(n - v))
        chunk_src.append(step_src)
        seq_lens.append(n)
        q_start.append(q_start[-1] + q_len)
        laid += n

    token_base, row_tokens = 0, []  # first batch token of this row; the rows' tokens
    for r, (slot, a, c) in enumerate(zip(slots, computed, query_lens)):
        in_prompt = prompt_lens is None or a < prompt_lens[r]
        anchor = a // chunk * chunk if chunk and in_prompt else a
        past = visible_before(a, sink, window, anchor)
        past_src = slot * cap + ring_slot(past, sink, ring)
        p = a + torch.arange(c)
        tokens = token_base + torch.arange(c)
        # queries before the prompt's end: one chunk row (the paper's chunk semantics)
        m = c if prompt_lens is None or (c == 1 and not chunk) else \
            min(c, max(prompt_lens[r] - a, 0))
        lo = a
        while lo < a + m and chunk:  # canonical chunks: a row per piece of a chunk
            start = lo // chunk * chunk
            hi = min(start + chunk, a + m)
            seen, upto = (past < sink) | (past >= start - window), p[: hi - a]
            kernel_row(r, past[seen], past_src[seen],
                       tokens[: hi - a][(upto < sink) | (upto >= start - window)], hi - lo)
            lo = hi
        if m and not chunk:
            kernel_row(r, past, past_src, tokens[:m], m)
        for i in range(m, c):  # decode queries: a row each, with their own window
            lo = p[i] - window
            seen = (past < sink) | (past >= lo)
            kernel_row(r, past[seen], past_src[seen],
                       tokens[: i + 1][(p[: i + 1] < sink) | (p[: i + 1] >= lo)], 1)
        # tokens of this step that a later step may still see: the sink, and the last W + K
        # (a rejected draft moves the next step back by at most K)
        keep = (p < sink) | (p >= a + c - ring)
        keep_src.append(tokens[keep])
        keep_dst.append(slot * cap + ring_slot(p[keep], sink, ring))
        token_base += c
        row_tokens.append((past, past_src, tokens))
    for r, k, first in questions:  # after every batch row, as the queries are ordered
        past, past_src, tokens = row_tokens[r]
        kernel_row(r, past, past_src, torch.cat([tokens, first + torch.arange(k)]), k)
    num_rows = len(blocks)
    width = max((len(b) for b in blocks), default=1)
    table = torch.zeros(num_rows, width, dtype=torch.int32)
    for r, b in enumerate(blocks):
        table[r, : len(b)] = torch.tensor(b, dtype=torch.int32)
    cat = lambda xs: torch.cat(xs).long() if xs else torch.zeros(0, dtype=torch.long)
    return StepPlan(num_reqs=num_rows, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                    query_start_loc=torch.tensor(q_start, dtype=torch.int32),
                    block_table=table, scratch_slots=cat(scratch_slots),
                    prefix_dst=cat(prefix_dst), prefix_src=cat(prefix_src),
                    chunk_dst=cat(chunk_dst), chunk_src=cat(chunk_src),
                    keep_src=cat(keep_src), keep_dst=cat(keep_dst),
                    max_seq_len=max(seq_lens, default=0), prefix_pos=cat(prefix_pos),
                    prefix_row=cat(prefix_row))


def lay_out_rows(plan: StepPlan, past: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """Token-major [visible past | visible step tokens] of every kernel row: `past` in
    `prefix_dst` order, `step` in `chunk_dst` order."""
    laid = step.new_empty(int(plan.seq_lens.sum()), *step.shape[1:])
    laid[plan.prefix_dst] = past
    laid[plan.chunk_dst] = step
    return laid


def lay_out_visible(plan: StepPlan, past: torch.Tensor, step: torch.Tensor, scale: float,
                    fp8: str | None) -> torch.Tensor:
    """`lay_out_rows` of one of K, V; with an fp8 cache (`fp8`: its format) `past` holds codes
    and both come out as the codes' grid values (the step quantized with `scale`), to be
    written with scale 1. The ring store and pool storage (`paged_layout`) both lay out so."""
    if fp8:
        past = grid_values(past, fp8, step.dtype)
        step = grid_values(quantize(step, scale, fp8), fp8, step.dtype)
    return lay_out_rows(plan, past, step)


class StreamingStore:
    """Sink + window K/V of one layer's streaming heads for every running request. With an fp8
    KV cache the ring holds fp8 codes (`fp8.py`), one byte per element like the paged cache."""

    def __init__(self, num_heads: int, head_dim: int, sink: int, window: int,
                 dtype: torch.dtype, slots: int = 8, slack: int = 0,
                 kv_cache_dtype: str = "auto"):
        self.num_heads, self.head_dim = num_heads, head_dim
        self.cap = sink + window + slack  # slack: speculative K (see the module docstring)
        self.fp8 = kv_cache_dtype if is_fp8(kv_cache_dtype) else None
        self.dtype = torch.uint8 if self.fp8 else dtype
        self.k = torch.zeros(slots * self.cap, num_heads, head_dim, dtype=self.dtype)
        self.v = torch.zeros_like(self.k)

    @property
    def slots(self) -> int:
        return self.k.shape[0] // self.cap

    def grow(self, slots: int) -> None:
        if slots <= self.slots:
            return
        extra = (slots - self.slots) * self.cap
        pad = torch.zeros(extra, self.num_heads, self.head_dim, dtype=self.dtype)
        self.k = torch.cat([self.k, pad])
        self.v = torch.cat([self.v, pad])

    def bytes_per_request(self) -> int:
        return 2 * self.cap * self.num_heads * self.head_dim * self.k.element_size()

    def lay_out(self, plan: StepPlan, key: torch.Tensor, value: torch.Tensor,
                scales: tuple[float, float] = (1.0, 1.0)):
        """[visible past | visible step tokens] per kernel row, as token-major K and V. fp8:
        as the codes' grid values (to be written with scale 1; `scales` quantize the step)."""
        return tuple(lay_out_visible(plan, ring[plan.prefix_src], x[plan.chunk_src], scale,
                                     self.fp8)
                     for ring, x, scale in ((self.k, key, scales[0]), (self.v, value, scales[1])))

    def commit(self, plan: StepPlan, key: torch.Tensor, value: torch.Tensor,
               scales: tuple[float, float] = (1.0, 1.0)) -> None:
        """Keep the step's tokens that may stay visible (sink, last W + K) in their slots."""
        k, v = key[plan.keep_src], value[plan.keep_src]
        if self.fp8:
            k, v = quantize(k, scales[0], self.fp8), quantize(v, scales[1], self.fp8)
        self.k[plan.keep_dst] = k
        self.v[plan.keep_dst] = v
