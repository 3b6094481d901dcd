"""Scheduler side (engine-core process): the admission rule of every evicting policy and, for
token eviction, the ledger of physical slots, attached to our `KVEvictScheduler`
(`kvevict_scheduler.py`) when vLLM builds it.

`attach` builds the rule once per scheduler; the scheduler keeps it and binds it to each of its
KV-cache managers (`bind`: our table, weakly keyed, not an attribute on vLLM's managers), where
the KV-cache-manager functions below, the bodies of wraps listed in `registration.py`, find it
(`rule_of`; the token-eviction ledger is a `GrowthReserve` with compressed sizes).
"""

from __future__ import annotations

import functools
import inspect
import logging
import weakref

from vllm_kvevict.integration.core.admission import GrowthReserve, StockAdmission
from vllm_kvevict.integration.core.token_ledger import TokenEvictionLedger
from vllm_kvevict.integration.kv_cache.prefix_cache import TokenPrefixManager
from vllm_kvevict.integration.kv_cache.sink_window import canonical_chunk
from vllm_kvevict.integration.kv_cache.specs import layer_groups
from vllm_kvevict.served import served_policy

logger = logging.getLogger("vllm.kvevict")  # under vLLM's logger: its handler and format

# The rule each of vLLM's KV-cache managers counts slots by, bound by the scheduler that built
# it (weak keys: a scheduler's managers go with it); a manager bound to none is stock vLLM.
_RULES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def bind(managers, rule: GrowthReserve | StockAdmission) -> None:
    """`KVEvictScheduler.__init__`: its managers (one per KV-cache group) count by `rule`; our
    prefix-caching managers start a request's ledger from its hit (`TokenPrefixManager.ledger`)."""
    for manager in managers:
        if not rule.binds:
            _RULES.pop(manager, None)
        else:
            _RULES[manager] = rule
        if isinstance(manager, TokenPrefixManager):
            manager.ledger = rule


def rule_of(manager) -> GrowthReserve | None:
    return _RULES.get(manager)


def attach(scheduler) -> GrowthReserve | StockAdmission:
    """After vLLM's Scheduler.__init__ (in `KVEvictScheduler`): the growth reserve for head-mask
    policies, the ledger for token-eviction ones, vLLM's own answers for `full`."""
    served = served_policy(scheduler.vllm_config)
    cfg, kind = served.config, served.kind
    reserve_growth = cfg.admission == "reserve"
    if kind == "full":
        return StockAdmission()
    if kind == "head_mask":
        rule = GrowthReserve(reserve_growth=reserve_growth)
        rule.canonical_chunk = canonical_chunk(scheduler.vllm_config)
    else:  # token, hybrid (a head mask with a token policy: its full heads' slots)
        groups = layer_groups(scheduler.kv_cache_config, served.shape.num_layers)
        # the prompt is compressed once per eviction chunk: its peak need follows that chunk
        chunk = cfg.eviction_chunk or scheduler.vllm_config.scheduler_config.max_num_batched_tokens
        rule = TokenEvictionLedger(served.policy, chunk, groups, reserve_growth=reserve_growth,
                                   for_request=served.for_request)
        logger.info("vllm-kvevict: token eviction ledger over %d KV-cache group(s) of %s layers",
                    groups.num_groups,
                    sorted({len(groups.layers(g)) for g in range(groups.num_groups)}))
    rule.scheduler = scheduler
    return rule


@functools.lru_cache(maxsize=None)
def _parameter_names(fn) -> tuple[str, ...]:
    """`fn`'s parameter names in order (vLLM's signature: positional-or-keyword only, pinned
    by `tests/test_vllm_contract.py`), so a call's arguments bind without `inspect.bind` (this
    runs per KV-cache group, request and step)."""
    return tuple(inspect.signature(fn).parameters)


def blocks_to_allocate(manager, stock_count, *args, **kwargs):
    """`SingleTypeKVCacheManager.get_num_blocks_to_allocate`, per KV-cache group (one manager
    each): vLLM's logical token counts -> the group's physical slots (the coordinator asks every
    group's manager with the same counts). Admission (`apply_admission_cap`, vLLM's
    full-sequence gate) of every evicting policy: the growth reserve (`admission.py`), so no
    admitted request is ever preempted."""
    rule = _RULES.get(manager)
    if rule is None or (not rule.compresses and kwargs.get("apply_admission_cap") is False):
        # (a step's allocation with logical slots: vLLM's count, no binding; its coordinator
        # passes the cap by keyword)
        return stock_count(manager, *args, **kwargs)
    arguments = dict(zip(_parameter_names(stock_count), (manager, *args)), **kwargs)
    group = manager.kv_cache_group_id
    request_id, num_tokens = arguments["request_id"], arguments["num_tokens"]
    if arguments.get("apply_admission_cap"):
        num_tokens = rule.admission_tokens(request_id, num_tokens, group)
        # a prefix hit's null entries (a sliding window's gap) hold nothing: vLLM subtracts
        # every hit entry from the need, so add the nulls back
        hit = arguments.get("new_computed_blocks") or ()
        num_tokens += sum(b.is_null for b in hit) * manager.block_size
        # a sliding-window group's own cap is per request; ours already counts the window,
        # and it reserves the running requests' growth too, which that cap would cut off
        arguments["apply_admission_cap"] = False
    else:  # a step's allocation: the group's slots (compressed ones for the token ledger)
        slots = rule.slots_needed(request_id, num_tokens,
                                  arguments.get("num_tokens_main_model", num_tokens), group)
        if slots == num_tokens:  # (vLLM's count stands)
            return stock_count(manager, *args, **kwargs)
        num_tokens = slots
    arguments["num_tokens"] = num_tokens
    if "num_tokens_main_model" in arguments:
        arguments["num_tokens_main_model"] = min(arguments["num_tokens_main_model"], num_tokens)
    return stock_count(**arguments)


def allocate_new_blocks(manager, stock_allocate, request_id, num_tokens, num_tokens_main_model,
                        *args, **kwargs):
    """`SingleTypeKVCacheManager.allocate_new_blocks`: physical slots of the group."""
    rule = _RULES.get(manager)
    if rule is not None and rule.compresses:
        group = manager.kv_cache_group_id
        num_tokens = rule.slots_needed(request_id, num_tokens, num_tokens_main_model, group)
        num_tokens_main_model = rule.physical(request_id, num_tokens_main_model, group)
    return stock_allocate(manager, request_id, num_tokens, num_tokens_main_model, *args,
                          **kwargs)
