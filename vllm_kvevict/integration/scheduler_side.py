"""Engine-core process: the token-eviction ledger attached to vLLM's scheduler (one per
process; the coordinator wrappers find it through `current()`)."""

from __future__ import annotations

from vllm_kvevict.integration.token_eviction import TokenEvictionScheduler

_ledger: TokenEvictionScheduler | None = None


def attach(scheduler) -> None:
    """Called after vLLM's Scheduler.__init__: build the ledger for token-eviction policies."""
    global _ledger
    from vllm_kvevict.integration.validation import model_shape, policy_config_of
    from vllm_kvevict.policies import build_policy

    vllm_config = scheduler.vllm_config
    cfg = policy_config_of(vllm_config)
    if not cfg.evicts_tokens:
        return
    num_layers, num_kv_heads = model_shape(vllm_config.model_config.hf_config)
    policy = build_policy(cfg, num_layers, num_kv_heads)
    from vllm_kvevict.integration.tiers import layer_groups

    groups = layer_groups(scheduler.kv_cache_config, num_layers)
    _ledger = TokenEvictionScheduler(policy, vllm_config.scheduler_config.max_num_batched_tokens,
                                     groups)
    _ledger.scheduler = scheduler
    import logging

    logging.getLogger("vllm_kvevict").info(
        "vllm-kvevict: token eviction ledger over %d KV-cache group(s) of %s layers",
        groups.num_groups, sorted({len(groups.layers(g)) for g in range(groups.num_groups)}))
    scheduler._kvevict_ledger = _ledger


def ledger_of(scheduler) -> TokenEvictionScheduler | None:
    return getattr(scheduler, "_kvevict_ledger", None)


def current() -> TokenEvictionScheduler | None:
    return _ledger
