"""Scheduler side of chunked token eviction (snapkv, pyramidkv), in the engine core: vLLM's
logical token counts -> physical slots per KV-cache group for block allocation, the tail blocks
of each compressed chunk freed before the next schedule, admission by compressed peak sizes.
The shared maths is `vllm_kvevict/ledger.py`; the hooks that call this are in `kv_cache_manager.py`.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable

from vllm_kvevict.integration.core.admission import GrowthReserve
from vllm_kvevict.integration.kv_cache.prefix_cache import (boundary_anchor, boundary_cached,
                                                            register_boundary)
from vllm_kvevict.ledger import (LayerGroups, cached_decode_group_budgets,
                                 cap_step_in_eviction_chunk, decode_group_evictions,
                                 eviction_chunk_len, group_evictions, peak_slots)
from vllm_kvevict.overrides import request_prompt_len
from vllm_kvevict.policies import KVPolicy

BOUNDARY_QUESTIONS = 1 << 16  # cached boundaries whose questions are remembered


class TokenEvictionLedger(GrowthReserve):
    """Engine-core side of the ledger: translates vLLM's logical token counts to physical ones
    per KV-cache group for block allocation, frees each group's tail blocks after each
    compressed chunk, caps admission (`GrowthReserve` with compressed peak sizes)."""

    compresses = True

    def __init__(self, policy: KVPolicy, chunk_size: int, groups: LayerGroups | None = None,
                 reserve_growth: bool = True,
                 for_request: Callable[[Any], KVPolicy] | None = None):
        super().__init__(reserve_growth)
        self.policy = policy
        self.asks_questions = policy.config.patched  # (a non-final chunk runs the question)
        # extra_args -> the request's policy (ServedPolicy.for_request; overrides applied)
        self.policy_for = for_request or (lambda extra_args: policy)
        self.chunk_size = chunk_size
        self.groups = groups or LayerGroups.single(policy.num_layers)
        self.allocation_evicted: dict[str, list[int]] = {}
        # req_id -> (eviction chunk length, is_final, policy, the chunk's end); chunk length 0:
        # a decode-time compression
        self.pending: dict[str, tuple[int, bool, KVPolicy, int]] = {}
        self._evictions: dict[tuple, list[int]] = {}
        # patched eviction reusing across questions (prefix_cache.py): per request, the
        # question each of its prompt chunks so far was selected under; per cached boundary
        # (its vLLM block hash), its row's; per request, its hit's (reused, other question)
        self.chunk_questions: dict[str, list[int]] = {}
        self.boundary_questions: OrderedDict[bytes, tuple[int, ...]] = OrderedDict()
        self.reused: dict[str, tuple[int, int]] = {}

    def evictions(self, policy: KVPolicy, chunk_len: int, is_final: bool) -> list[int]:
        """group_evictions, memoised per setting (a frozen, hashable config)."""
        key = (policy.config, chunk_len, is_final)
        out = self._evictions.get(key)
        if out is None:
            if len(self._evictions) > 4096:
                self._evictions.clear()
            out = self._evictions[key] = group_evictions(policy, chunk_len, is_final,
                                                         self.groups)
        return out

    def physical(self, req_id: str, num_tokens: int, group: int = 0) -> int:
        evicted = self.allocation_evicted.get(req_id)
        return num_tokens - (evicted[group] if evicted else 0)

    def slots_needed(self, req_id: str, num_tokens: int, step_end: int, group: int) -> int:
        """A group's physical slots for an allocation of `num_tokens` logical ones (vLLM's
        count: the step's tokens up to `step_end`, plus speculative lookahead). Patched
        eviction: a non-final prefill chunk also writes its question's KVs right after the
        chunk (what speculative decoding's lookahead slots are for, so counted the same way)."""
        # (eviction is a server setting: no request of an unpatched policy has questions)
        request = (None if self.scheduler is None or not self.asks_questions
                   else self.scheduler.requests.get(req_id))
        if request is not None:
            policy = self.request_policy(request)
            n = request_prompt_len(request)
            rows = policy.config.question_rows(n)  # (0 unless patched)
            if rows and step_end < n and policy.config.is_eviction_point(step_end, n):
                num_tokens = min(num_tokens + rows, self.scheduler.max_model_len)
        return self.physical(req_id, num_tokens, group)

    def peak_tokens(self, request, num_tokens: int) -> list[int]:
        """Per group, the peak slots a request of `num_tokens` tokens needs (`peak_slots`); a
        streaming-heads group of pool storage (a head mask with a token policy) holds at most
        its window cap, plus the patched question's slots reserved after a chunk."""
        policy = self.request_policy(request)
        peaks = peak_slots(policy, request_prompt_len(request), num_tokens, self.chunk_size,
                           lambda chunk_len, final: self.evictions(policy, chunk_len, final),
                           cached_decode_group_budgets(policy, self.groups))
        if self.scheduler is None:
            return peaks
        question = policy.config.question_rows(num_tokens)
        managers = self.scheduler.kv_cache_manager.coordinator.single_type_managers
        return [p if cap is None else
                min(p, cap[0] + -(-question // m.block_size) * m.block_size)
                for p, cap, m in zip(peaks, self.window_caps(), managers)]

    def before_schedule(self) -> None:
        """Apply the evictions of the chunks scheduled last step (their forward precedes any
        forward of this step, so the freed blocks are safe to hand out now)."""
        if self.scheduler is None:
            return
        managers = self.scheduler.kv_cache_manager.coordinator.single_type_managers
        for req_id, (chunk_len, is_final, policy, end) in list(self.pending.items()):
            del self.pending[req_id]
            request = self.scheduler.requests.get(req_id)
            held = [m.req_to_blocks.get(req_id) for m in managers]
            if request is None or not any(held):
                self.allocation_evicted.pop(req_id, None)
                continue
            evicted = self.allocation_evicted.setdefault(req_id, [0] * len(managers))
            if chunk_len:
                freed = self.evictions(policy, chunk_len, is_final)
            else:  # decode-time compression, after the step that ended at num_computed
                freed = decode_group_evictions(
                    cached_decode_group_budgets(policy, self.groups),
                    [self.physical(req_id, request.num_computed_tokens, g)
                     for g in range(len(managers))])
            for g, (manager, blocks) in enumerate(zip(managers, held)):
                evicted[g] += freed[g]
                keep = -(-self.physical(req_id, request.num_computed_tokens, g)
                         // manager.block_size)
                if blocks and len(blocks) > keep:
                    # (a streaming group's row holds null blocks where it freed or dropped)
                    tail = [b for b in blocks[keep:] if not b.is_null]
                    del blocks[keep:]
                    manager.block_pool.free_blocks(reversed(tail))
            if chunk_len and not is_final and policy is self.policy:
                # a chunk boundary before the prompt's last chunk: its row is a reusable state
                # (prefix_cache.py; a request with overrides keeps other counts)
                questions = self.chunk_questions.get(req_id)
                if questions is not None:
                    questions.append(self.question_of(request))
                reusing = [m for m in managers if getattr(m, "_reuses", False)]
                registered = False
                # patched: the first row keyed at a boundary stays its only one (another
                # request's, selected under another question, must not mix into its blocks)
                if questions is None or not any(boundary_cached(m, request, end)
                                                for m in reusing):
                    for manager in reusing:
                        registered |= bool(register_boundary(manager, request, end))
                if registered and questions is not None:
                    anchor = boundary_anchor(request, end, managers[0].block_pool.hash_block_size)
                    self.boundary_questions[anchor] = tuple(questions)
                    self.boundary_questions.move_to_end(anchor)
                    while len(self.boundary_questions) > BOUNDARY_QUESTIONS:
                        self.boundary_questions.popitem(last=False)

    def after_schedule(self, scheduler_output) -> None:
        for req_id in getattr(scheduler_output, "preempted_req_ids", None) or ():
            self.forget(req_id)
        for req_id in scheduler_output.finished_req_ids:
            self.forget(req_id)
        self.forget_finished(scheduler_output)
        for req_id, c in scheduler_output.num_scheduled_tokens.items():
            request = self.scheduler.requests.get(req_id)
            if request is None:
                continue
            before, n = request.num_computed_tokens - c, request_prompt_len(request)
            if before == 0:
                self.allocation_evicted.pop(req_id, None)
            policy = self.request_policy(request)
            if policy.config.is_eviction_point(before + c, n):
                self.pending[req_id] = (eviction_chunk_len(policy.config, before, c),
                                        before + c == n, policy, before + c)
            elif policy.config.is_decode_compression(before + c, n):
                self.pending[req_id] = (0, True, policy, before + c)

    def step_cap(self, request, num_computed: int, num_new: int) -> int:
        """`replay_cap`, then keep the step inside its eviction chunk
        (`cap_step_in_eviction_chunk`; the policy's prompt ends a chunk)."""
        num_new = self.replay_cap(request, num_computed, num_new)
        return cap_step_in_eviction_chunk(self.request_policy(request), request_prompt_len(request),
                                          num_computed, num_new)

    def on_prefix_hit(self, req_id: str, boundary: int) -> None:
        """A request's first allocation, with a prefix hit at chunk boundary `boundary` (0:
        none): its rows start with the chunks before it evicted (prefix_cache.py)."""
        if self.policy.config.reuses_across_questions:
            self.note_reuse(req_id, boundary)
        if not boundary:
            self.allocation_evicted.pop(req_id, None)
            return
        # (the memoised per-chunk evictions: this runs at every first-allocation attempt)
        chunk = self.policy.config.eviction_chunk
        self.allocation_evicted[req_id] = [boundary // chunk * f for f in
                                           self.evictions(self.policy, chunk, False)]

    def question_of(self, request) -> int:
        """The request's patched question (its prompt's last k tokens), as a digest."""
        n = request_prompt_len(request)
        return hash(tuple(request.prompt_token_ids[n - self.policy.config.question_rows(n): n]))

    def note_reuse(self, req_id: str, boundary: int) -> None:
        """--kv-prefix-reuse across-questions: the reused chunks' questions (from the cached
        boundary's row) start the request's own list; how many differ from its question."""
        request = self.scheduler.requests.get(req_id) if self.scheduler else None
        if request is None:
            return
        cached: tuple[int, ...] = ()
        if boundary:
            pool = self.scheduler.kv_cache_manager.coordinator.single_type_managers[0].block_pool
            # (a boundary whose questions were dropped from the bounded table: unknown, -1)
            cached = self.boundary_questions.get(
                boundary_anchor(request, boundary, pool.hash_block_size),
                (-1,) * (boundary // self.policy.config.eviction_chunk))
        own = self.question_of(request)
        self.chunk_questions[req_id] = list(cached)
        self.reused[req_id] = (len(cached), sum(q != own for q in cached))

    def reuse_of(self, req_id: str) -> tuple[int, int] | None:
        """(chunks reused from the prefix cache, of which selected under another question)."""
        return self.reused.get(req_id)

    def forget(self, req_id: str) -> None:
        self.allocation_evicted.pop(req_id, None)
        self.pending.pop(req_id, None)
        self.chunk_questions.pop(req_id, None)
        self.reused.pop(req_id, None)

    def skips_prefix_cache(self, request) -> bool:
        """Also a request with policy overrides: it keeps other counts than the cached rows
        (prefix_cache.py)."""
        return (super().skips_prefix_cache(request)
                or self.request_policy(request) is not self.policy)

    def request_policy(self, request) -> KVPolicy:
        params = getattr(request, "sampling_params", None)
        return self.policy_for(getattr(params, "extra_args", None))
