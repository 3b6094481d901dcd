"""vLLM general plugin (entry point `vllm.general_plugins`): runs in every vLLM process.

Every patch of vLLM internals is a row of `WRAPS`, one row per vLLM name: the name, the function
of ours that runs around it (it gets vLLM's original as an argument and decides when to call
it), and the process it matters in. Where vLLM has an extension point we use it instead (the
scheduler is a subclass, `kvevict_scheduler.py`, installed by `create_engine_config` below).
`register` applies the table once per process (workers are spawned and load plugins again).
tests/test_vllm_contract.py resolves every name in `PATCHED` and `RELIED_ON`: a vLLM upgrade
that moves one fails loudly. Import-light: vLLM modules are imported when the table is applied.
"""

from __future__ import annotations

import functools
import importlib
import logging
import sys
from dataclasses import dataclass

from vllm_kvevict.integration.support import activation, platform_name, vllm_version
from vllm_kvevict.integration.versions import KV_CACHE_PLANNING, MERGE_WORKER_SPECS

logger = logging.getLogger("vllm.kvevict")  # under vLLM's logger: its handler and format


@dataclass(frozen=True)
class Wrap:
    target: str  # "module:Owner.attribute" or "module:function"
    hook: str    # "module:function" of ours: hook(self, stock, *args) for methods,
                 # hook(stock, *args) for functions and staticmethods, hook(cls, stock, *args)
                 # for classmethods
    process: str  # where it matters
    # API-server-only names: applied only where vLLM has already imported the module (`vllm
    # serve` imports its app builder before plugins load; other processes never need it)
    if_loaded: bool = False


_I = "vllm_kvevict.integration."
WRAPS: tuple[Wrap, ...] = (
    # CLI and start-up (API-server process)
    Wrap("vllm.engine.arg_utils:EngineArgs.add_cli_args", _I + "cli:add_cli_args", "api server"),
    Wrap("vllm.engine.arg_utils:EngineArgs.from_cli_args", _I + "cli:from_cli_args",
         "api server"),
    Wrap("vllm.engine.arg_utils:EngineArgs.create_engine_config",
         _I + "registration:create_engine_config", "api server"),
    # KV-cache groups of streaming heads held in the pool (engine core; worker too)
    Wrap(f"{KV_CACHE_PLANNING}:get_kv_cache_groups", _I + "streaming.pool_groups:group_kv_cache",
         "engine core"),
    # KV-cache managers, every group's (engine core; the scheduler is a subclass)
    Wrap("vllm.v1.core.single_type_kv_cache_manager:"
         "SingleTypeKVCacheManager.get_num_blocks_to_allocate",
         _I + "scheduler:blocks_to_allocate", "engine core"),
    Wrap("vllm.v1.core.single_type_kv_cache_manager:SingleTypeKVCacheManager.allocate_new_blocks",
         _I + "scheduler:allocate_new_blocks", "engine core"),
    # API server: kv_stats into responses, server/ on the app
    Wrap("vllm.v1.engine.output_processor:RequestState.make_request_output",
         _I + "api_server:make_request_output", "api server", if_loaded=True),
    Wrap("vllm.entrypoints.launchers.api_server.entry:build_app", _I + "api_server:build_app",
         "api server", if_loaded=True),
)

# Not wrapped, but replaced or relied on (contract-tested all the same).
RELIED_ON = (
    # our scheduler class (kvevict_scheduler.py): installed through the engine config, its
    # overrides call these under super()
    "vllm.config.scheduler.SchedulerConfig.get_scheduler_cls",
    "vllm.v1.core.sched.scheduler.Scheduler.__init__",
    "vllm.v1.core.sched.scheduler.Scheduler.schedule",
    "vllm.v1.core.sched.scheduler.Scheduler._reserve_prefill_lookahead",
    "vllm.v1.core.sched.scheduler.Scheduler.update_from_output",
    # our worker class (kvevict_worker.py), over the platform's worker; vLLM adds a cache-sharing
    # layer to its target's group after initialize_from_config (V1: the runner's attribute)
    "vllm.config.parallel.ParallelConfig.worker_cls",
    "vllm.v1.worker.cpu_worker.CPUWorker",
    "vllm.v1.worker.gpu_worker.Worker.get_kv_cache_spec",
    "vllm.v1.worker.gpu_worker.Worker.initialize_from_config",
    "vllm.v1.worker.gpu_worker.Worker.execute_model",
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner.maybe_add_kv_sharing_layers_to_kv_cache_groups",
    # vLLM's V2 model runner (runners.py): rows -> request slots, the cache-sharing layers
    "vllm.v1.worker.gpu.states.RequestState",
    "vllm.v1.worker.gpu.attn_utils.get_shared_kv_cache_layers",
    # vLLM's documented override point for a V1 runner subclass (question_rows.py); the
    # CPU worker builds its runner at the end of init_device
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner._model_forward",
    "vllm.v1.worker.cpu_worker.CPUWorker.init_device",
    # patched eviction's question slots, counted where vLLM counts speculative lookahead
    "vllm.v1.core.kv_cache_manager.KVCacheManager.allocate_slots",
    "vllm.v1.attention.backends.registry.register_backend(CPU_ATTN)",  # backend.py replaces it
    # prefix_cache.py: our spec's manager, more keys per pooled block, vLLM's copy-on-write
    "vllm.v1.kv_cache_spec_registry.KVCacheSpecRegistry.register",
    "vllm.v1.core.single_type_kv_cache_manager.FullAttentionManager",
    "vllm.v1.core.block_pool.BlockPool._insert_block_hash",
    "vllm.v1.core.kv_cache_manager.KVCacheManager.take_kv_cache_block_copies",
    "vllm.v1.worker.utils.copy_kv_cache_blocks_inplace",
    # per-tier KV-cache groups (kv_cache_specs.py)
    "vllm.v1.kv_cache_interface.FullAttentionSpec.merge",
    "vllm.v1.kv_cache_interface.KVCacheSpec.is_uniform_with_collection",
    f"{KV_CACHE_PLANNING}._get_kv_cache_groups_uniform_page_size",
    "vllm.v1.core.kv_cache_coordinator.KVCacheCoordinatorNoPrefixCache",
    # the stats connector's channel to the API server (stats_connector.py, stat_logger.py):
    # scheduler-side connector stats ride in SchedulerStats to the stat-logger plugins
    "vllm.distributed.kv_transfer.kv_connector.factory.KVConnectorFactory.register_connector",
    "vllm.v1.metrics.loggers.StatLoggerBase.record",
    "vllm.plugins.STAT_LOGGER_PLUGINS_GROUP",
    # tensor parallel (kv_cache_specs.layer_heads): every rank must declare one spec per layer,
    # and rank r holds its contiguous slice of the KV heads
    MERGE_WORKER_SPECS,
    "vllm.distributed.get_tensor_model_parallel_rank",
    # streaming heads in the pool (sink_window.py): a spec + manager through vLLM's registry,
    # a cache-only companion layer per attention layer, the block-outer layout
    "vllm.v1.kv_cache_spec_registry.KVCacheSpecRegistry.register",
    "vllm.v1.core.single_type_kv_cache_manager.SlidingWindowManager.remove_skipped_blocks",
    "vllm.v1.core.single_type_kv_cache_manager.SingleTypeKVCacheManager._remove_blocks_in_range",
    "vllm.v1.kv_cache_interface.SlidingWindowSpec.max_admission_blocks_per_request",
    "vllm.v1.kv_cache_layout.KVCacheLayout.BLHNC",
    "vllm.forward_context.ForwardContext.__dataclass_fields__",  # no_compile_layers (test)
    # seeded sampling on the CPU worker (seeded_sampling.py, from the execute_model row): a
    # seeded request's generator in the sampler's dict and in the request's record becomes a
    # rewindable one, because _bookkeeping_sync rewinds it by offset
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner._bookkeeping_sync",
    "vllm.v1.worker.gpu_input_batch.InputBatch._make_sampling_metadata",
    "vllm.v1.worker.gpu_input_batch.CachedRequestState",  # its `generator` field
    # the API server's exit status (server/lifecycle.py): the engine client vLLM puts on the
    # app's state, its `errored`, and its `shutdown`, which lifecycle wraps on that one object
    # (a requested stop calls it while the engine runs; after a death it runs errored)
    "vllm.entrypoints.launchers.api_server.app_state.init_app_state",
    "vllm.v1.engine.async_llm.AsyncLLM.errored",
    "vllm.v1.engine.async_llm.AsyncLLM.dead_error",
    "vllm.v1.engine.async_llm.AsyncLLM.shutdown",
    # FULL CUDA graphs off for a policy (validation.cudagraph_without_attention): the engine
    # args' mode (None: vLLM's level default, FULL_AND_PIECEWISE from O2) and its enum
    "vllm.engine.arg_utils.EngineArgs.optimization_level",
    "vllm.config.compilation.CUDAGraphMode.PIECEWISE",
    "vllm.config.compilation.CUDAGraphMode.FULL_AND_PIECEWISE",
)

# vLLM objects changed, or read by a private name, outside WRAPS: (file, attribute, why).
# tests/test_layout.py finds every attribute set on an object that is not ours and every read
# of a private attribute we do not define, in integration/, and fails on one missing here (or
# listed here and gone).
TOUCHED = (
    ("backend.py", "common", "the step's common metadata on vLLM's metadata object, for the "
                             "per-step plan (streaming heads, token eviction)"),
    ("backend.py", "_k_scale_float", "the layer's fp8 K scale, as vLLM's CPU kernel reads it"),
    ("backend.py", "_v_scale_float", "the layer's fp8 V scale"),
    ("cpu_token.py", "_k_scale_float", "as backend.py"), ("cpu_token.py", "_v_scale_float", ""),
    ("paged_layout.py", "_k_scale_float", "fp8 K read back from the cache"),
    ("paged_layout.py", "_v_scale_float", "V"), ("validation.py", "backend", "FLEX_ATTENTION"
                                                  " off the CPU platform: ours under its name"),
    ("validation.py", "async_scheduling", "off for a policy off the CPU platform (untested)"),
    ("validation.py", "cudagraph_mode", "PIECEWISE over vLLM's FULL_AND_PIECEWISE default for "
                                        "a policy off the CPU platform (features.py)"),
    ("cli.py", "_actions", "argparse's: add the --kv-* group once"),
    ("cli.py", "additional_config", "the --kv-* flags folded into EngineArgs' JSON form"),
    ("head_order.py", "load_format", "the worker's load format, ours over the user's while it "
                                     "loads the model (restored after)"),
    ("flex_attention.py", "kvevict_queries", "the step's per-token chunk starts, on vLLM's "
                                             "FlexAttention metadata"),
    ("flex_attention.py", "kvevict_masks", "the step's block masks, one per head split"),
    ("flex_attention.py", "kvevict_capacity", "the padded mask-table sizes (one compile)"),
    ("flex_attention.py", "block_mask", "the layer's block mask for vLLM's FlexAttention"),
    ("flex_attention.py", "_dynamo", "torch's compiler config (below)"),
    ("flex_attention.py", "recompile_limit", "raised above vLLM's 16: one compilation per "
                                             "layer's count of full / streaming heads"),
    ("flex_token.py", "block_mask", "the same, token eviction's (on a copy of the metadata)"),
    ("flex_token.py", "num_actual_tokens", "on a copy of the metadata: questions' rows count"),
    ("kv_transfer.py", "kv_transfer_config", "our stats connector, alone or beside the "
                                             "user's, before vLLM builds the config"),
    ("kvevict_scheduler.py", "scheduler_cls", "our Scheduler subclass, vLLM's extension point"),
    ("kvevict_scheduler.py", "kvevict_reserve", "the scheduler's admission rule / ledger, handed "
                                                "to each KV-cache manager it built"),
    ("kvevict_scheduler.py", "skip_reading_prefix_cache", "a teacher-forced tail: no prefix hit"),
    ("kvevict_worker.py", "worker_cls", "our worker over the platform's, vLLM's extension point"),
    ("question_rows.py", "__class__", "the V1 runner / V2 model state vLLM built inline, as "
                                      "our subclass of its class (no class hook)"),
    ("kv_cache_specs.py", "kv_sharing_target_layer_name",
     "a layer without full heads shares its companion's cache"),
    ("registration.py", "_registry", "KVConnectorFactory's: register our connector once"),
    ("seeded_sampling.py", "generator", "a seeded request's generator made rewindable"),
    ("prefix_cache.py", "_insert_block_hash", "the block pool's: one more key on a block"),
    ("prefix_cache.py", "_ensure_registered", "vLLM's built-in specs registered before ours"),
    ("sink_window.py", "_null_block", "vLLM's null block, for dropped window positions"),
    ("sink_window.py", "_ensure_registered", "vLLM's built-in specs registered before ours"),
    ("sink_window.py", "_partial_hit_reqs", "SlidingWindowManager's partial prefix hits, as "
                                            "its own get_num_blocks_to_allocate reads them"),
    ("sink_window.py", "_record_new_block_ids", "the manager's block-zeroing switch, as its "
                                                "own allocate_new_blocks reads it"),
    ("stats_connector.py", "_kv_cache_manager", "the connector's KV-cache manager, for pool "
                                                "snapshots"),
)

PATCHED = tuple(w.target.replace(":", ".") for w in WRAPS)

# Where the plugin is inactive (`support.py`), only these rows apply (a policy gets our error)
INERT_WRAPS = ("vllm.engine.arg_utils:EngineArgs.add_cli_args",
               "vllm.engine.arg_utils:EngineArgs.from_cli_args",
               "vllm.engine.arg_utils:EngineArgs.create_engine_config")

_registered = False
inactive_reason: str | None = None
unlocked_by: dict[str, str] = {}  # on an unsupported platform: dtype -> the pass that unlocks it
applied: dict[str, object] = {}  # target -> vLLM's original (tests check every row applied)


def register() -> None:
    global _registered, inactive_reason, unlocked_by
    if _registered:
        return
    _registered = True
    inactive_reason, unlocked_by = activation(vllm_version(), platform_name())
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
                     "vllm_kvevict.integration.backend.KVEvictAttentionBackend")
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    # By name, so a MultiConnector (ours beside a user's) can rebuild our stats in the API
    # server's stat loggers (MultiConnector.build_kv_connector_stats looks children up by name).
    if "KVEvictStatsConnector" not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(
            "KVEvictStatsConnector", "vllm_kvevict.integration.kv_stats.stats_connector",
            "KVEvictStatsConnector")
    # (in here: these import vLLM's managers; this module stays import-light)
    from vllm_kvevict.integration.streaming.sink_window import register_manager
    from vllm_kvevict.integration.token_eviction import prefix_cache

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
    from vllm_kvevict.integration import validation

    if inactive_reason is not None:  # a policy asked for through the config (the offline LLM)
        validation.refusing(validation.check_inactive, engine_args, inactive_reason)
        return stock_create(engine_args, *args, **kwargs)
    # (the scheduler's, worker's and API server's classes: only for an active policy)
    from vllm_kvevict.integration import api_server, kvevict_scheduler, kvevict_worker

    validation.refusing(validation.before_create, engine_args)  # stats connector, scheduling
    requested = engine_args.enable_prefix_caching  # None unless the user set it
    vllm_config = stock_create(engine_args, *args, **kwargs)
    validation.refusing(validation.check_unlocked, vllm_config, unlocked_by)
    validation.validate_against_model(vllm_config, prefix_caching_requested=requested)
    validation.refusing(kvevict_scheduler.install, vllm_config)
    validation.refusing(kvevict_worker.install, vllm_config)
    api_server.remember_config(vllm_config)
    return vllm_config
