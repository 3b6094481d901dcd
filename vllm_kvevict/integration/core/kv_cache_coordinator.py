"""Scheduler side (engine-core process): a head mask's quiet steps answered once for all of
its KV-cache groups.

A head mask's plan has many KV-cache groups (prulong 0.7 on the bundled model: 15), and vLLM's
coordinator asks every group's manager, per running request and step, how many blocks it needs,
to allocate them and to cache them: 0.9 ms of scheduling per step at batch 8 against stock's
0.2. Most decode steps need nothing in any group. `quiet_class` checks that once per request
with the managers' own state (`QuietState`) and only then answers for all groups (no blocks, the
cache count already done, no range left to free); anything else takes vLLM's per-group path.
Installed on the scheduler's coordinator by `KVEvictScheduler` (vLLM builds it in a factory
with no hook). Design: docs/design/core.md, "Quiet steps".
"""

from __future__ import annotations

import functools

from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

from vllm_kvevict.integration.kv_cache.sink_window import (PromptFullManager,
                                                           SinkWindowManager)
from vllm_kvevict.overrides import request_prompt_len

# managers whose allocation is vLLM's length rule (a manager that holds enough blocks gets none)
LENGTH_RULE_MANAGERS = (FullAttentionManager, PromptFullManager, SinkWindowManager)
# managers that cache the policy's prompt only
PROMPT_CACHING_MANAGERS = (PromptFullManager, SinkWindowManager)


class QuietState:
    """What quiet steps know of a coordinator's managers and remember per request."""

    def __init__(self, managers) -> None:
        self.managers = managers
        self.no_new_blocks = tuple([] for _ in managers)
        self.caches_prompt_only = all(type(m) in PROMPT_CACHING_MANAGERS and not m.use_eagle
                                      for m in managers)
        self.cached_count: dict[str, int] = {}  # per request: its last cache_blocks' count
        self.quiet = None  # (request, tokens) the last count found quiet
        # the streaming groups' managers when they share one freed-range rule, else None
        streaming = tuple(m for m in managers if type(m) is SinkWindowManager)
        rules = {(m.sink, m.window, m.chunk, m.block_size) for m in streaming}
        self.streaming = streaming if len(rules) == 1 else None
        self.freed: dict[str, tuple] = {}  # per request: the call all groups freed all of

    def holds(self, request_id: str, num_tokens: int) -> bool:
        """Every group's row already holds `num_tokens` slots, no copy-on-write hit pending."""
        for manager in self.managers:
            blocks = manager.req_to_blocks.get(request_id)  # (.get: a defaultdict)
            if (blocks is None or len(blocks) * manager.block_size < num_tokens
                    or request_id in manager._partial_hit_reqs):
                return False
        return True

    def freeing_call(self, processed: int, prompt: int | None) -> tuple | None:
        """(first, last, prompt): the streaming groups' freed range for this call (full groups
        never free); None where their rules differ."""
        if self.streaming is None:
            return None
        return (*self.streaming[0].freed_range(processed, prompt), prompt)

    def note_freed(self, request_id: str, call: tuple | None) -> None:
        # (a group whose blocks did not reach `last` yet would free more on a later call)
        if call is not None and (call[1] <= call[0] or all(
                m.freed_to(request_id) >= call[1] for m in self.streaming)):
            self.freed[request_id] = call

    def forget(self, request_id: str) -> None:
        self.cached_count.pop(request_id, None)  # (a preempted request restarts)
        self.freed.pop(request_id, None)
        self.quiet = None


@functools.lru_cache(maxsize=None)
def quiet_class(base: type) -> type:
    """`base` (vLLM's coordinator class) with quiet steps answered once (`install`)."""

    class QuietSteps(base):
        def kvevict_quiet_steps(self, state: QuietState) -> None:
            self.kvevict = state

        def get_num_blocks_to_allocate(self, request_id, num_tokens, new_computed_blocks,
                                       *args, apply_admission_cap=False, **kwargs):
            # (allocate_slots asks this right before allocate_new_blocks with the same count:
            # that call reuses the answer)
            state = self.kvevict
            state.quiet = None
            if (not apply_admission_cap and not any(new_computed_blocks)
                    and state.holds(request_id, num_tokens)):
                state.quiet = (request_id, num_tokens)
                return 0
            return super().get_num_blocks_to_allocate(
                request_id, num_tokens, new_computed_blocks, *args,
                apply_admission_cap=apply_admission_cap, **kwargs)

        def allocate_new_blocks(self, request_id, num_tokens, *args, **kwargs):
            state = self.kvevict
            quiet, state.quiet = state.quiet, None
            if quiet == (request_id, num_tokens) or state.holds(request_id, num_tokens):
                return state.no_new_blocks
            return super().allocate_new_blocks(request_id, num_tokens, *args, **kwargs)

        def cache_blocks(self, request, num_computed_tokens: int) -> None:
            state = self.kvevict
            if not state.caches_prompt_only:  # (vLLM's full manager caches decode too)
                return super().cache_blocks(request, num_computed_tokens)
            # every group is asked to cache min(its cacheable count, the prompt): without EAGLE
            # the coordinator's count is the same for all groups, and the same count again is
            # a call vLLM's cache_blocks has already done
            count = min(self.get_num_cacheable_tokens(num_computed_tokens, 0),
                        request_prompt_len(request))
            if state.cached_count.get(request.request_id) == count:
                return
            super().cache_blocks(request, num_computed_tokens)
            state.cached_count[request.request_id] = count

        def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                                  num_prompt_tokens: int | None = None) -> None:
            # a call repeating the request's last one, after which every streaming group had
            # freed all of its range, frees nothing anywhere
            state = self.kvevict
            call = state.freeing_call(processed_computed_tokens, num_prompt_tokens)
            if call is not None and state.freed.get(request_id) == call:
                return
            super().remove_skipped_blocks(request_id, processed_computed_tokens,
                                          num_prompt_tokens)
            state.note_freed(request_id, call)

        def free(self, request_id: str) -> None:
            self.kvevict.forget(request_id)
            super().free(request_id)

    return QuietSteps


def install(coordinator, rule) -> bool:
    """Re-class vLLM's coordinator as `quiet_class` of its own class where its answers hold:
    a rule bound to the managers that counts logical slots (not `full`'s; token eviction's
    ledger compresses) and every group on a manager of the length rule. True when installed."""
    managers = coordinator.single_type_managers
    if (not rule.binds or rule.compresses
            or not all(type(m) in LENGTH_RULE_MANAGERS for m in managers)):
        return False
    coordinator.__class__ = quiet_class(type(coordinator))
    coordinator.kvevict_quiet_steps(QuietState(managers))
    return True
