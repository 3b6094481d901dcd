"""The hybrid attention the gates are trained through: per KV head,

    out = z * full_attention + (1 - z) * streaming_attention

with z shared by the query heads of a GQA group (query head h reads KV head h // group, as
transformers' `repeat_kv` and the reference oracle lay them out).

- full attention: causal.
- streaming attention: the reference oracle's chunked semantics, i.e. the boolean mask
  `reference.chunked_streaming_visibility(n, chunk, sink, window)`: a query in prefill chunk
  [a, b) sees the sink (< sink), the last `window` positions before a, and the chunk causally.
  The mask is taken from the reference module, never rebuilt here, so training and inference
  cannot drift apart (`ReferenceRunner.one_pass_logits` is the same one-pass form).

Both run through torch's fused `scaled_dot_product_attention` (float32 softmax for float32
inputs; never an [H, n, n] probability tensor in memory). Streaming attention is evaluated in
query blocks: for each block only the key columns that some query of the block can see are
gathered (sink + window + chunk so far), with the block's rows of the visibility mask as a
boolean mask, so its cost grows with sink + window + chunk, not with n.

Heads marked `saturated` (PruLong: the hard-concrete sample was clamped, so z is exactly 0 or 1
and has no gradient) skip the pass whose weight is 0: a streaming-only head costs no full
attention and vice versa. Without the mark both passes run, as the gradient of z needs
full - streaming (DuoAttention's continuous gates, and z exactly at a clamp edge).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_kvevict.reference.attention import chunked_streaming_visibility


def full_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention; q [Hq, T, d], k and v [H, T, d] (GQA) -> [Hq, T, d]."""
    return F.scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                                          is_causal=True, scale=scale, enable_gqa=True)[0]


class StreamingMask:
    """A streaming head's visibility over one sequence length, split into query blocks.

    blocks: (row start, row end, key column indices [c], mask rows [end - start, c]), the two
    tensors on `device`; they are computed on the CPU (nonzero is data-dependent) and moved.
    prefix[i]: c when block i's columns are 0..c-1 (sliced instead of gathered), else None.
    """

    def __init__(self, seq_len: int, chunk_size: int, sink: int, window: int,
                 query_block: int = 512, device: torch.device | str = "cpu") -> None:
        self.seq_len, self.chunk_size, self.sink, self.window = seq_len, chunk_size, sink, window
        visible = chunked_streaming_visibility(seq_len, chunk_size, sink, window).to("cpu")
        self.blocks: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []
        self.prefix: list[int | None] = []
        for start in range(0, seq_len, query_block):
            end = min(start + query_block, seq_len)
            rows = visible[start:end]
            cols = rows.any(dim=0).nonzero().squeeze(1)
            contiguous = cols.numel() == int(cols[-1]) + 1
            self.prefix.append(cols.numel() if contiguous else None)
            self.blocks.append((start, end, cols.to(device), rows[:, cols].contiguous().to(device)))

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  scale: float) -> torch.Tensor:
        """Streaming attention; q [Hq, T, d], k and v [H, T, d] -> [Hq, T, d]."""
        if q.shape[1] != self.seq_len:
            raise ValueError(f"mask built for {self.seq_len} tokens, got {q.shape[1]}")
        out = []
        for (start, end, cols, mask), prefix in zip(self.blocks, self.prefix):
            if prefix is not None:  # a contiguous prefix: slicing avoids a copy
                kb, vb = k[:, :prefix], v[:, :prefix]
            else:
                kb, vb = k[:, cols], v[:, cols]
            out.append(F.scaled_dot_product_attention(
                q[None, :, start:end], kb[None], vb[None], attn_mask=mask, scale=scale,
                enable_gqa=True)[0])
        return torch.cat(out, dim=1)


def hybrid_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     z: torch.Tensor, streaming: StreamingMask,
                     saturated: torch.Tensor | None = None) -> torch.Tensor:
    """z * full + (1 - z) * streaming per KV head; z [H] (float, differentiable).

    saturated: optional bool [H], True where z is exactly 0 or 1 with zero gradient; such heads
    skip the attention pass whose weight is 0.
    """
    num_q_heads, num_tokens, head_dim = q.shape
    num_kv_heads = k.shape[0]
    group = num_q_heads // num_kv_heads
    zq = z.to(q.dtype).view(num_kv_heads, 1, 1, 1)
    qg = q.view(num_kv_heads, group, num_tokens, head_dim)
    with torch.no_grad():
        if saturated is None:
            saturated = torch.zeros(num_kv_heads, dtype=torch.bool, device=z.device)
        need_full = ~(saturated & (z == 0))
        need_stream = ~(saturated & (z == 1))
    out = None
    for need, attn, weight in ((need_full, full_attention, zq),
                               (need_stream, streaming.attention, 1 - zq)):
        heads = need.nonzero().squeeze(1)
        if heads.numel() == 0:
            continue
        if heads.numel() == num_kv_heads:
            term = weight * attn(q, k, v, scale).view_as(qg)
        else:
            part = attn(qg[heads].reshape(-1, num_tokens, head_dim), k[heads], v[heads],
                        scale).view(heads.numel(), group, num_tokens, head_dim)
            term = q.new_zeros(qg.shape).index_add(0, heads, weight[heads] * part)
        out = term if out is None else out + term
    return out.view_as(q)
