"""The plan of KV-cache groups of a head mask (streaming heads in vLLM's pool): the real layers' full-head specs and the streaming companions' `SinkWindowSpec`s packed
into groups of equal width (a block of any group costs the widest group's bytes in the
block-outer layout), returned in place of vLLM's own `get_kv_cache_groups` (wrapped in
`registration.py`)."""

from __future__ import annotations

import dataclasses
import logging
import math

from vllm_kvevict.integration.kv_cache.head_pages import is_head_slot, slot_layer
from vllm_kvevict.integration.kv_cache.sink_window import (SinkWindowSpec, is_companion,
                                                           register_manager)

logger = logging.getLogger("vllm.kvevict")  # under vLLM's logger: its handler and format


def _first_fit(items: list[tuple[str, int]], width: int) -> list[list[str]]:
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


class _TooLarge(Exception):
    pass


def _fewest_bins(counts: tuple[int, ...], sizes: tuple[int, ...], width: int,
                 limit: int) -> list[tuple[int, ...]]:
    """The fewest bins of `width` holding counts[k] items of sizes[k] (sizes descending), as
    per-bin count vectors. Exact search over the remaining counts: the next bin holds the
    largest item left and is maximal (no item left fits beside it), which loses no optimum;
    raises _TooLarge past `limit` states. Few distinct sizes (heads per layer) keep it small."""
    memo: dict[tuple[int, ...], tuple[int, tuple[int, ...]]] = {}

    def fills(left: list[int], j: int, room: int):
        if j == len(sizes):
            yield ()
            return
        for take in range(min(left[j], room // sizes[j]), -1, -1):
            for rest in fills(left, j + 1, room - take * sizes[j]):
                yield (take,) + rest

    def solve(state: tuple[int, ...]) -> int:
        if not any(state):
            return 0
        if state not in memo:
            if len(memo) >= limit:
                raise _TooLarge
            bound = -(-sum(c * s for c, s in zip(state, sizes)) // width)
            i = next(k for k, c in enumerate(state) if c)
            left = list(state)
            left[i] -= 1
            best = None
            for fill in fills(left, 0, width - sizes[i]):
                rest = tuple(c - f for c, f in zip(left, fill))
                room = width - sizes[i] - sum(f * s for f, s in zip(fill, sizes))
                if any(c and s <= room for c, s in zip(rest, sizes)):
                    continue  # not maximal
                n = 1 + solve(rest)
                if best is None or n < best[0]:
                    best = (n, tuple(f + (k == i) for k, f in enumerate(fill)))
                    if n == bound:
                        break
            memo[state] = best
        return memo[state][0]

    solve(counts)
    bins, state = [], counts
    while any(state):
        bins.append(memo[state][1])
        state = tuple(c - b for c, b in zip(state, bins[-1]))
    return bins


def _pack(items: list[tuple[str, int]], width: int, limit: int = 1_000) -> list[list[str]]:
    """(name, heads) into the fewest bins of `width` heads: first-fit decreasing, or the exact
    search where first fit misses the lower bound and the search stays under `limit` states
    (the bundled prulong mask at 0.1 has layers of 3 and 2 full heads: first fit packs them
    into 10 bins of 9 where 9 suffice)."""
    bins = _first_fit(items, width)
    if len(bins) == -(-sum(h for _, h in items) // width):
        return bins
    sizes = tuple(sorted({h for _, h in items}, reverse=True))
    try:
        exact = _fewest_bins(tuple(sum(1 for _, h in items if h == s) for s in sizes),
                             sizes, width, limit)
    except _TooLarge:
        return bins
    if len(exact) >= len(bins):
        return bins
    queues = {s: [n for n, h in items if h == s] for s in sizes}  # layer order within a size
    order = {name: i for i, (name, _) in enumerate(items)}
    out = [[queues[s].pop(0) for s, c in zip(sizes, b) for _ in range(c)] for b in exact]
    return [sorted(names, key=order.__getitem__) for names in out]


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


def planned_groups(vllm_config, specs: dict, full: list, streaming: list, members) -> tuple:
    """`plan_widths` over the (item, heads) of `full` and `streaming`, as vLLM's KV-cache
    groups: each item's cache layers (`members(item)`, in order) side by side, streaming
    groups' specs tagged with their group. Returns (width, full groups, streaming groups of
    items, the KVCacheGroupSpecs)."""
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec, UniformTypeKVCacheSpecs

    stream_spec = next((s for s in specs.values() if isinstance(s, SinkWindowSpec)), None)
    full_spec = next((s for s in specs.values() if not isinstance(s, SinkWindowSpec)), None)
    budget = vllm_config.scheduler_config.max_num_batched_tokens
    max_len = vllm_config.model_config.max_model_len
    streaming_tokens = (stream_spec.max_admission_blocks_per_request(budget, max_len)
                        * stream_spec.block_size if stream_spec else 0)
    # full heads in blocks k times the streaming heads' (`--kv-full-block-size`): a full
    # item counts k head pages (`kv_cache_groups`) and a sequence 1/k as many blocks
    k = full_spec.block_size // stream_spec.block_size if full_spec and stream_spec else 1
    width, full_groups, stream_groups = plan_widths(full, streaming, -(-max_len // k),
                                                    streaming_tokens)
    groups = []
    for g, items in enumerate(full_groups + stream_groups):
        names = [n for item in items for n in members(item)]
        g -= len(full_groups)  # (streaming groups: their tag)
        group_specs = {n: specs[n] if g < 0 else dataclasses.replace(specs[n], group=g)
                       for n in names}
        groups.append(KVCacheGroupSpec(names, UniformTypeKVCacheSpecs.from_specs(group_specs)))
    return width, full_groups, stream_groups, groups


def kv_cache_groups(vllm_config, specs: dict) -> list:
    """vLLM's KV-cache groups for a head mask whose streaming heads are in the pool: the real
    layers' full-head specs and the companions' streaming specs, packed by `plan_widths`."""
    # (a head page: one KV head over the smallest block; full heads in k-times larger blocks,
    # `--kv-full-block-size`, are k head pages each)
    per_head = math.gcd(*(spec.page_size_bytes // max(spec.num_kv_heads, 1)
                          for spec in specs.values()))
    heads = {name: spec.page_size_bytes // per_head for name, spec in specs.items()}
    full = [(n, heads[n]) for n in specs if not is_companion(n)]
    streaming = [(n, heads[n]) for n in specs if is_companion(n)]
    width, full_groups, stream_groups, groups = planned_groups(
        vllm_config, specs, full, streaming, lambda name: [name])
    logger.info("vllm-kvevict: KV-cache groups in the pool: %d of full heads, %d of streaming "
                "heads, blocks of %d head pages (head pages per group: full %s, streaming %s)",
                len(full_groups), len(stream_groups), width,
                [sum(heads[n] for n in g) for g in full_groups],
                [sum(heads[n] for n in g) for g in stream_groups])
    return groups


def head_page_groups(vllm_config, specs: dict) -> list:
    """The FlexAttention path's groups (`head_slots`: a cache layer per KV head, one page
    size): `planned_groups` with each layer's full slots and its streaming slots as
    items of their head counts, kept side by side in one group and in slot order, so that
    vLLM's layer-outer layout puts them one layer stride apart."""
    slots: dict[tuple[str, bool], list[str]] = {}  # (layer, streaming) -> its slots
    for name, spec in specs.items():
        slots.setdefault((slot_layer(name), isinstance(spec, SinkWindowSpec)),
                         []).append(name)
    width, full_groups, stream_groups, groups = planned_groups(
        vllm_config, specs, [(k, len(v)) for k, v in slots.items() if not k[1]],
        [(k, len(v)) for k, v in slots.items() if k[1]], slots.__getitem__)
    logger.info("vllm-kvevict: KV-cache groups in the pool (a cache layer per KV head): %d of "
                "full heads, %d of streaming heads, blocks of %d head pages",
                len(full_groups), len(stream_groups), width)
    return groups


def group_kv_cache(stock_groups, vllm_config, kv_cache_spec):
    """`get_kv_cache_groups` (kv_cache_utils in vLLM 0.32, kv_cache_planning from 0.33): our plan when the specs hold streaming companions
    (vLLM's own packing would bucket by balanced page-size patterns and may split a bucket
    across groups) or the FlexAttention path's head slots, vLLM's otherwise."""
    if any(is_companion(name) for name in kv_cache_spec):
        register_manager()
        return kv_cache_groups(vllm_config, kv_cache_spec)
    if any(is_head_slot(name) or isinstance(spec, SinkWindowSpec)
           for name, spec in kv_cache_spec.items()):
        register_manager()
        return head_page_groups(vllm_config, kv_cache_spec)
    return stock_groups(vllm_config, kv_cache_spec)
