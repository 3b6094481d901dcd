"""Attention of the reference oracle: an explicit KV cache and masked softmax attention.

Plain PyTorch, one sequence, no batch; nothing here is shared with the vLLM path. Shapes:
queries [num_q_heads, T, d]; keys and values [num_kv_heads, N, d]. Query head h reads KV head
h // group (group = num_q_heads // num_kv_heads), as transformers' `repeat_kv` lays them out.

Which key a query sees is decided by true token positions only (`policies/streaming.py`):
- full head: every cached key and the current chunk causally;
- streaming head: while chunk [a, b) runs, the sink (positions < sink), the last `window`
  positions before a (a - window <= p < a) and the whole chunk causally; a decode step at t is
  the chunk [t, t + 1). After the chunk the head's cache is cut to sink + the last `window`
  positions, so with one chunk holding the whole prompt prefill is fully causal.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

EMPTY = -1  # position of a padding slot: heads of one layer may hold different numbers of KVs


@dataclass
class LayerKV:
    """One layer's cache: per KV head the kept keys (RoPE applied), values and true positions.

    Rows are padded to the longest head with `EMPTY` positions; each head's entries are in
    ascending position order.
    """

    keys: torch.Tensor  # [H, N, d]
    values: torch.Tensor  # [H, N, d]
    positions: torch.Tensor  # [H, N], long

    @classmethod
    def empty(cls, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
              device: torch.device | str = "cpu") -> "LayerKV":
        kv = torch.empty(num_kv_heads, 0, head_dim, dtype=dtype, device=device)
        pos = torch.empty(num_kv_heads, 0, dtype=torch.long, device=device)
        return cls(kv, kv.clone(), pos)

    def lengths(self) -> torch.Tensor:
        """Kept KVs per head, long [H]."""
        return (self.positions != EMPTY).sum(dim=1)

    def kept_positions(self, head: int) -> list[int]:
        row = self.positions[head]
        return row[row != EMPTY].tolist()

    def with_new(self, keys: torch.Tensor, values: torch.Tensor,
                 positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The cache followed by T new tokens (positions [T]), as attention reads them."""
        num_heads = self.keys.shape[0]
        return (torch.cat([self.keys, keys], dim=1),
                torch.cat([self.values, values], dim=1),
                torch.cat([self.positions, positions.expand(num_heads, -1)], dim=1))

    def store(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
              keep: torch.Tensor) -> None:
        """Replace the cache by the entries of (keys, values, positions) where `keep` [H, N]."""
        keep = keep & (positions != EMPTY)
        if bool(keep.all()):
            self.keys, self.values, self.positions = keys, values, positions
            return
        # Move each head's kept slots to the front of its row, in their order, then cut the
        # rows to the longest head; shorter heads are padded with EMPTY.
        order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)
        width = int(keep.sum(dim=1).max()) if keep.numel() else 0
        order = order[:, :width]
        row = order.unsqueeze(-1).expand(-1, -1, keys.shape[-1])
        self.keys = torch.gather(keys, 1, row)
        self.values = torch.gather(values, 1, row)
        self.positions = torch.gather(positions, 1, order).masked_fill(
            ~torch.gather(keep, 1, order), EMPTY)


@dataclass
class KVCache:
    """The whole model's cache: one `LayerKV` per decoder layer."""

    layers: list[LayerKV]
    prompt_len: int = 0  # set by the prefill; decode tokens are the ones after it
    # decode-time eviction: per layer, the queries [Hq, 1, d] of the last decode steps
    decode_queries: list[list[torch.Tensor]] = field(default_factory=list)

    @classmethod
    def empty(cls, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
              device: torch.device | str = "cpu") -> "KVCache":
        return cls([LayerKV.empty(num_kv_heads, head_dim, dtype, device)
                    for _ in range(num_layers)])

    def lengths(self) -> torch.Tensor:
        """Kept KVs per (layer, KV head), long [L, H]."""
        return torch.stack([layer.lengths() for layer in self.layers])

    def kept_positions(self, layer: int, head: int) -> list[int]:
        return self.layers[layer].kept_positions(head)


def visibility(query_pos: torch.Tensor, key_pos: torch.Tensor, chunk_start: int,
               streaming: torch.Tensor, sink: int, window: int) -> torch.Tensor:
    """Bool [H, T, N]: may query t (at position query_pos[t]) read key n of KV head h.

    query_pos: long [T]; key_pos: long [H, N] (EMPTY = padding); streaming: bool [H];
    chunk_start: position a of the chunk's first token. Causality is by position, so the chunk
    does not see tokens placed after it (patched scoring's appended observation tokens).
    """
    key = key_pos.unsqueeze(1)  # [H, 1, N]
    causal = (key != EMPTY) & (key <= query_pos.view(1, -1, 1))
    in_sink = key < sink
    in_window = key >= chunk_start - window  # the last `window` before a, and the chunk itself
    streaming = streaming.view(-1, 1, 1)
    return causal & (~streaming | in_sink | in_window)


def streaming_cut(positions: torch.Tensor, next_position: int, streaming: torch.Tensor,
                  sink: int, window: int) -> torch.Tensor:
    """Bool [H, N]: which entries survive once every position < next_position is processed.

    Streaming heads keep the sink and the last `window` positions; full heads keep everything.
    """
    recent = positions >= next_position - window
    return ~streaming.view(-1, 1) | (positions < sink) | recent


def attend(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
           visible: torch.Tensor, scale: float, query_block: int = 512) -> torch.Tensor:
    """softmax(q k^T * scale, masked to `visible`) v, per query head; returns [Hq, T, d].

    Logits and softmax in float32 whatever the input dtype; the output is cast back to the
    queries' dtype. Queries are processed in blocks only to bound memory. Every query must see
    at least one key (itself). Differentiable (for the mask trainer).
    """
    num_q_heads, num_queries, head_dim = queries.shape
    num_kv_heads = keys.shape[0]
    group = num_q_heads // num_kv_heads
    # Scaling q instead of the logits is exact when scale is a power of two (d = 64, 128).
    q = (queries.float() * scale).reshape(num_kv_heads, group, num_queries, head_dim)
    k = keys.float()
    v = values.float()
    blocks = []
    for start in range(0, num_queries, query_block):
        rows = slice(start, start + query_block)
        seen = visible[:, rows]
        # Keys past the last one any query of the block sees (its causal future) are skipped:
        # they would get probability exactly 0.
        cols = int(seen.any(dim=1).any(dim=0).nonzero().max()) + 1
        logits = torch.einsum("hgtd,hnd->hgtn", q[:, :, rows], k[:, :cols])
        logits.masked_fill_(~seen[:, None, :, :cols], float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        blocks.append(torch.einsum("hgtn,hnd->hgtd", probs, v[:, :cols]))
    out = torch.cat(blocks, dim=2) if blocks else q.new_zeros(q.shape)
    return out.reshape(num_q_heads, num_queries, head_dim).to(queries.dtype)


def chunked_streaming_visibility(seq_len: int, chunk_size: int, sink: int,
                                 window: int) -> torch.Tensor:
    """Bool [seq_len, seq_len]: a streaming head's mask over a whole sequence prefilled in
    chunks of `chunk_size`, for one-pass training; equals what the chunked cache yields.

    Query p in chunk [a, b) sees key j <= p with j < sink, or j >= a - window.
    """
    pos = torch.arange(seq_len)
    chunk_start = (pos // chunk_size) * chunk_size
    query, key = pos.view(-1, 1), pos.view(1, -1)
    return (key <= query) & ((key < sink) | (key >= chunk_start.view(-1, 1) - window))
