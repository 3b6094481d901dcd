"""Reading K/V back out of vLLM's CPU paged cache.

The CPU kernels store a block's [block_size, head_dim] tile per KV head in an ISA-specific packed
order (keys transposed for `vec`/`vec16`, keys and values pair-interleaved for `amx`), so plain
indexing returns scrambled numbers. `PagedLayout` learns the packing instead of hard-coding it:
it writes two small-integer index patterns (exact in every float dtype the kernels take) through
vLLM's own `cpu_attn_reshape_and_cache` into a scratch block and records where each element
landed. Used by decoupled token eviction (`--kv-eviction-chunk`: a chunk's earlier steps' K/V
are only in the paged cache) and by the streaming heads' pool storage (`lay_out_from_pool`:
each step reads their window back).
"""

from __future__ import annotations

import functools
import importlib

import torch
from vllm.forward_context import get_forward_context
from vllm.v1.kv_cache_layout import KVCacheLayout

from vllm_kvevict.integration.attention.fp8 import grid_values, is_fp8, layer_scales
from vllm_kvevict.integration.attention.step_plan import lay_out_visible, window_rows
from vllm_kvevict.integration.kv_cache.sink_window import companion_name
from vllm_kvevict.integration.plugins.versions import CPU_OPS

ops = importlib.import_module(CPU_OPS)  # vLLM's CPU attention ops (moved in 0.34)

# Index digits written per probe pass: small integers, exact in the model's float dtypes (base
# 256) and in both fp8 formats (0..7; e5m2 rounds 9 down to 8), so each element's code reads back
# as the digit written.
_BASE = {"auto": 256, "fp8": 8}


@functools.lru_cache(maxsize=None)
def _probe(dtype: torch.dtype, block_size: int, head_dim: int, isa: str,
           kv_cache_dtype: str = "auto"):
    """(key, value) long tensors [block_size * head_dim]: raw position -> logical index. fp8
    (`kv_cache_dtype`): the cache holds uint8 codes, read back as their grid values."""
    fp8 = is_fp8(kv_cache_dtype)
    base = _BASE["fp8" if fp8 else "auto"]
    numel = block_size * head_dim
    logical = torch.arange(numel).view(block_size, 1, head_dim)
    cache = torch.zeros(1, 1, 2 * block_size, head_dim, dtype=torch.uint8 if fp8 else dtype)
    key_cache, value_cache = cache.chunk(2, dim=2)
    slots = torch.arange(block_size)
    key_at, value_at = torch.zeros(numel, dtype=torch.long), torch.zeros(numel, dtype=torch.long)
    weight = 1
    while weight < numel:
        values = ((logical // weight) % base).to(torch.float32 if fp8 else dtype)
        ops.cpu_attn_reshape_and_cache(values, values, key_cache, value_cache, slots, isa,
                                       k_scale=1.0, v_scale=1.0, kv_cache_dtype=kv_cache_dtype)
        for at, written in ((key_at, key_cache), (value_at, value_cache)):
            digits = written[0, 0].flatten()
            if fp8:
                digits = grid_values(digits, kv_cache_dtype, torch.float32)
            at += digits.long() * weight
        weight *= base
    for name, at in (("key", key_at), ("value", value_at)):
        if not torch.equal(at.sort().values, torch.arange(numel)):
            raise RuntimeError(f"vllm-kvevict: the {isa} paged {name} layout is not a "
                               f"permutation of a block's elements; cannot read it back")
    return key_at, value_at


class PagedLayout:
    """Reads tokens of one request's block row out of a layer's key and value caches."""

    def __init__(self, dtype: torch.dtype, block_size: int, head_dim: int, isa: str,
                 kv_cache_dtype: str = "auto"):
        key_at, value_at = _probe(dtype, block_size, head_dim, isa, kv_cache_dtype)
        # logical index -> raw position
        self.key_from = torch.empty_like(key_at)
        self.key_from[key_at] = torch.arange(key_at.numel())
        self.value_from = torch.empty_like(value_at)
        self.value_from[value_at] = torch.arange(value_at.numel())
        self.block_size, self.head_dim = block_size, head_dim
        # [2, bs, d]: K's then V's raw position of (slot in block, dim), both index dtypes
        table = torch.stack([self.key_from, self.value_from]).view(2, block_size, head_dim)
        self._table = {torch.long: table, torch.int32: table.to(torch.int32)}

    def read(self, key_cache: torch.Tensor, value_cache: torch.Tensor, block_row: torch.Tensor,
             start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [count, H, d] of physical positions [start, start + count) of a request
        whose blocks are `block_row` (block ids in order)."""
        pos = torch.arange(start, start + count)
        slots = block_row.long()[pos // self.block_size] * self.block_size + pos % self.block_size
        return self.gather(key_cache, value_cache, slots)

    def gather(self, key_cache: torch.Tensor, value_cache: torch.Tensor,
               slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [n, H, d] at flat pool slots (block id * block_size + offset), any order."""
        return self.split(self.gather_flat(key_cache,
                                           self.flat_offsets(key_cache, value_cache, slots)),
                          key_cache.shape[1], len(slots))

    def flat_offsets(self, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     slots: torch.Tensor) -> torch.Tensor:
        """Storage offsets, relative to `key_cache`'s first element, of K then V of every head
        of `key_cache` (views of one [blocks, H, 2 bs, d] tensor, any block and head strides)
        at flat pool `slots`, in [2, H, n, d] order: one broadcast add over the block's
        packing table, int32 where the storage allows. The layers of a KV-cache group share
        them (same block table, same strides)."""
        numel = key_cache.untyped_storage().nbytes() // key_cache.element_size()
        dtype = torch.int32 if numel < 2**31 else torch.long
        shift = value_cache.storage_offset() - key_cache.storage_offset()
        heads = torch.arange(key_cache.shape[1]) * key_cache.stride(1)
        base = ((slots // self.block_size * key_cache.stride(0))[None, None] + heads[None, :, None]
                + torch.tensor([0, shift])[:, None, None]).to(dtype)     # [2, H, n]
        return (self._table[dtype][:, None, slots % self.block_size] + base[..., None]).view(-1)

    @staticmethod
    def gather_flat(key_cache: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        """The elements at `flat_offsets` (one gather of exactly the elements read: unpacking
        whole blocks instead cost 6x more per decode step)."""
        storage = torch.as_strided(key_cache, (key_cache.untyped_storage().nbytes()
                                               // key_cache.element_size(),), (1,), 0)
        return storage[key_cache.storage_offset():].index_select(0, at)

    def split(self, flat: torch.Tensor, heads: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`gather_flat`'s result as K and V [n, H, d] (views)."""
        kv = flat.view(2, heads, n, self.head_dim).transpose(1, 2)
        return kv[0], kv[1]


@functools.lru_cache(maxsize=None)
def paged_layout(dtype: torch.dtype, block_size: int, head_dim: int, isa: str,
                 kv_cache_dtype: str = "auto") -> PagedLayout:
    """The layout of a paged cache of these parameters (probed once per process)."""
    return PagedLayout(dtype, block_size, head_dim, isa, kv_cache_dtype)


# -- streaming heads in vLLM's pool (sink_window.py): the worker side ---------------------------

# Groups of different page sizes: the block-outer layout (the CPU kernels take any block stride)
POOL_LAYOUTS = (KVCacheLayout.BLHNC,)


def store_step(impl, layer, keys, values):
    """Write the step's K/V of `layer`'s streaming heads at their logical slots in the
    companion layer's cache (vLLM's slot mapping of its KV-cache group; the manager above frees
    what leaves sink + window). Returns the group's metadata and this rank's K and V caches."""
    context = get_forward_context()
    name = companion_name(layer.layer_name)
    meta = context.attn_metadata[name]
    # tensor parallel: this rank's streaming heads first, the companion's padding unused
    key_cache, value_cache = impl.head_caches("pool", context.no_compile_layers[name].kv_cache,
                                              keys.shape[1])
    n, slots = meta.num_actual_tokens, meta.slot_mapping
    if keys.shape[0] != n:  # (rows past the step's tokens: patched questions, never stored)
        keys, values = keys[:n], values[:n]
    k_scale, v_scale = layer_scales(layer)
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache,
                                   slots if slots.shape[0] == n else slots[:n], layer.isa,
                                   k_scale=k_scale, v_scale=v_scale,
                                   kv_cache_dtype=impl.kv_cache_dtype)
    return meta, key_cache, value_cache


def step_offsets(plan, tag: str, meta, layout, key_cache, value_cache, rows, pos):
    """`flat_offsets` of rows' positions `pos` in a KV-cache group's blocks, computed once per
    step and group (its layers share block table and strides; each layer gathers relative to
    its own cache) and kept in the step plan under `tag`."""
    key = (tag, id(meta.block_table), key_cache.stride(0), key_cache.stride(1),
           key_cache.shape[1], value_cache.storage_offset() - key_cache.storage_offset())
    at = plan.kernel_schedules.get(key)
    if at is None:
        bs = layout.block_size
        slots = meta.block_table.long()[rows, pos // bs] * bs + pos % bs
        at = plan.kernel_schedules[key] = layout.flat_offsets(key_cache, value_cache,
                                                              slots.reshape(-1))
    return at


def lay_out_from_pool(impl, layer, plan, keys, values):
    """One layer's streaming heads in a step (`impl`: the attention impl of `layer`): write the
    step's K/V to the pool (`store_step`), then read each kernel row's visible past back from
    the group's blocks and lay it out before the step's tokens (fp8: as the codes' grid
    values)."""
    meta, key_cache, value_cache = store_step(impl, layer, keys, values)
    # (a patched question's rows follow the batch's: laid out from here, never stored)
    block_size = key_cache.shape[2]
    fp8 = impl.kv_cache_dtype if is_fp8(impl.kv_cache_dtype) else None
    layout = paged_layout(key_cache.dtype, block_size, impl.head_size, layer.isa, fp8 or "auto")
    offsets = step_offsets(plan, "pool", meta, layout, key_cache, value_cache,
                           plan.prefix_row, plan.prefix_pos)
    past = layout.split(layout.gather_flat(key_cache, offsets), key_cache.shape[1],
                        len(plan.prefix_pos))
    return tuple(lay_out_visible(plan, p, x[plan.chunk_src], scale, fp8)
                 for p, x, scale in zip(past, (keys, values),
                                        layer_scales(layer)))


def decode_window(impl, layer, plan, keys, values):
    """A `decode_pos` step (one decode query per row, rows of equal length): K and V
    [H, B, P + 1, d] of each row's sink + window, then its own token, read back with one
    gather per layer at offsets computed once per step and group (`step_offsets`); the step's
    K/V are written to the pool first (`store_step`), each row's own token is taken from the
    forward."""
    meta, key_cache, value_cache = store_step(impl, layer, keys, values)
    h = keys.shape[1]
    B, L = plan.decode_pos.shape
    layout = paged_layout(key_cache.dtype, key_cache.shape[2], impl.head_size, layer.isa)
    at = step_offsets(plan, "window", meta, layout, key_cache, value_cache,
                      torch.arange(B)[:, None], plan.decode_pos)
    kv = layout.gather_flat(key_cache, at).view(2, h, B, L, -1)
    k, v = kv[0], kv[1]
    # the decode rows' own tokens are the step's tokens in batch order (`chunk_src`)
    k[:, :, -1], v[:, :, -1] = keys[:B].transpose(0, 1), values[:B].transpose(0, 1)
    return k, v


def decode_in_place(impl, layer, plan, config, query, keys, values, out) -> None:
    """A `decode_q` step (one decode query per row, rows of any length) whose sink is whole
    blocks: the step's K/V written to the pool (`store_step`), then vLLM's kernel in place over
    the group's pool blocks into `out`, through `step_plan.window_rows`'s virtual block rows
    (columns once per step, each group's rows once per step) and a sliding window of
    sink + W + 1 tokens; nothing is read back."""
    meta, key_cache, value_cache = store_step(impl, layer, keys, values)
    cache = plan.kernel_schedules
    if "window-rows" not in cache:
        cache["window-rows"] = window_rows(plan.decode_q, config.sink, config.window,
                                           key_cache.shape[2])
    cols, seq_lens = cache["window-rows"]
    table = cache.get(("window-table", id(meta.block_table)))
    if table is None:
        table = cache[("window-table", id(meta.block_table))] = torch.gather(
            meta.block_table[:len(cols)], 1, cols).contiguous()
    window, heads = config.sink + config.window + 1, keys.shape[1]
    sched = impl._schedule(layer, cache, ("window-kernel", heads), plan.num_reqs,
                           query.shape[1], heads, seq_lens, plan.query_start_loc, query.dtype,
                           window)
    impl._kernel(layer, query, (key_cache, value_cache), out, plan.query_start_loc, seq_lens,
                 table, sched, window)
