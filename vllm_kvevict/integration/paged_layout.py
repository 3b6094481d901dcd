"""Reading K/V back out of vLLM's CPU paged cache.

The CPU kernels store a block's [block_size, head_dim] tile per KV head in an ISA-specific packed
order (on this machine: keys transposed for `vec`/`vec16`, keys and values pair-interleaved for
`amx`), so plain indexing of the cache tensor returns scrambled numbers. Rather than hard-code
each packing, `PagedLayout` learns it: it writes two index patterns through vLLM's own
`cpu_attn_reshape_and_cache` into a scratch block and records where each (token, dim) element
landed. The patterns are small integers (< 256), exact in every float dtype the kernels take.

Used by decoupled token eviction (`eviction_chunk`): when an eviction chunk was prefilled over
several engine steps, its earlier steps' keys and values are only in the paged cache.
"""

from __future__ import annotations

import functools

import torch
from vllm import _custom_ops as ops


@functools.lru_cache(maxsize=None)
def _probe(dtype: torch.dtype, block_size: int, head_dim: int, isa: str):
    """(key, value) long tensors [block_size * head_dim]: raw position -> logical index."""
    numel = block_size * head_dim
    logical = torch.arange(numel).view(block_size, 1, head_dim)
    cache = torch.zeros(1, 1, 2 * block_size, head_dim, dtype=dtype)
    key_cache, value_cache = cache.chunk(2, dim=2)
    slots = torch.arange(block_size)
    found = []
    for part in (logical % 256, logical // 256):
        values = part.to(dtype)
        ops.cpu_attn_reshape_and_cache(values, values, key_cache, value_cache, slots, isa,
                                       k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
        found.append((key_cache[0, 0].flatten().long(), value_cache[0, 0].flatten().long()))
    (k_lo, v_lo), (k_hi, v_hi) = found
    key_at, value_at = k_hi * 256 + k_lo, v_hi * 256 + v_lo
    for name, at in (("key", key_at), ("value", value_at)):
        if not torch.equal(at.sort().values, torch.arange(numel)):
            raise RuntimeError(f"vllm-kvevict: the {isa} paged {name} layout is not a "
                               f"permutation of a block's elements; cannot read it back")
    return key_at, value_at


class PagedLayout:
    """Reads tokens of one request's block row out of a layer's key and value caches."""

    def __init__(self, dtype: torch.dtype, block_size: int, head_dim: int, isa: str):
        key_at, value_at = _probe(dtype, block_size, head_dim, isa)
        # logical index -> raw position
        self.key_from = torch.empty_like(key_at)
        self.key_from[key_at] = torch.arange(key_at.numel())
        self.value_from = torch.empty_like(value_at)
        self.value_from[value_at] = torch.arange(value_at.numel())
        self.block_size, self.head_dim = block_size, head_dim

    def read(self, key_cache: torch.Tensor, value_cache: torch.Tensor, block_row: torch.Tensor,
             start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [count, H, d] of physical positions [start, start + count) of a request
        whose blocks are `block_row` (block ids in order)."""
        bs, d = self.block_size, self.head_dim
        first, last = start // bs, (start + count - 1) // bs
        blocks = block_row[first:last + 1].long()
        out = []
        for cache, order in ((key_cache, self.key_from), (value_cache, self.value_from)):
            raw = cache[blocks]                                    # [nb, H, bs, d] packed
            nb, heads = raw.shape[0], raw.shape[1]
            tiles = raw.reshape(nb, heads, bs * d)[:, :, order].view(nb, heads, bs, d)
            tokens = tiles.permute(0, 2, 1, 3).reshape(nb * bs, heads, d)
            off = start - first * bs
            out.append(tokens[off:off + count])
        return out[0], out[1]

    def gather(self, key_cache: torch.Tensor, value_cache: torch.Tensor,
               slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [n, H, d] at flat pool slots (block id * block_size + offset), any order:
        each block touched is unpacked once."""
        bs, d = self.block_size, self.head_dim
        blocks, where = torch.unique(slots // bs, return_inverse=True)
        offsets = slots % bs
        out = []
        for cache, order in ((key_cache, self.key_from), (value_cache, self.value_from)):
            raw = cache[blocks]                                    # [nb, H, bs, d] packed
            nb, heads = raw.shape[0], raw.shape[1]
            tiles = raw.reshape(nb, heads, bs * d)[:, :, order].view(nb, heads, bs, d)
            out.append(tiles[where, :, offsets])                   # [n, H, d]
        return out[0], out[1]


@functools.lru_cache(maxsize=None)
def paged_layout(dtype: torch.dtype, block_size: int, head_dim: int, isa: str) -> PagedLayout:
    """The layout of a paged cache of these parameters (probed once per process)."""
    return PagedLayout(dtype, block_size, head_dim, isa)
