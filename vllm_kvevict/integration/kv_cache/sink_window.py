"""Streaming heads in vLLM's own block pool: a sink + sliding-window KV-cache spec, its
manager, and the plan of KV-cache groups (every head-mask policy: streaming, duo, prulong).

A streaming head sees the sink (positions [0, s)), the W tokens before its chunk and the chunk.
vLLM 0.32's sliding window frees a prefix of blocks and its sink spec is a model's learned K/V:
nothing keeps the prompt's first tokens *and* frees the gap after them. `SinkWindowManager` is
`SlidingWindowManager` with the freed range moved: the sink blocks stay, blocks wholly inside
[sink, a - W) are freed as the request advances (`remove_skipped_blocks`). Which positions are
stored depends on prefix caching (`canonical_chunk`: the prompt chunked at multiples of E) and
its retention interval R (`prefix_retention`). Design: docs/design/kv_cache.md, "Streaming
heads in vLLM's pool" (storage, group packing, the two regimes, prefix caching).
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.utils.math_utils import cdiv
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager, SlidingWindowManager
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

from vllm_kvevict.overrides import request_prompt_len
from vllm_kvevict.served import served_policy

COMPANION_SUFFIX = ".kvevict_streaming"


def canonical_chunk(vllm_config) -> int:
    """The canonical prefill chunk E of a head mask (`KVPolicyConfig.canonical_chunk`): one
    value for the scheduler, the specs, the worker and the stats. An E below the budget lets
    a chunk run in one step beside decodes, which is what lets a chunk's end drop positions."""
    cache = getattr(vllm_config, "cache_config", None)  # (unit tests: partial stand-ins)
    budget = getattr(getattr(vllm_config, "scheduler_config", None), "max_num_batched_tokens", 0)
    return served_policy(vllm_config).config.canonical_chunk(
        bool(getattr(cache, "enable_prefix_caching", False)), budget)


def companion_name(layer_name: str) -> str:
    """The cache-only layer that holds attention layer `layer_name`'s streaming heads."""
    return layer_name + COMPANION_SUFFIX


def is_companion(name: str) -> bool:
    return name.endswith(COMPANION_SUFFIX)


def prefix_retention(vllm_config) -> int | None:
    """vLLM's `prefix_cache_retention_interval` as our streaming groups apply it (None:
    dense, every position stored; 0 or R: see the module's docstring; 0 without prefix
    caching, where nothing is cached)."""
    if not vllm_config.cache_config.enable_prefix_caching:
        return 0
    return vllm_config.cache_config.prefix_cache_retention_interval


@dataclass(frozen=True, kw_only=True)
class SinkWindowSpec(SlidingWindowSpec):
    """vLLM's sliding-window spec (`sliding_window` = W + 1: a query sees itself and the W
    tokens before it) plus the sink tokens kept from the start, and the group this layer was
    planned into (specs of different groups never merge)."""

    sink: int = 0
    chunk: int = 0  # canonical prefill chunk E (0: each step is its own chunk)
    retention: int | None = 0  # with a chunk: vLLM's prefix-cache retention interval
    group: int = 0
    keep_step: bool = False  # store a whole step (flex: a chunk's keys are read from the pool)

    def max_admission_blocks_per_request(self, max_in_flight_tokens: int,
                                         max_model_len: int) -> int:
        # the sink blocks, then the window before the step's chunk and the chunk up to the
        # step's end (canonical chunks: a prompt step never crosses a multiple of E,
        # admission.step_cap); without canonical chunks the step's positions before its last
        # W are not stored: the window before the step and the window after it
        bs, W = self.block_size, self.sliding_window - 1
        span = self.chunk if self.chunk else max_in_flight_tokens
        held = cdiv(min(W + span, max_model_len), bs) + 1
        if not self.chunk and not self.keep_step:
            held = min(held, 2 * (cdiv(W, bs) + 1))
        return cdiv(self.sink, bs) + held

    num_retained_tokens = property(lambda self: 0)  # 0.33's V2 runner: keep the sink readable

    def decode_blocks(self, num_spec_tokens: int = 0) -> int:
        """The most blocks a request holds once past its prompt: the sink and a decode step's
        [q - W, q + K] (K draft tokens), whatever the regime. The admission cap above is a
        prompt step's, which a decoding request never needs again."""
        bs, W = self.block_size, self.sliding_window - 1
        return cdiv(self.sink, bs) + cdiv(W + 1 + num_spec_tokens, bs) + 1

    def is_uniform_with_collection(self, kv_cache_specs) -> bool:
        return all(isinstance(spec, SinkWindowSpec) and spec.group == self.group
                   and spec.sink == self.sink and spec.sliding_window == self.sliding_window
                   and spec.chunk == self.chunk and spec.retention == self.retention
                   and spec.keep_step == self.keep_step
                   for spec in kv_cache_specs.values())

    @classmethod
    def merge(cls, specs):
        groups = {getattr(spec, "group", None) for spec in specs}
        # AssertionError is what vLLM's grouping code catches as "not mergeable"
        assert all(isinstance(spec, SinkWindowSpec) for spec in specs) and len(groups) == 1, (
            "streaming caches of different planned groups do not merge")
        return super().merge(specs)


class SinkWindowManager(SlidingWindowManager):
    """Keeps the sink blocks and the blocks that hold [a - W, ...); frees the gap between.
    A step's new blocks that hold only positions no later step or hit reads (`_dropped`) are
    vLLM's null block (never allocated)."""

    def __init__(self, kv_cache_spec: SinkWindowSpec, **kwargs) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        self.sink, self.chunk = kv_cache_spec.sink, kv_cache_spec.chunk
        self.retention = kv_cache_spec.retention
        self.keep_step = kv_cache_spec.keep_step
        self.window = kv_cache_spec.sliding_window - 1
        self._freed_to: dict[str, int] = {}  # per request: blocks below are null or sink
        self._prompt_len: dict[str, int] = {}  # vLLM's, from remove_skipped_blocks

    def _dropped(self, request_id: str, first: int, end: int, num_tokens: int) -> list[bool]:
        """For new block positions [first, end) of a step ending at `num_tokens`: which hold
        nothing a later step or prefix hit reads (past the sink, wholly before the step's last
        W tokens; with canonical chunks only at a chunk's end before the prompt's last chunk,
        and not below a retention checkpoint inside the chunk)."""
        bs = self.block_size
        if self.keep_step:
            return [False] * (end - first)
        lo, keep_from = cdiv(self.sink, bs), max(num_tokens - self.window, 0) // bs
        if self.chunk:
            prompt = self._prompt_len.get(request_id)
            if (self.retention is None or prompt is None or num_tokens % self.chunk
                    or num_tokens >= prompt):
                return [False] * (end - first)
            if self.retention:  # a hit at m (a multiple of R inside the chunk) reads [kE, m)
                m = (num_tokens - 1) // self.retention * self.retention
                lo = max(lo, m // bs)
        return [lo <= j < keep_from for j in range(first, end)]

    def get_num_blocks_to_allocate(self, request_id, num_tokens, new_computed_blocks,
                                   total_computed_tokens, num_local_computed_tokens,
                                   num_tokens_main_model, apply_admission_cap=False,
                                   prefill_end=0) -> int:
        n = super().get_num_blocks_to_allocate(
            request_id, num_tokens, new_computed_blocks, total_computed_tokens,
            num_local_computed_tokens, num_tokens_main_model, apply_admission_cap, prefill_end)
        # (the admission cap already counts what is held; a partial hit copies a block)
        if apply_admission_cap or request_id in self._partial_hit_reqs:
            return n
        first = len(self.req_to_blocks.get(request_id, ())) + len(new_computed_blocks)
        end = cdiv(num_tokens, self.block_size)
        return max(n - sum(self._dropped(request_id, first, end, num_tokens_main_model)), 0)

    def allocate_new_blocks(self, request_id: str, num_tokens: int,
                            num_tokens_main_model: int) -> list:
        if request_id in self._partial_hit_reqs:
            return super().allocate_new_blocks(request_id, num_tokens, num_tokens_main_model)
        blocks = self.req_to_blocks[request_id]
        dropped = self._dropped(request_id, len(blocks), cdiv(num_tokens, self.block_size),
                                num_tokens_main_model)
        new = self.block_pool.get_new_blocks(dropped.count(False))
        if self.records_new_block_ids:
            self.new_block_ids.extend(b.block_id for b in new)
        it = iter(new)
        null = self.block_pool.null_block
        added = [null if drop else next(it) for drop in dropped]
        blocks.extend(added)
        return added  # nulls included: the worker's block table is appended position by position

    def _remove_blocks_in_range(self, request_id: str, first_block: int,
                                last_block: int) -> None:
        # vLLM's helper walks back from `last_block` and stops at the first null, the end of
        # the previous call's gap; null blocks inside the window (dropped positions, a prefix
        # hit's gap) would stop it early, so walk forward from where the last call ended
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None:
            return
        start = max(first_block, self._freed_to.get(request_id, 0))
        last_block = min(last_block, len(blocks))
        if start >= last_block:
            return
        freed = [b for b in blocks[start:last_block] if not b.is_null]
        blocks[start:last_block] = [self.block_pool.null_block] * (last_block - start)
        self._freed_to[request_id] = last_block
        if freed:
            # vLLM frees in reverse so a request's tail blocks are evicted first
            self.block_pool.free_blocks(reversed(freed))

    def pop_blocks_for_free(self, request_id: str) -> list:
        # (`free` goes through here too; a preempted request comes back under the same id)
        self._freed_to.pop(request_id, None)
        self._prompt_len.pop(request_id, None)
        return super().pop_blocks_for_free(request_id)

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        if num_prompt_tokens is not None:  # (vLLM calls this before every allocation)
            self._prompt_len[request_id] = num_prompt_tokens
        self._remove_blocks_in_range(request_id,
                                     *self.freed_range(processed_computed_tokens,
                                                       num_prompt_tokens))

    def freed_range(self, processed_computed_tokens: int,
                    num_prompt_tokens: int | None) -> tuple[int, int]:
        """The block positions [first, last) `remove_skipped_blocks` frees: past the sink,
        wholly before the window of the tokens computed (a prompt step in canonical chunk k
        still sees [kE - W, ...); vLLM's prompt length may include a teacher-forced tail,
        decode for the policy: keeping more is safe)."""
        a = processed_computed_tokens
        if self.chunk and (num_prompt_tokens is None or a < num_prompt_tokens):
            a = a // self.chunk * self.chunk
        return cdiv(self.sink, self.block_size), max(a - self.window, 0) // self.block_size

    def freed_to(self, request_id: str) -> int:
        """The block position below which the request's blocks past the sink are null."""
        return self._freed_to.get(request_id, 0)

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        # the freed range is a gap, not a prefix: allocation counts every block position
        # (nulls included), as it does for a request whose blocks were never freed
        return 0

    # -- prefix caching ----------------------------------------------------------------------
    @classmethod
    def find_longest_cache_hit(cls, block_hashes, max_length, kv_cache_group_ids, block_pool,
                               kv_cache_spec, drop_eagle_block, alignment_tokens,
                               dcp_world_size=1, pcp_world_size=1):
        """The longest block-aligned h <= max_length this group can resume at: the blocks of
        the sink and of [kE - W, h) cached (k: h's canonical chunk), the gap left null. (A
        cached block's K/V depend only on the tokens before it; which h have their blocks
        cached follows the retention, see the module's docstring.)"""
        bs, sink = kv_cache_spec.block_size, kv_cache_spec.sink
        chunk, window = kv_cache_spec.chunk, kv_cache_spec.sliding_window - 1
        null, found = block_pool.null_block, {}

        def cached(i):
            if i not in found:
                found[i] = block_pool.get_cached_block(block_hashes[i], kv_cache_group_ids)
            return found[i]

        for i in range(min(max_length // bs, len(block_hashes)), 0, -1):
            h = i * bs
            if alignment_tokens and h % alignment_tokens:
                continue
            anchor = h // chunk * chunk if chunk else h
            needed = sorted(set(range(min(cdiv(sink, bs), i)))
                            | set(range(max(anchor - window, 0) // bs, i)))
            if all(cached(j) for j in needed):
                rows = tuple([null] * i for _ in kv_cache_group_ids)
                for j in needed:
                    for row, block in zip(rows, cached(j)):
                        row[j] = block
                return rows, h
        return tuple([] for _ in kv_cache_group_ids), 0

    @classmethod
    def reachable_block_mask(cls, *args, **kwargs):
        return None  # cache every full block (a hit needs the sink and its own window)

    def cache_blocks(self, request, num_tokens, *args, **kwargs) -> None:
        super().cache_blocks(request, cached_tokens(request, num_tokens), *args, **kwargs)


def cached_tokens(request, num_tokens: int) -> int:
    """Tokens of a request whose blocks may be cached: its prompt as the policy serves it.
    Generated (and teacher-forced) tokens ran as decode queries, whose streaming heads see
    [q - W, q] rather than their chunk: a later prompt holding them would compute other K/V
    under the same block hash."""
    return min(num_tokens, request_prompt_len(request))


@dataclass(frozen=True, kw_only=True)
class PromptFullSpec(FullAttentionSpec):
    """vLLM's full-attention spec for the full heads of a layer whose streaming heads are in
    the pool: the same, but only prompt blocks are cached (`cached_tokens`)."""


class PromptFullManager(FullAttentionManager):
    def cache_blocks(self, request, num_tokens, *args, **kwargs) -> None:
        super().cache_blocks(request, cached_tokens(request, num_tokens), *args, **kwargs)


def register_specs(*rows) -> None:
    """(spec, manager, base spec) rows into vLLM's KV-cache spec registry, after vLLM's own:
    it registers its built-ins only while the registry is empty (idempotent)."""
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    KVCacheSpecRegistry._ensure_registered()
    for spec, manager, base in rows:
        KVCacheSpecRegistry.register(spec, manager, uniform_type_base_spec=base)


def register_manager() -> None:
    """Our spec -> our manager in vLLM's KV-cache spec registry (every process that builds
    managers or groups; idempotent)."""
    register_specs((SinkWindowSpec, SinkWindowManager, SinkWindowSpec),
                   (PromptFullSpec, PromptFullManager, FullAttentionSpec))
