"""vLLM general plugin (entry point `vllm.general_plugins`): runs in every vLLM process.

Every patch of vLLM internals is a row of `contract.WRAPS`, one row per vLLM name: the name,
the function of ours that runs around it (it gets vLLM's original as an argument and decides
when to call it), and the process it matters in. Where vLLM has an extension point we use it
instead (the scheduler is a subclass, `core/kvevict_scheduler.py`, installed by
`create_engine_config` below). `register` applies the table once per process (workers are
spawned and load plugins again). Import-light: vLLM modules are imported when the table is
applied.
"""

from __future__ import annotations

import functools
import importlib
import logging
import sys

from vllm_kvevict.integration.plugins.contract import INERT_WRAPS, WRAPS, Wrap
from vllm_kvevict.integration.plugins.support import current_activation, platform_name, vllm_version

logger = logging.getLogger("vllm.kvevict")  # under vLLM's logger: its handler and format

_registered = False
inactive_reason: str | None = None
unlocked_by: dict[str, str] = {}  # on an unsupported platform: dtype -> the pass that unlocks it
applied: dict[str, object] = {}  # target -> vLLM's original (tests check every row applied)


def register() -> None:
    global _registered, inactive_reason, unlocked_by
    if _registered:
        return
    _registered = True
    inactive_reason, unlocked_by = current_activation()
    if unlocked_by:
        logger.warning("vllm-kvevict: vLLM %s on %s is outside the supported list; active by "
                       "the self-check: %s", vllm_version(), platform_name(),
                       ", ".join(f"{k}: {v}" for k, v in sorted(unlocked_by.items())))
    if inactive_reason is not None:
        logger.info("vllm-kvevict: plugin inactive: %s", inactive_reason)
        for wrap in WRAPS:
            if wrap.target in INERT_WRAPS:  # so a --kv-* flag gets our error, not argparse's
                _apply(wrap)
        return
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN,
                     "vllm_kvevict.integration.attention.backend.KVEvictAttentionBackend")
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    # By name, so a MultiConnector (ours beside a user's) can rebuild our stats in the API
    # server's stat loggers (MultiConnector.build_kv_connector_stats looks children up by name).
    try:
        KVConnectorFactory.register_connector(
            "KVEvictStatsConnector", "vllm_kvevict.integration.kv_stats.stats_connector",
            "KVEvictStatsConnector")
    except ValueError:  # (vLLM's answer to a second registration: once per process)
        pass
    # (in here: these import vLLM's managers; this module stays import-light)
    from vllm_kvevict.integration.kv_cache import prefix_cache
    from vllm_kvevict.integration.kv_cache.sink_window import register_manager

    register_manager()  # our sink + window spec -> manager (vLLM's spec registry)
    prefix_cache.register_manager()  # token eviction's prefix-caching spec -> manager

    api_server = "vllm.entrypoints.launchers.api_server.entry" in sys.modules
    for wrap in WRAPS:
        if api_server or not wrap.if_loaded:
            _apply(wrap)


def _resolve(spec: str):
    module_name, _, qualname = spec.partition(":")
    module = importlib.import_module(module_name)
    *owner_path, attr = qualname.split(".")
    owner = module
    for part in owner_path:
        owner = getattr(owner, part)
    return owner, attr


def _apply(wrap: Wrap) -> None:
    owner, attr = _resolve(wrap.target)
    hook_owner, hook_attr = _resolve(wrap.hook)
    hook = getattr(hook_owner, hook_attr)
    raw = owner.__dict__.get(attr) if isinstance(owner, type) else None
    stock = getattr(owner, attr)
    if isinstance(raw, classmethod):
        func = raw.__func__

        @functools.wraps(func)
        def wrapped_classmethod(cls, *args, **kwargs):
            return hook(cls, func, *args, **kwargs)
        new = classmethod(wrapped_classmethod)
    elif isinstance(raw, staticmethod) or not isinstance(owner, type):
        func = raw.__func__ if isinstance(raw, staticmethod) else stock

        @functools.wraps(func)
        def wrapped_function(*args, **kwargs):
            return hook(func, *args, **kwargs)
        new = staticmethod(wrapped_function) if isinstance(raw, staticmethod) else wrapped_function
    else:
        @functools.wraps(stock)
        def wrapped_method(self, *args, **kwargs):
            return hook(self, stock, *args, **kwargs)
        new = wrapped_method
    setattr(owner, attr, new)
    applied[wrap.target] = stock


# -- hooks that only route (the work is in the concept modules) ---------------------------------

def create_engine_config(engine_args, stock_create, *args, **kwargs):
    """`EngineArgs.create_engine_config`: our stats connector in the KV-transfer config (unless
    the user chose one), vLLM's config, validation against the model (which builds this
    process's served policy), then our scheduler and worker classes in the config."""
    # (both imports in here: they import vLLM, which the plugin entry point must not at load)
    from vllm_kvevict.integration.entrypoints import validation

    if inactive_reason is not None:  # a policy asked for through the config (the offline LLM)
        validation.refusing(validation.check_inactive, engine_args, inactive_reason)
        return stock_create(engine_args, *args, **kwargs)
    # (the scheduler's, worker's and API server's classes: only for an active policy)
    from vllm_kvevict.integration.core import kvevict_scheduler
    from vllm_kvevict.integration.entrypoints import api_server
    from vllm_kvevict.integration.worker import kvevict_worker

    # stats connector, scheduling, the fast layout
    fast = validation.refusing(validation.before_create, engine_args)
    requested = engine_args.enable_prefix_caching  # None unless the user set it
    vllm_config = stock_create(engine_args, *args, **kwargs)
    validation.refusing(validation.check_unlocked, vllm_config, unlocked_by)
    validation.validate_against_model(vllm_config, prefix_caching_requested=requested, fast=fast)
    validation.refusing(kvevict_scheduler.install, vllm_config)
    validation.refusing(kvevict_worker.install, vllm_config)
    api_server.remember_config(vllm_config)
    return vllm_config
