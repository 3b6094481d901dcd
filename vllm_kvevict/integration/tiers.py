"""Per-tier block tables for token eviction: one vLLM KV-cache group per tier of layers.

A vLLM KV-cache group is a set of layers that share one block table per request. With one
group, a request holds in every layer the blocks of its largest layer; PyramidKV keeps far
fewer tokens in high layers than in low ones, so that wastes most of its savings. vLLM's hybrid
allocator already supports several groups whose layers have equal page sizes (used for models
mixing full and sliding-window attention): every group has its own block table and allocates
its own blocks, the groups' layer caches alias one backing buffer, and a block id of any group
ties up one block's bytes of it (bytes of one group's layers).

So each layer of tier t declares a `TierAttentionSpec` (vLLM's `FullAttentionSpec` plus the tier
number). Specs of different tiers refuse to merge, so `get_kv_cache_groups` takes its hybrid
path (`_get_kv_cache_groups_uniform_page_size`) and makes one group per tier, in layer order;
tiers of equal layer counts need no padding layers. Every group gets vLLM's own
`FullAttentionManager` (the registry walks the MRO to FullAttentionSpec), and with prefix
caching off (always, for evicting policies) the coordinator is `KVCacheCoordinatorNoPrefixCache`,
which takes any number of groups. The scheduler ledger and the worker then count evictions per
group (token_eviction.py): a group gives back, per chunk, the chunk length minus the largest
count its layers keep.
"""

from __future__ import annotations

import dataclasses
import logging

from vllm.v1.kv_cache_interface import FullAttentionSpec

from vllm_kvevict.integration.token_eviction import LayerGroups

logger = logging.getLogger("vllm_kvevict")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TierAttentionSpec(FullAttentionSpec):
    """vLLM's full-attention spec of one layer, tagged with its eviction tier. Layers of one tier
    form one KV-cache group; layers of different tiers never merge."""

    tier: int = 0

    @classmethod
    def merge(cls, specs):
        tiers = {getattr(spec, "tier", None) for spec in specs}
        # AssertionError is what vLLM's grouping code catches as "not mergeable".
        assert all(isinstance(spec, TierAttentionSpec) for spec in specs) and len(tiers) == 1, (
            "layers of different eviction tiers belong to different KV cache groups")
        merged = super().merge(specs)
        return dataclasses.replace(merged, tier=tiers.pop())

    def is_uniform_with_collection(self, kv_cache_specs) -> bool:
        # Otherwise UniformTypeKVCacheSpecs.from_specs would put every tier in one group.
        return all(isinstance(spec, TierAttentionSpec) and spec.tier == self.tier
                   for spec in kv_cache_specs.values())


def tier_of_layer(layer: int, num_layers: int, num_tiers: int) -> int:
    """Tiers are runs of consecutive layers (PyramidKV's budget decreases with depth)."""
    return layer // (num_layers // num_tiers)


def tier_specs(specs: dict, layer_index: dict[str, int], num_layers: int, num_tiers: int) -> dict:
    """The runner's per-layer specs with each layer tagged with its tier (one group per tier).
    Leaves the specs alone (one group) when there is one tier or a layer is not plain full
    attention (the grouping argument above holds for FullAttentionSpec only)."""
    if num_tiers <= 1:
        return specs
    odd = [name for name, spec in specs.items() if type(spec) is not FullAttentionSpec]
    if odd:
        logger.warning("vllm-kvevict: layer %s is not plain full attention (%s); token eviction "
                       "keeps one KV-cache group, every layer holding the largest budget",
                       odd[0], type(specs[odd[0]]).__name__)
        return specs
    out = {}
    for name, spec in specs.items():
        values = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.init}
        out[name] = TierAttentionSpec(
            **values, tier=tier_of_layer(layer_index[name], num_layers, num_tiers))
    logger.info("vllm-kvevict: %d layers in %d eviction tiers (one KV-cache group each)",
                num_layers, num_tiers)
    return out


def layer_groups(kv_cache_config, num_layers: int) -> LayerGroups:
    """Which KV-cache group holds each layer, as vLLM formed the groups (same function in the
    scheduler and the worker, from the same KVCacheConfig). One group when unknown."""
    from vllm.model_executor.models.utils import extract_layer_index

    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    of_layer = [0] * num_layers
    seen = [False] * num_layers
    for g, group in enumerate(groups):
        for name in group.layer_names:
            layer = extract_layer_index(name)
            if 0 <= layer < num_layers:
                of_layer[layer], seen[layer] = g, True
    if len(groups) > 1 and not all(seen):
        raise RuntimeError(f"vllm-kvevict: layers {[l for l, s in enumerate(seen) if not s]} "
                           "are in no KV-cache group")
    return LayerGroups(tuple(of_layer))
