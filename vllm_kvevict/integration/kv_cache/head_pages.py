"""The FlexAttention path's pool storage of a head mask: a cache layer per KV head.

FlexAttention reads a paged cache only as one flat token axis, which vLLM's layer-outer layout
(LBNHC) gives and the CPU path's block-outer one (BLHNC) does not. So here every KV head is its
own cache layer with a one-head page (`head_slots`), full heads under a full-attention spec,
streaming heads under `SinkWindowSpec` (`sink_window.py`): one page size, so vLLM lays the pool
out layer-outer. Specs: `specs.declare_head_page_specs`; groups: `pool_groups.head_page_groups`,
which puts a layer's heads of one kind side by side in one group, one layer stride apart, so
the worker reads them as one multi-head cache without a copy (`HeadSlots`). Design:
docs/design/attention.md, "The CUDA path, on paper".
"""

from __future__ import annotations

import torch

from vllm_kvevict.integration.kv_cache.head_split import LayerHeads

HEAD_SUFFIX = ".kvevict_head"


def head_slots(name: str, heads: LayerHeads) -> tuple[list[str], list[str]]:
    """The cache layers of attention layer `name` on the FlexAttention path: its (padded) full
    heads' slots, then its streaming heads'; one KV head each, the first slot is the layer
    itself. This rank's full heads use the first len(full_kv) full slots, its streaming heads
    the first len(streaming_kv) streaming slots (tensor parallel pads as `layer_heads`)."""
    names = [name] + [f"{name}{HEAD_SUFFIX}{j}"
                      for j in range(1, heads.paged_heads + heads.companion_heads)]
    return names[:heads.paged_heads], names[heads.paged_heads:]


def slot_layer(slot: str) -> str:
    """The attention layer whose head a cache layer (`head_slots`) holds."""
    return slot.split(HEAD_SUFFIX)[0]


def is_head_slot(name: str) -> bool:
    """A cache-only layer of one KV head (the flex path's head slots beyond a layer's first)."""
    return HEAD_SUFFIX in name


def head_page_specs(layers: dict[str, LayerHeads], full_spec, streaming_spec) -> dict:
    """Every head slot's spec (`head_slots`): `full_spec` or `streaming_spec`, one KV head each."""
    specs = {}
    for name, heads in layers.items():
        full, streaming = head_slots(name, heads)
        specs.update({slot: full_spec for slot in full})
        specs.update({slot: streaming_spec for slot in streaming})
    return specs


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
