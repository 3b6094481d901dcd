"""Admission that leaves room for what running requests will still grow by.

vLLM admits a request when its prompt fits and reserves nothing for running requests' decode
growth; when the pool runs dry it preempts one and recomputes it later with new chunk
boundaries, which for an evicting policy changes what token eviction keeps and what a streaming
head sees. So evicting policies admit a request only when its own largest need (all
`max_tokens` outputs) plus every running request's remaining growth fits: `GrowthReserve`
(head masks: logical lengths), subclassed by the token-eviction ledger (physical sizes per
KV-cache group). With `--kv-admission vllm` the reserve is off and a preempted request is
replayed exactly (`record_chunks`, `replay_cap`: first run's prompt chunks, then a token a step).
Design: docs/design/core.md, "Admission, preemption and exact recompute".
"""

from __future__ import annotations

from vllm_kvevict.integration.kv_cache.sink_window import SinkWindowManager
from vllm_kvevict.overrides import request_prompt_len


class StockAdmission:
    """`full`: vLLM's own admission, allocation and prefix cache. Every hook answers as vLLM
    would, and the rule binds to no KV-cache manager (`kv_cache_manager.bind`)."""

    compresses = False
    binds = False  # the managers count vLLM's own slots

    def before_schedule(self) -> None:
        pass

    def skips_prefix_cache(self, request) -> bool:
        return False

    def record_chunks(self, scheduler_output) -> None:
        pass

    def after_schedule(self, scheduler_output) -> None:
        pass

    def step_cap(self, request, num_computed: int, num_new: int) -> int:
        return num_new


class GrowthReserve:
    """Scheduler-side admission rule; `scheduler` is vLLM's Scheduler (set by `attach`)."""

    # whether a group's slots differ from vLLM's logical tokens (the token ledger's compressed
    # rows): where they do not, a step's allocation is vLLM's own, untouched (every group, step)
    compresses = False
    binds = True  # vLLM's managers count slots by it (`kv_cache_manager.bind`)

    def __init__(self, reserve_growth: bool = True) -> None:
        self.scheduler = None
        self.reserve_growth = reserve_growth
        self._final_need: dict[str, list[int]] = {}
        self._chunks: dict[str, list[int]] = {}  # prompt chunk lengths, in order

    def num_groups(self) -> int:
        return len(self.scheduler.kv_cache_manager.coordinator.single_type_managers)

    def window_caps(self) -> list[tuple[int, int] | None]:
        """Per group, the most slots a request ever holds there, while in its prompt and once
        decoding: streaming heads in the pool hold sink + window + a prompt step, then sink +
        window + a decode step (`sink_window.py`); other groups the whole sequence (None)."""
        caps = self.__dict__.get("_window_caps")
        if caps is None:
            drafts = getattr(self.scheduler, "num_spec_tokens", 0) or 0
            caps = self._window_caps = [
                (m.max_admission_blocks_per_request * m.block_size,
                 m.kv_cache_spec.decode_blocks(drafts) * m.block_size)
                if isinstance(m, SinkWindowManager) else None
                for m in self.scheduler.kv_cache_manager.coordinator.single_type_managers]
        return caps

    def peak_tokens(self, request, num_tokens: int) -> list[int]:
        """Per KV-cache group, the slots a request of `num_tokens` tokens needs at its peak."""
        return [num_tokens if cap is None else min(num_tokens, cap[0])
                for cap in self.window_caps()]

    def final_need(self, request) -> list[int]:
        """Per group, the slots a request needs at its largest: prompt, every one of its
        max_tokens outputs and, with speculative decoding, the K draft slots of a last
        verification step, capped at the model length (memoised until it finishes). Past its
        prompt a request needs only a decode step's window in a streaming group."""
        need = self._final_need.get(request.request_id)
        if need is None:
            params = getattr(request, "sampling_params", None)
            max_new = getattr(params, "max_tokens", None) or 0
            # a last verification step also holds slots for its K draft tokens
            drafts = getattr(self.scheduler, "num_spec_tokens", 0) or 0
            total = request.num_prompt_tokens + max_new + drafts
            max_len = getattr(self.scheduler, "max_model_len", None)
            if max_len:
                total = min(total, max_len)
            need = self.peak_tokens(request, total)
            self._final_need[request.request_id] = need
        # (vLLM's prompt, a teacher-forced tail included: the tail runs as one step)
        if getattr(request, "num_computed_tokens", 0) >= request.num_prompt_tokens:
            need = [n if cap is None else min(n, cap[1])
                    for n, cap in zip(need, self.window_caps())]
        return need

    def admission_tokens(self, req_id: str, num_tokens: int, group: int = 0) -> int:
        """What admitting a request must find free in a group, in slots: its own final need
        plus the blocks the running requests still have to grow by to reach theirs. vLLM sums
        this over the groups (and its watermark) and compares with the free blocks."""
        request = self.scheduler.requests.get(req_id) if self.scheduler else None
        if request is None:
            return num_tokens
        if not self.reserve_growth:
            # stock rule (the sequence so far must fit), counted in compressed slots: a long
            # prompt that fits once evicted is admitted
            return self.peak_tokens(request, num_tokens)[group]
        manager = self.scheduler.kv_cache_manager.coordinator.single_type_managers[group]
        bs = manager.block_size
        growth_blocks = 0
        for other in self.scheduler.running:
            if other.request_id == req_id:
                continue
            # (blocks a sliding window freed are null entries: not held)
            held = sum(not b.is_null for b in manager.req_to_blocks.get(other.request_id, ()))
            growth_blocks += max(-(-self.final_need(other)[group] // bs) - held, 0)
        return self.final_need(request)[group] + growth_blocks * bs

    def forget_finished(self, scheduler_output) -> None:
        for req_id in scheduler_output.finished_req_ids:
            self._final_need.pop(req_id, None)
            self._chunks.pop(req_id, None)

    # -- what the scheduler asks every rule (the token ledger counts compressed slots) -------
    def before_schedule(self) -> None:
        """Before vLLM schedules: nothing to apply (the ledger frees evicted blocks here)."""

    def after_schedule(self, scheduler_output) -> None:
        """After vLLM schedules (its chunks recorded): forget the finished requests."""
        self.forget_finished(scheduler_output)

    def skips_prefix_cache(self, request) -> bool:
        """Whether a prefix hit would hold other K/V than this request computes: a
        teacher-forced tail is decode for the policy, so a hit reaching into it would be prompt
        K/V (caching stops at the policy's prompt, `sink_window.cached_tokens`); the ledger
        adds a request with policy overrides."""
        return request_prompt_len(request) < request.num_prompt_tokens

    def slots_needed(self, req_id: str, num_tokens: int, step_end: int, group: int) -> int:
        """A group's slots for an allocation of `num_tokens` logical tokens: the same here
        (paged blocks hold whole sequences; the ledger counts compressed slots)."""
        return num_tokens

    def physical(self, req_id: str, num_tokens: int, group: int = 0) -> int:
        """A request's slots in a group for `num_tokens` logical tokens: the same here."""
        return num_tokens

    # -- exact recompute after preemption ----------------------------------------------------
    def record_chunks(self, scheduler_output) -> None:
        """After vLLM's schedule (num_computed_tokens already advanced): append each prompt
        chunk that extends the request's recorded prefill (a replayed chunk does not)."""
        for req_id, c in scheduler_output.num_scheduled_tokens.items():
            request = self.scheduler.requests.get(req_id)
            if request is None:
                continue
            before, n = request.num_computed_tokens - c, request.num_prompt_tokens
            if before >= n:
                continue
            chunks = self._chunks.setdefault(req_id, [])
            if before == sum(chunks):
                chunks.append(min(c, n - before))

    canonical_chunk = 0  # pool storage: the prompt's canonical chunk E (sink_window.py)

    def step_cap(self, request, num_computed: int, num_new: int) -> int:
        """The tokens a request may run this step (vLLM would run `num_new`). Pool storage:
        a prompt step ends at the next multiple of E at the latest, so a streaming group holds
        at most sink + W + E tokens (its admission cap) however vLLM splits its budget."""
        num_new = self.replay_cap(request, num_computed, num_new)
        E = self.canonical_chunk
        if E and num_new > 0 and num_computed < request.num_prompt_tokens:
            num_new = min(num_new, E - num_computed % E)
        return num_new

    def replay_cap(self, request, num_computed: int, num_new: int) -> int:
        """The tokens a request may run this step, given the `num_new` vLLM would schedule:
        while a preempted request recomputes its recorded prompt chunks, exactly the next
        chunk (0 = wait for a step with budget for it whole); past its prompt, one token per
        step (its outputs were decoded one at a time). Prompt chunks never reach past the
        prompt, as in a first run."""
        n = request.num_prompt_tokens
        if num_new <= 0:
            return num_new
        if num_computed >= n:
            return min(num_new, 1) if request.num_preemptions else num_new
        start = 0
        for c in self._chunks.get(request.request_id, ()):
            if start == num_computed:
                return c if num_new >= c else 0
            start += c
        return min(num_new, n - num_computed)
