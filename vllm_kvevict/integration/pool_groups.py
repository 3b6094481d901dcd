"""The plan of KV-cache groups of a head mask (streaming heads in vLLM's pool): the real layers' full-head specs and the streaming companions' `SinkWindowSpec`s packed
into groups of equal width (a block of any group costs the widest group's bytes in the
block-outer layout), returned in place of vLLM's own `get_kv_cache_groups` (wrapped in
`registration.py`)."""

from __future__ import annotations

import dataclasses
import logging

from vllm_kvevict.integration.sink_window import COMPANION_SUFFIX, register_manager

logger = logging.getLogger("vllm.kvevict")  # under vLLM's logger: its handler and format


def _pack(items: list[tuple[str, int]], width: int) -> list[list[str]]:
    """First-fit decreasing of (name, heads) into bins of `width` heads; bins keep layer order."""
    bins: list[tuple[int, list[tuple[int, str]]]] = []
    order = {name: i for i, (name, _) in enumerate(items)}
    for name, heads in sorted(items, key=lambda x: (-x[1], order[x[0]])):
        for i, (used, names) in enumerate(bins):
            if used + heads <= width:
                bins[i] = (used + heads, names + [(order[name], name)])
                break
        else:
            bins.append((heads, [(order[name], name)]))
    return [[n for _, n in sorted(names)] for _, names in bins]


def plan_widths(full: list[tuple[str, int]], streaming: list[tuple[str, int]],
                full_tokens: int, streaming_tokens: int,
                max_groups: int = 16) -> tuple[int, list[list[str]], list[list[str]]]:
    """Choose the block width (in head pages) and pack layers into groups of at most that
    width. A block of any group costs the widest group's bytes, so a narrow group wastes the
    difference on every block it holds: full groups hold a whole sequence (`full_tokens`),
    streaming groups about sink + window + a chunk (`streaming_tokens`). Returns the width
    and the full and streaming groups (lists of layer names) of the cheapest plan."""
    widest = max([h for _, h in full + streaming], default=1)
    total = sum(h for _, h in full) + sum(h for _, h in streaming)
    best = None
    for width in range(widest, max(total, widest) + 1):
        full_groups, stream_groups = _pack(full, width), _pack(streaming, width)
        if len(full_groups) + len(stream_groups) > max_groups:
            continue
        cost = width * (len(full_groups) * full_tokens + len(stream_groups) * streaming_tokens)
        if best is None or cost < best[0]:
            best = (cost, width, full_groups, stream_groups)
    if best is None:
        raise ValueError(f"vllm-kvevict: no plan of at most {max_groups} KV-cache groups")
    return best[1], best[2], best[3]


def kv_cache_groups(vllm_config, specs: dict) -> list:
    """vLLM's KV-cache groups for a head mask whose streaming heads are in the pool: the real
    layers' full-head specs and the companions' streaming specs, packed by `plan_widths`."""
    from vllm.v1.core.kv_cache_utils import KVCacheGroupSpec
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    spec0 = next(iter(specs.values()))
    per_head = spec0.page_size_bytes // max(spec0.num_kv_heads, 1)
    heads = {name: spec.page_size_bytes // per_head for name, spec in specs.items()}
    full = [(n, heads[n]) for n in specs if not n.endswith(COMPANION_SUFFIX)]
    streaming = [(n, heads[n]) for n in specs if n.endswith(COMPANION_SUFFIX)]
    stream_spec = specs[streaming[0][0]] if streaming else None
    budget = vllm_config.scheduler_config.max_num_batched_tokens
    streaming_tokens = (stream_spec.max_admission_blocks_per_request(
        budget, vllm_config.model_config.max_model_len) * stream_spec.block_size
        if stream_spec else 0)
    width, full_groups, stream_groups = plan_widths(
        full, streaming, vllm_config.model_config.max_model_len, streaming_tokens)
    groups = []
    for names in full_groups:
        groups.append(KVCacheGroupSpec(names, UniformTypeKVCacheSpecs.from_specs(
            {n: specs[n] for n in names})))
    for g, names in enumerate(stream_groups):
        tagged = {n: dataclasses.replace(specs[n], group=g) for n in names}
        groups.append(KVCacheGroupSpec(names, UniformTypeKVCacheSpecs.from_specs(tagged)))
    logger.info("vllm-kvevict: KV-cache groups in the pool: %d of full heads, %d of streaming "
                "heads, blocks of %d head pages (heads per group: full %s, streaming %s)",
                len(full_groups), len(stream_groups), width,
                [sum(heads[n] for n in g) for g in full_groups],
                [sum(heads[n] for n in g) for g in stream_groups])
    return groups


def group_kv_cache(stock_groups, vllm_config, kv_cache_spec):
    """`kv_cache_utils.get_kv_cache_groups`: our plan when the specs hold streaming companions
    (vLLM's own packing would bucket by balanced page-size patterns and may split a bucket
    across groups), vLLM's otherwise."""
    if not any(name.endswith(COMPANION_SUFFIX) for name in kv_cache_spec):
        return stock_groups(vllm_config, kv_cache_spec)
    register_manager()
    return kv_cache_groups(vllm_config, kv_cache_spec)
