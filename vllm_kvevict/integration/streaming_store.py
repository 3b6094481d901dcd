"""Sink + window K/V of streaming heads, per request, outside vLLM's paged pool.

Semantics (`policies/streaming.py`): a streaming head running a chunk [a, a + c) sees the sink (first
s tokens), the last W tokens before a, and the chunk causally; afterwards it keeps sink + last W.
The tokens it may see before a are exactly positions [0, a) if a <= s + W, else [0, s) and
[a - W, a): v = min(a, s + W) tokens.

Layout: per layer a plain tensor [slots * (s + W), heads, head_dim] for K and for V. Position p of a
request lives at ring slot p (p < s) or s + (p - s) mod W, so before every step the visible tokens
fill ring slots [0, v) exactly, whatever the step sizes were (attention does not care about key
order; RoPE is already in the keys). Each step:
  1. lay out [visible prefix | chunk] per request in a zeroed scratch paged cache (through vLLM's
     reshape-and-cache op, which knows the kernel's packed layouts) and run vLLM's own CPU kernel
     causally: it places query i at seq_len - q_len + i, which is exactly the streaming mask;
  2. write the chunk tokens that stay visible into their ring slots.
The index bookkeeping (`StepPlan`) is computed once per engine step and shared by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class StepPlan:
    """Per-step indices shared by every layer (built from the batch's rows)."""

    num_reqs: int
    seq_lens: torch.Tensor          # int32 [num_reqs]: visible prefix + chunk, per row
    query_start_loc: torch.Tensor   # int32 [num_reqs + 1]
    block_table: torch.Tensor       # int32 [num_reqs, max_blocks] into the scratch cache
    scratch_slots: torch.Tensor     # int64 [sum(seq_lens)]: scratch slot of each laid-out token
    prefix_dst: torch.Tensor        # long: rows of the laid-out tensor that come from the store
    prefix_src: torch.Tensor        # long: their store rows
    chunk_dst: torch.Tensor         # long: rows of the laid-out tensor that come from the chunk
    keep_src: torch.Tensor          # long: chunk token indices (in the batch) kept after the step
    keep_dst: torch.Tensor          # long: their store rows
    max_seq_len: int
    valid: bool = True
    # vLLM kernel work schedules for this step, per streaming-head count (filled lazily)
    kernel_schedules: dict = field(default_factory=dict)


def ring_slot(positions: torch.Tensor, sink: int, window: int) -> torch.Tensor:
    return torch.where(positions < sink, positions, sink + (positions - sink) % window)


def build_step_plan(slots: list[int], computed: list[int], query_lens: list[int],
                    sink: int, window: int, block_size: int) -> StepPlan:
    """Indices for one step. Row r: request in store slot `slots[r]`, `computed[r]` tokens
    already processed, `query_lens[r]` tokens in this step (a prefill chunk or one decode)."""
    cap = sink + window
    num_reqs = len(slots)
    seq_lens, q_start, blocks = [], [0], []
    scratch_slots, prefix_dst, prefix_src, chunk_dst, keep_src, keep_dst = [], [], [], [], [], []
    laid = 0       # rows of the laid-out tensor so far
    next_block = 1  # block 0 stays unused (mirrors vLLM's null block)
    token_base = 0  # first batch token of this row
    for slot, a, c in zip(slots, computed, query_lens):
        v = min(a, cap)
        n = v + c
        nblocks = -(-n // block_size)
        row_blocks = list(range(next_block, next_block + nblocks))
        next_block += nblocks
        blocks.append(row_blocks)
        pos = torch.arange(n)
        scratch_slots.append(torch.tensor(row_blocks).repeat_interleave(block_size)[:n]
                             * block_size + pos % block_size)
        prefix_dst.append(laid + torch.arange(v))
        prefix_src.append(slot * cap + torch.arange(v))
        chunk_dst.append(laid + v + torch.arange(c))
        # chunk tokens p in [a, a + c) visible after the step: p < s or p >= a + c - W
        p = a + torch.arange(c)
        keep = (p < sink) | (p >= a + c - window)
        keep_src.append(token_base + torch.arange(c)[keep])
        keep_dst.append(slot * cap + ring_slot(p[keep], sink, window))
        seq_lens.append(n)
        q_start.append(q_start[-1] + c)
        laid += n
        token_base += c
    width = max((len(b) for b in blocks), default=1)
    table = torch.zeros(num_reqs, width, dtype=torch.int32)
    for r, b in enumerate(blocks):
        table[r, : len(b)] = torch.tensor(b, dtype=torch.int32)
    cat = lambda xs: torch.cat(xs).long() if xs else torch.zeros(0, dtype=torch.long)
    return StepPlan(num_reqs=num_reqs, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                    query_start_loc=torch.tensor(q_start, dtype=torch.int32),
                    block_table=table, scratch_slots=cat(scratch_slots),
                    prefix_dst=cat(prefix_dst), prefix_src=cat(prefix_src),
                    chunk_dst=cat(chunk_dst), keep_src=cat(keep_src), keep_dst=cat(keep_dst),
                    max_seq_len=max(seq_lens, default=0))


class StreamingStore:
    """Sink + window K/V of one layer's streaming heads for every running request."""

    def __init__(self, num_heads: int, head_dim: int, sink: int, window: int,
                 dtype: torch.dtype, slots: int = 8):
        self.num_heads, self.head_dim = num_heads, head_dim
        self.cap = sink + window
        self.dtype = dtype
        self.k = torch.zeros(slots * self.cap, num_heads, head_dim, dtype=dtype)
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

    def lay_out(self, plan: StepPlan, key: torch.Tensor, value: torch.Tensor):
        """[visible prefix | chunk] per row, as token-major K and V tensors."""
        total = int(plan.seq_lens.sum())
        k = key.new_empty(total, self.num_heads, self.head_dim)
        v = value.new_empty(total, self.num_heads, self.head_dim)
        k[plan.prefix_dst] = self.k[plan.prefix_src]
        v[plan.prefix_dst] = self.v[plan.prefix_src]
        k[plan.chunk_dst] = key
        v[plan.chunk_dst] = value
        return k, v

    def commit(self, plan: StepPlan, key: torch.Tensor, value: torch.Tensor) -> None:
        """Keep the chunk tokens that stay visible (sink, last W) in their ring slots."""
        self.k[plan.keep_dst] = key[plan.keep_src]
        self.v[plan.keep_dst] = value[plan.keep_src]
