"""The FlexAttention path's pool storage of a head mask: a cache layer per KV head.

FlexAttention reads a paged cache only as one flat token axis, which vLLM's layer-outer layout
(LBNHC) gives and the block-outer one the CPU path's companions need (BLHNC, for groups of
mixed page sizes) does not. So on this path every KV head is its own cache layer with a
one-head page (`head_slots`: the attention layer holds its first head, cache-only layers the
others), full heads under a full-attention spec, streaming heads under `SinkWindowSpec` (their
blocks freed as the window moves, `sink_window.py`): one page size, so vLLM lays the pool out
layer-outer. The group plan is the CPU path's (`pool_groups.plan_widths`) with each layer's full
heads and its streaming heads as items (`head_page_groups`): a layer's heads of one kind sit
side by side in one group, which vLLM's layer-outer allocation puts one layer stride apart, so
the worker reads them as one multi-head cache without a copy (`HeadSlots`).
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from vllm_kvevict.integration.head_split import LayerHeads
from vllm_kvevict.integration.kv_cache_specs import StreamingCacheLayer, retyped
from vllm_kvevict.integration.streaming.pool_groups import planned_groups
from vllm_kvevict.integration.streaming.sink_window import (PromptFullSpec, SinkWindowSpec,
                                                            prefix_retention)

logger = logging.getLogger("vllm.kvevict")  # under vLLM's logger: its handler and format

HEAD_SUFFIX = ".kvevict_head"


def head_slots(name: str, heads: LayerHeads) -> tuple[list[str], list[str]]:
    """The cache layers of attention layer `name` on the FlexAttention path: its (padded) full
    heads' slots, then its streaming heads'; one KV head each, the first slot is the layer
    itself. This rank's full heads use the first len(full_kv) full slots, its streaming heads
    the first len(streaming_kv) streaming slots (tensor parallel pads as `layer_heads`)."""
    names = [name] + [f"{name}{HEAD_SUFFIX}{j}"
                      for j in range(1, heads.paged_heads + heads.companion_heads)]
    return names[:heads.paged_heads], names[heads.paged_heads:]


def head_page_specs(layers: dict[str, LayerHeads], full_spec, streaming_spec) -> dict:
    """Every head slot's spec (`head_slots`): `full_spec` or `streaming_spec`, one KV head each."""
    specs = {}
    for name, heads in layers.items():
        full, streaming = head_slots(name, heads)
        specs.update({slot: full_spec for slot in full})
        specs.update({slot: streaming_spec for slot in streaming})
    return specs


def declare_head_page_specs(runner, stock_specs, state, layers, index) -> dict:
    """A head mask on the FlexAttention path: every KV head its own cache layer with a
    one-head page, full heads with a full-attention spec, streaming heads with a
    `SinkWindowSpec` that keeps whole steps (`keep_step`). One page size for every layer
    lets vLLM lay the pool out layer-outer (LBNHC, the only layout FlexAttention reads
    without a copy), and `head_page_groups` places a layer's slots of one kind side by side
    in one group, so that they read as one multi-head cache (`HeadSlots`)."""
    context = runner.vllm_config.compilation_config.static_forward_context
    cfg = state.config
    one = dataclasses.replace(next(iter(stock_specs().values())), num_kv_heads=1)
    streaming_spec = SinkWindowSpec(
        block_size=state.block_size, num_kv_heads=1, head_size=state.head_dim,
        dtype=runner.kv_cache_dtype, sliding_window=cfg.window + 1, sink=cfg.sink,
        chunk=state.chunk, retention=prefix_retention(runner.vllm_config), keep_step=True)
    specs = head_page_specs({name: state.heads[index[name]] for name in layers},
                            retyped(one, PromptFullSpec), streaming_spec)
    for slot, spec in specs.items():
        base = slot.split(HEAD_SUFFIX)[0]
        if slot != base:  # (vLLM's registration of cache-only layers, as for companions)
            context[slot] = StreamingCacheLayer(slot, spec, layers[base].get_attn_backend(),
                                                state.heads[index[base]].queries_per_kv)
    return specs


def head_page_groups(vllm_config, specs: dict) -> list:
    """The FlexAttention path's groups (`head_slots`: a cache layer per KV head, one page
    size): `pool_groups.planned_groups` with each layer's full slots and its streaming slots as
    items of their head counts, kept side by side in one group and in slot order, so that
    vLLM's layer-outer layout puts them one layer stride apart."""
    slots: dict[tuple[str, bool], list[str]] = {}  # (layer, streaming) -> its slots
    for name, spec in specs.items():
        slots.setdefault((name.split(HEAD_SUFFIX)[0], isinstance(spec, SinkWindowSpec)),
                         []).append(name)
    width, full_groups, stream_groups, groups = planned_groups(
        vllm_config, specs, [(k, len(v)) for k, v in slots.items() if not k[1]],
        [(k, len(v)) for k, v in slots.items() if k[1]], slots.__getitem__)
    logger.info("vllm-kvevict: KV-cache groups in the pool (a cache layer per KV head): %d of "
                "full heads, %d of streaming heads, blocks of %d head pages",
                len(full_groups), len(stream_groups), width)
    return groups


class HeadSlots:
    """One attention layer's heads of one kind (full or streaming) in the pool: their cache
    layers (`head_slots`; this rank's heads use the first ones), their KV-cache
    group's metadata, and the layers' caches read as one [blocks, heads, block, 2 * head]
    tensor: vLLM's layer-outer layout places a group's layers one layer stride apart."""

    def __init__(self, names: list[str], kv_heads: tuple[int, ...], queries_per_kv: int,
                 streaming: bool) -> None:
        self.names, self.streaming = names, streaming
        self.kv_heads = torch.tensor(kv_heads, dtype=torch.long)  # (indexes K and V)
        self.q_heads = torch.tensor([h * queries_per_kv + i for h in kv_heads
                                     for i in range(queries_per_kv)], dtype=torch.long)
        self._cache: tuple | None = None

    def metadata(self, context):
        """The group's attention metadata of this step (None in profiling runs)."""
        per_layer = context.attn_metadata
        return per_layer.get(self.names[0]) if isinstance(per_layer, dict) else None

    def cache(self, context) -> torch.Tensor:
        layers = [context.no_compile_layers[n].kv_cache for n in self.names[:len(self.kv_heads)]]
        first = layers[0]
        if self._cache is not None and self._cache[0] is first:
            return self._cache[1]
        # (one head: vLLM's layer stride all the same, so that every view has the same strides)
        stride = (layers[1].data_ptr() - first.data_ptr()) // first.element_size() \
            if len(layers) > 1 else first.shape[0] * first.stride(0)
        for i, t in enumerate(layers):
            if (t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                    or t.data_ptr() != first.data_ptr() + i * stride * first.element_size()
                    or t.stride() != first.stride()):
                raise RuntimeError(f"vllm-kvevict: the cache layers {self.names} are not one "
                                   "layer stride apart in vLLM's KV cache; the FlexAttention "
                                   "path cannot read them as one cache")
        blocks, _, block_size, width = first.shape
        view = torch.as_strided(first, (blocks, len(layers), block_size, width),
                                (first.stride(0), stride, first.stride(2), first.stride(3)),
                                first.storage_offset())
        self._cache = (first, view)
        return view
