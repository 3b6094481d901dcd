"""Engine-core process: the token-eviction ledger, or for head-mask policies the admission
reserve (with the replay of preempted requests), attached to vLLM's scheduler (one per process;
the coordinator wrappers find them through `current()` and `reserve()`)."""

from __future__ import annotations

from vllm_kvevict.integration.admission import GrowthReserve
from vllm_kvevict.integration.token_eviction import TokenEvictionScheduler

_ledger: TokenEvictionScheduler | None = None
_reserve: GrowthReserve | None = None


def attach(scheduler) -> None:
    """Called after vLLM's Scheduler.__init__: build the ledger for token-eviction policies,
    the growth reserve for head-mask ones (`full` stays stock vLLM)."""
    global _ledger, _reserve
    from vllm_kvevict.integration.validation import model_shape, policy_config_of
    from vllm_kvevict.policies import build_policy

    vllm_config = scheduler.vllm_config
    cfg = policy_config_of(vllm_config)
    if cfg.uses_head_mask:
        _reserve = GrowthReserve(reserve_growth=cfg.admission == "reserve")
        _reserve.scheduler = scheduler
        scheduler._kvevict_reserve = _reserve
        return
    if not cfg.evicts_tokens:
        return
    num_layers, num_kv_heads = model_shape(vllm_config.model_config.hf_config)
    policy = build_policy(cfg, num_layers, num_kv_heads)
    from vllm_kvevict.integration.tiers import layer_groups

    groups = layer_groups(scheduler.kv_cache_config, num_layers)
    # the prompt is compressed once per eviction chunk: its peak need follows that chunk
    chunk = cfg.eviction_chunk or vllm_config.scheduler_config.max_num_batched_tokens
    _ledger = TokenEvictionScheduler(policy, chunk, groups,
                                     reserve_growth=cfg.admission == "reserve")
    _ledger.scheduler = scheduler
    _reserve = _ledger
    scheduler._kvevict_reserve = _ledger
    import logging

    logging.getLogger("vllm_kvevict").info(
        "vllm-kvevict: token eviction ledger over %d KV-cache group(s) of %s layers",
        groups.num_groups, sorted({len(groups.layers(g)) for g in range(groups.num_groups)}))
    scheduler._kvevict_ledger = _ledger


def ledger_of(scheduler) -> TokenEvictionScheduler | None:
    return getattr(scheduler, "_kvevict_ledger", None)


def current() -> TokenEvictionScheduler | None:
    return _ledger


def reserve_of(scheduler) -> GrowthReserve | None:
    return getattr(scheduler, "_kvevict_reserve", None)


def reserve() -> GrowthReserve | None:
    """The admission rule of this process's scheduler (the ledger itself for token eviction)."""
    return _reserve
