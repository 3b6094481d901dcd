"""vLLM's `Scheduler` with the plugin's engine-core side, installed as vLLM's scheduler class
(`scheduler_config.scheduler_cls`, read by the engine core) when the engine config is created.

`KVEvictScheduler` attaches the admission rule (`kv_cache_manager.attach`) once vLLM's
scheduler is built, binds it to the KV-cache managers and hands it to kv_stats, applies last
step's evictions before vLLM schedules, caps prefill steps for exact replay and eviction
chunks, and tells the stats connector a step's output is back. A user's own
`--scheduler-cls` that subclasses vLLM's Scheduler is composed with it (our methods first in
the MRO, theirs under `super()`); any other class is refused at start-up. The engine core
gets the config pickled, so the class is named by a string it can import (`composition.py`).
"""

from __future__ import annotations

from vllm.v1.core.sched.scheduler import Scheduler

from vllm_kvevict.config import KVPolicyError
from vllm_kvevict.integration.core import kv_cache_coordinator
from vllm_kvevict.integration.core.kv_cache_manager import attach, bind
from vllm_kvevict.integration.kv_stats.stats_connector import on_rule_attached, on_step_output
from vllm_kvevict.integration.plugins.composition import install_over, resolve


class KVEvictScheduler(Scheduler):
    # the admission rule (`admission.GrowthReserve`, the token ledger, its subclass, or
    # `StockAdmission` for `full`: one interface), set in __init__
    kv_reserve = None
    # a head mask's quiet decode steps answered once for all KV-cache groups
    # (kv_cache_coordinator.py; False: vLLM's per-group path, as tests compare)
    quiet_steps = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.kv_reserve = attach(self)
        coordinator = self.kv_cache_manager.coordinator
        # vLLM built one manager per KV-cache group: each counts slots by the rule
        bind(coordinator.single_type_managers, self.kv_reserve)
        on_rule_attached(self, self.kv_reserve)  # kv_stats reads the ledger's prefix reuse
        if self.quiet_steps:
            kv_cache_coordinator.install(coordinator, self.kv_reserve)

    def schedule(self, *args, **kwargs):
        """Apply last step's evictions first; afterwards record prompt chunks (for exact
        replay) and the chunks this step will compress."""
        rule = self.kv_reserve
        rule.before_schedule()
        if self.cache_config.enable_prefix_caching:
            for request in self.waiting:
                if rule.skips_prefix_cache(request):
                    request.skip_reading_prefix_cache = True
        output = super().schedule(*args, **kwargs)
        rule.record_chunks(output)
        rule.after_schedule(output)  # forgets finished requests too
        return output

    def _reserve_prefill_lookahead(self, request, num_computed_tokens: int,
                                   num_new_tokens: int) -> int:
        """Both of vLLM's scheduling branches (running and waiting) end their token count with
        this call, right before "0 tokens: skip the request": the one place to make a
        preempted request's recompute follow its first run's chunks (`admission.replay_cap`)
        and to keep prefill steps inside eviction chunks
        (`ledger.cap_step_in_eviction_chunk`)."""
        num_new_tokens = super()._reserve_prefill_lookahead(request, num_computed_tokens,
                                                            num_new_tokens)
        return self.kv_reserve.step_cap(request, num_computed_tokens, num_new_tokens)

    def update_from_output(self, scheduler_output, model_runner_output):
        on_step_output(self, scheduler_output)  # the stats connector times the step
        return super().update_from_output(scheduler_output, model_runner_output)


def __getattr__(name: str):
    """vLLM resolves `scheduler_cls` by name in the engine core: rebuild a composed class."""
    return resolve(KVEvictScheduler, name)


def install(vllm_config) -> None:
    """Make vLLM build our scheduler: over the class it would pick (Scheduler, or
    AsyncScheduler with async scheduling), or over the user's `--scheduler-cls`. Raises
    KVPolicyError when the user's class is not a Scheduler subclass."""
    sched = vllm_config.scheduler_config
    try:
        chosen = sched.get_scheduler_cls()
    except (ImportError, AttributeError, ValueError) as exc:
        raise KVPolicyError(f"--scheduler-cls {sched.scheduler_cls}: cannot import it "
                            f"({exc})") from None
    sched.scheduler_cls = install_over(KVEvictScheduler, Scheduler, chosen,
                                       f"--scheduler-cls {sched.scheduler_cls}")
