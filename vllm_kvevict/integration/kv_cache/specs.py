"""KV-cache specs: what vLLM's KV-cache manager allocates for each layer (worker side declares
them in `GPUModelRunner.get_kv_cache_spec`; the engine core groups them).

Head masks: a vLLM block spans every KV head of a layer, so each layer's spec declares only its
full heads (`num_kv_heads = #full`), and its streaming heads are a cache-only companion layer
with a `SinkWindowSpec` (`sink_window.py`); a layer with no full head shares its companion's
cache. Token eviction: a `TierAttentionSpec` (`FullAttentionSpec` plus a tier) per layer, specs
of different tiers refusing to merge, so `get_kv_cache_groups` makes one group (one block
table) per tier of layers, each on vLLM's `FullAttentionManager`; a decode budget's bounded
worst case rides on the spec for vLLM's start-up check. Design: docs/design/kv_cache.md
("Head masks", "PyramidKV"), docs/design/core.md ("Decode-time eviction"); ledger: `ledger.py`.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.kv_cache_interface import FullAttentionSpec

from vllm_kvevict.integration.kv_cache.head_pages import head_page_specs, slot_layer
from vllm_kvevict.integration.kv_cache.head_split import LayerHeads
from vllm_kvevict.integration.kv_cache.sink_window import (PromptFullSpec, SinkWindowSpec,
                                                           companion_name, is_companion,
                                                           prefix_retention)
from vllm_kvevict.ledger import LayerGroups, worst_case_by_length

logger = logging.getLogger("vllm.kvevict")  # under vLLM's logger: its handler and format


def paged_spec(spec, heads: LayerHeads):
    """The layer's stock spec with only its (padded) full heads (None if no rank has one)."""
    return dataclasses.replace(spec, num_kv_heads=heads.paged_heads) if heads.paged_heads else None


@dataclasses.dataclass(frozen=True, kw_only=True)
class TierAttentionSpec(FullAttentionSpec):
    """vLLM's full-attention spec of one layer, tagged with its eviction tier. Layers of one tier
    form one KV-cache group; layers of different tiers never merge."""

    tier: int = 0
    # (max_model_len, a request's most tokens here) pairs, `ledger.worst_case_by_length`
    max_tokens: tuple[tuple[int, int], ...] = ()

    @classmethod
    def merge(cls, specs):
        tiers = {getattr(s, "tier", None) for s in specs}
        bounds = {getattr(s, "max_tokens", None) for s in specs}
        # AssertionError is what vLLM's grouping code catches as "not mergeable".
        assert all(isinstance(spec, TierAttentionSpec) for spec in specs) and len(tiers) == 1 \
            and len(bounds) == 1, "layers of different eviction tiers belong to different groups"
        return dataclasses.replace(super().merge(specs), tier=tiers.pop(), max_tokens=bounds.pop())

    def max_memory_usage_bytes(self, vllm_config) -> int:
        """vLLM's start-up check ("one request of max_model_len fits") and its auto-fit, bounded
        by the policy's worst case at the first tabulated length >= max_model_len."""
        stock, n = super().max_memory_usage_bytes(vllm_config), vllm_config.model_config
        t = next((t for length, t in self.max_tokens if length >= n.max_model_len), None)
        return stock if t is None else min(stock, -(-t // self.block_size) * self.page_size_bytes)

    def is_uniform_with_collection(self, kv_cache_specs) -> bool:
        # Otherwise UniformTypeKVCacheSpecs.from_specs would put every tier in one group.
        return all(isinstance(spec, TierAttentionSpec) and spec.tier == self.tier
                   for spec in kv_cache_specs.values())


def retyped(spec, cls, **extra):
    """`spec`'s fields as a `cls` (a subclass of its spec type), `extra` fields over them."""
    fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.init}
    return cls(**{**fields, **extra})


def tier_of_layer(layer: int, num_layers: int, num_tiers: int) -> int:
    """Tiers are runs of consecutive layers (PyramidKV's budget decreases with depth)."""
    return layer // (num_layers // num_tiers)


def tier_specs(specs: dict, layer_index: dict[str, int], num_layers: int, num_tiers: int,
               max_tokens: list[tuple[int, list[int]]] | None = None) -> dict:
    """The runner's per-layer specs tagged with their tier (one group per tier) and the bound
    `max_tokens` ((length, per-tier tokens) pairs). Left alone with one tier and no bound, or
    when a layer is not plain full attention (the grouping holds for FullAttentionSpec only)."""
    if num_tiers <= 1 and not max_tokens:
        return specs
    odd = [name for name, spec in specs.items() if type(spec) is not FullAttentionSpec]
    if odd:
        logger.warning("vllm-kvevict: layer %s is not plain full attention (%s); token eviction "
                       "keeps one KV-cache group, every layer holding the largest budget",
                       odd[0], type(specs[odd[0]]).__name__)
        return specs
    out = {}
    for name, spec in specs.items():
        tier = tier_of_layer(layer_index[name], num_layers, num_tiers)
        out[name] = retyped(spec, TierAttentionSpec, tier=tier,
                            max_tokens=tuple((n, t[tier]) for n, t in max_tokens or ()))
    logger.info("vllm-kvevict: %d layers in %d eviction tiers (one KV-cache group each)",
                num_layers, num_tiers)
    return out


def layer_groups(kv_cache_config, num_layers: int) -> LayerGroups:
    """Which KV-cache group holds each layer, as vLLM formed the groups (same function in the
    scheduler and the worker, from the same KVCacheConfig). One group when unknown. Streaming
    heads' groups in the pool (`sink_window.py`) evict nothing: a layer counts in its full
    heads' group only, a layer without full heads (sharing its companion's cache) in none."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    streaming = {g for g, group in enumerate(groups)
                 if any(map(is_companion, group.layer_names))
                 or isinstance(_first_spec(group), SinkWindowSpec)}  # (flex: head slots)
    of_layer = [-1 if streaming else 0] * num_layers
    seen = [False] * num_layers
    for g, group in enumerate(groups):
        for name in group.layer_names:
            layer = extract_layer_index(name)
            if 0 <= layer < num_layers:
                seen[layer] = True
                if g not in streaming:
                    of_layer[layer] = g
    if len(groups) > 1 and not all(seen):
        raise RuntimeError(f"vllm-kvevict: layers {[l for l, s in enumerate(seen) if not s]} "
                           "are in no KV-cache group")
    return LayerGroups(tuple(of_layer), total=len(groups) if streaming else 0)


# -- the worker's specs (each kind's planner, worker/state.py) ------------------------------

def _attention_layers(runner) -> tuple[dict, dict[str, int]]:
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention import Attention
    layers = get_layers_from_vllm_config(runner.vllm_config, Attention)
    return layers, {name: extract_layer_index(name) for name in layers}


def declare_head_mask_specs(runner, stock_specs, state) -> dict:
    """A head mask's specs (`HeadMaskPlanner`): its streaming heads in their companions'
    groups and its full heads in each layer's paged spec (flex path: a cache layer per head)."""
    layers, index = _attention_layers(runner)
    if state.head_pages:
        return declare_head_page_specs(runner, stock_specs, state, layers, index)
    return _declare_pool_specs(runner, stock_specs, state, layers, index)


def declare_token_specs(runner, stock_specs, state) -> dict:
    """Token eviction alone (`TokenPlanner`): every head is full, the layers in their tiers."""
    _, index = _attention_layers(runner)
    specs = stock_specs()
    num_layers, cfg, bound = state.served.shape.num_layers, state.config, None
    tiers = cfg.num_tiers(num_layers)
    if cfg.decode_budget is not None:  # the policy's worst case is bounded: tell vLLM
        vc = runner.vllm_config
        bound = worst_case_by_length(
            state.served.policy, vc.model_config.max_model_len,
            cfg.eviction_chunk or vc.scheduler_config.max_num_batched_tokens,
            LayerGroups.tiers(num_layers, tiers))
    return tier_specs(specs, index, num_layers, tiers, bound)


class StreamingCacheLayer(torch.nn.Module, AttentionLayerBase):
    """A cache-only layer holding one attention layer's streaming heads in vLLM's pool (flex
    path: one of its KV heads, `head_slots`): vLLM declares its spec, allocates, binds and builds
    metadata for it like any attention layer; the real layer's backend reads and writes it
    (the pattern of vLLM's own cache-only companion layers). Never run as a module."""

    def __init__(self, layer_name: str, spec, backend, num_heads: int) -> None:
        super().__init__()
        self.layer_name, self.num_heads = layer_name, num_heads
        self._spec, self._backend = spec, backend
        self.kv_cache = torch.tensor([])

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache

    def get_attn_backend(self):
        return self._backend

    def get_kv_cache_spec(self, vllm_config):
        return self._spec


def _declare_pool_specs(runner, stock_specs, state, layers, index) -> dict:
    """A head mask: each layer's full heads in its own spec (a layer without any shares its
    companion's cache, which gives it attention metadata), its streaming heads in a companion
    `StreamingCacheLayer` with a `SinkWindowSpec` (`sink_window.py`)."""
    context = runner.vllm_config.compilation_config.static_forward_context
    cfg = state.config
    companions = {}
    for name, layer in layers.items():
        heads = state.heads[index[name]]
        if not heads.companion_heads:  # (tensor parallel: on every rank if on any)
            continue
        companion = companion_name(name)
        if not heads.paged_heads:
            layer.kv_sharing_target_layer_name = companion
        companions[name] = companion
    specs = stock_specs()
    for name, companion in companions.items():
        heads, base = state.heads[index[name]], layers[name]
        spec = SinkWindowSpec(block_size=state.block_size, num_kv_heads=heads.companion_heads,
                              head_size=state.head_dim, dtype=runner.kv_cache_dtype,
                              sliding_window=cfg.window + 1, sink=cfg.sink, chunk=state.chunk,
                              retention=prefix_retention(runner.vllm_config))
        # (vLLM's registration of cache-only layers: a name -> layer entry of the context)
        context[companion] = StreamingCacheLayer(
            companion, spec, base.get_attn_backend(),
            heads.companion_heads * heads.queries_per_kv)
        specs[companion] = spec
    full_block = cfg.full_block_size or state.block_size  # (`--kv-full-block-size`)
    for name, spec in list(specs.items()):
        if name in layers:
            full = paged_spec(spec, state.heads[index[name]])
            specs[name] = retyped(full, PromptFullSpec, block_size=full_block)
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
        base = slot_layer(slot)
        if slot != base:  # (vLLM's registration of cache-only layers, as for companions)
            context[slot] = StreamingCacheLayer(slot, spec, layers[base].get_attn_backend(),
                                                state.heads[index[base]].queries_per_kv)
    return specs


def _first_spec(group):
    spec = getattr(group, "kv_cache_spec", None)  # (a group of one type: its first layer's)
    return getattr(spec, "kv_cache_specs", {}).get(group.layer_names[0], spec)
