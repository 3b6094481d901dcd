"""The contract with vLLM: every vLLM name the plugin wraps (`WRAPS`), relies on without
wrapping (`RELIED_ON`), or changes or reads by a private name (`TOUCHED`), in one table, and the
public-but-internal state it reads (`PUBLIC_INTERNALS`, counted apart).

`registration.py` applies `WRAPS`; tests/test_vllm_contract.py resolves every name of `PATCHED`,
`RELIED_ON` and `PUBLIC_INTERNALS` and ratchets RELIED_ON + TOUCHED; tests/test_layout.py finds
every touched attribute in the glue and fails on one missing from `touched_sites()`; and
`contract_report.py` looks every row up on the installed vLLM (`python -m
vllm_kvevict.contract`). Plain data: no vLLM import.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_kvevict.integration.plugins.versions import (KV_CACHE_PLANNING, MERGE_WORKER_SPECS,
                                                        V1_RUNNER)


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
    Wrap("vllm.engine.arg_utils:EngineArgs.add_cli_args", _I + "entrypoints.cli:add_cli_args",
         "api server"),
    Wrap("vllm.engine.arg_utils:EngineArgs.from_cli_args", _I + "entrypoints.cli:from_cli_args",
         "api server"),
    Wrap("vllm.engine.arg_utils:EngineArgs.create_engine_config",
         _I + "plugins.registration:create_engine_config", "api server"),
    # KV-cache groups of streaming heads held in the pool (engine core; worker too)
    Wrap(f"{KV_CACHE_PLANNING}:get_kv_cache_groups", _I + "kv_cache.pool_groups:group_kv_cache",
         "engine core"),
    # KV-cache managers, every group's (engine core; the scheduler is a subclass)
    Wrap("vllm.v1.core.single_type_kv_cache_manager:"
         "SingleTypeKVCacheManager.get_num_blocks_to_allocate",
         _I + "core.kv_cache_manager:blocks_to_allocate", "engine core"),
    Wrap("vllm.v1.core.single_type_kv_cache_manager:SingleTypeKVCacheManager.allocate_new_blocks",
         _I + "core.kv_cache_manager:allocate_new_blocks", "engine core"),
    # API server: kv_stats into responses, server/ on the app
    Wrap("vllm.v1.engine.output_processor:RequestState.make_request_output",
         _I + "entrypoints.api_server:make_request_output", "api server", if_loaded=True),
    Wrap("vllm.entrypoints.launchers.api_server.entry:build_app",
         _I + "entrypoints.api_server:build_app", "api server", if_loaded=True),
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
    # our CPU worker's runner is built at the end of init_device (question_rows.py)
    "vllm.v1.worker.cpu_worker.CPUWorker.init_device",
    # vLLM's V2 model runner (runners.py): rows -> request slots, the cache-sharing layers
    "vllm.v1.worker.gpu.states.RequestState",
    "vllm.v1.worker.gpu.attn_utils.get_shared_kv_cache_layers",
    # patched eviction's question slots, counted where vLLM counts speculative lookahead
    "vllm.v1.core.kv_cache_manager.KVCacheManager.allocate_slots",
    # quiet steps (kv_cache_coordinator.py): our subclass of the scheduler's coordinator class
    # answers these once for all groups, or calls vLLM's
    "vllm.v1.core.kv_cache_coordinator.KVCacheCoordinator.get_num_blocks_to_allocate",
    "vllm.v1.core.kv_cache_coordinator.KVCacheCoordinator.allocate_new_blocks",
    "vllm.v1.core.kv_cache_coordinator.KVCacheCoordinator.cache_blocks",
    "vllm.v1.core.kv_cache_coordinator.KVCacheCoordinator.get_num_cacheable_tokens",
    "vllm.v1.core.kv_cache_coordinator.KVCacheCoordinator.free",
    "vllm.v1.core.kv_cache_coordinator.KVCacheCoordinator.remove_skipped_blocks",
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
    # the stats connector's channel to the API server (kv_stats/stats_connector.py,
    # entrypoints/stat_logger.py):
    # scheduler-side connector stats ride in SchedulerStats to the stat-logger plugins
    "vllm.distributed.kv_transfer.kv_connector.factory.KVConnectorFactory.register_connector",
    "vllm.v1.metrics.loggers.StatLoggerBase.record",
    "vllm.plugins.STAT_LOGGER_PLUGINS_GROUP",
    # (the scheduler's KV-cache manager, handed to the connector for pool snapshots)
    "vllm.distributed.kv_transfer.kv_connector.v1.base.KVConnectorBase_V1.bind_kv_cache_manager",
    # tensor parallel (kv_cache_specs.layer_heads): every rank must declare one spec per layer,
    # and rank r holds its contiguous slice of the KV heads
    MERGE_WORKER_SPECS,
    "vllm.distributed.get_tensor_model_parallel_rank",
    # streaming heads in the pool (sink_window.py): a spec + manager through vLLM's registry
    # (the register row above), a cache-only companion layer per attention layer, the
    # block-outer layout
    "vllm.v1.core.single_type_kv_cache_manager.SlidingWindowManager.remove_skipped_blocks",
    "vllm.v1.core.single_type_kv_cache_manager.SingleTypeKVCacheManager._remove_blocks_in_range",
    # (its block-zeroing switch, as vLLM's own managers read it; the pool's `null_block`, an
    # attribute BlockPool.__init__ sets, is read as they read it)
    "vllm.v1.core.single_type_kv_cache_manager.SingleTypeKVCacheManager.records_new_block_ids",
    "vllm.v1.kv_cache_interface.SlidingWindowSpec.max_admission_blocks_per_request",
    "vllm.v1.kv_cache_layout.KVCacheLayout.BLHNC",
    "vllm.forward_context.ForwardContext.__dataclass_fields__",  # no_compile_layers (test)
    # the API server's exit status (server/lifecycle.py): the engine client vLLM puts on the
    # app's state, its `errored`, and its `shutdown`, which lifecycle wraps on that one object
    # (a requested stop calls it while the engine runs; after a death it runs errored)
    "vllm.entrypoints.launchers.api_server.app_state.init_app_state",
    "vllm.v1.engine.async_llm.AsyncLLM.errored",
    "vllm.v1.engine.async_llm.AsyncLLM.dead_error",
    "vllm.v1.engine.async_llm.AsyncLLM.shutdown",
    # FULL CUDA graphs off for a policy (validation.cudagraph_without_attention): the engine
    # args' mode (None: vLLM's level default, FULL_AND_PIECEWISE from O2) and the value set
    "vllm.engine.arg_utils.EngineArgs.optimization_level",
    "vllm.config.compilation.CUDAGraphMode.PIECEWISE",
)
# The V1 model runner's names (vLLM 0.32, 0.33), relied on where it runs: the cache-sharing
# layers' group (kvevict_worker.py), vLLM's documented override point for a runner subclass
# (question_rows.py), and seeded sampling's rewind (seeded_sampling.py: a seeded request's
# generator in the sampler's dict and its record made rewindable, because _bookkeeping_sync
# rewinds it by offset). vLLM 0.34 removed the V1 runner (`versions.V1_RUNNER`).
V1_RUNNER_ROWS = (
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner.maybe_add_kv_sharing_layers_to_kv_cache_groups",
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner._model_forward",
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner._bookkeeping_sync",
    "vllm.v1.worker.gpu_input_batch.InputBatch._make_sampling_metadata",
    "vllm.v1.worker.gpu_input_batch.CachedRequestState",  # its `generator` field
)
if V1_RUNNER:
    RELIED_ON += V1_RUNNER_ROWS

# vLLM objects changed, or read by a private name, outside WRAPS: (file, attribute, why), one
# row per attribute (`file` names every glue file that touches it, comma-separated).
# tests/test_layout.py finds every attribute set on an object that is not ours and every read
# of a private attribute we do not define, in integration/, and fails on one missing from
# `touched_sites()` (this table and NOT_VLLM), or listed there and gone.
TOUCHED = (
    ("attention/fp8.py", "_k_scale_float",
     "the layer's K scale, as vLLM's CPU kernels read it (`fp8.layer_scales`, every reader's)"),
    ("attention/fp8.py", "_v_scale_float", "its V scale"),
    ("entrypoints/validation.py", "backend",
     "FLEX_ATTENTION off the CPU platform: ours under its name"),
    ("entrypoints/validation.py", "async_scheduling",
     "off for a policy off the CPU platform (untested)"),
    ("entrypoints/validation.py", "cudagraph_mode",
     "PIECEWISE over vLLM's FULL_AND_PIECEWISE default for a policy off the CPU platform "
     "(features.py)"),
    ("entrypoints/cli.py", "additional_config",
     "the --kv-* flags folded into EngineArgs' JSON form"),
    ("worker/head_order.py", "load_format",
     "the worker's load format, ours over the user's while it loads the model (restored "
     "after)"),
    ("attention/flex_attention.py, attention/flex_token.py", "block_mask",
     "the layer's block mask for vLLM's FlexAttention (token eviction's on a copy of the "
     "metadata)"),
    ("attention/flex_token.py", "num_actual_tokens",
     "on a copy of the metadata: questions' rows count"),
    ("kv_stats/kv_transfer.py", "kv_transfer_config",
     "our stats connector, alone or beside the user's, before vLLM builds the config"),
    ("core/kvevict_scheduler.py", "scheduler_cls",
     "our Scheduler subclass, vLLM's extension point"),
    ("core/kvevict_scheduler.py", "skip_reading_prefix_cache",
     "a teacher-forced tail: no prefix hit"),
    ("core/kv_cache_coordinator.py, worker/question_rows.py", "__class__",
     "an object vLLM built with no class hook, as our subclass of its class: the scheduler's "
     "KV-cache coordinator (quiet steps), the V1 runner / V2 model state (question rows)"),
    ("core/kv_cache_coordinator.py, kv_cache/sink_window.py", "_partial_hit_reqs",
     "a manager's pending copy-on-write prefix hit (no quiet step for that request; "
     "SlidingWindowManager's, as its own get_num_blocks_to_allocate reads them)"),
    ("worker/kvevict_worker.py", "worker_cls",
     "our worker over the platform's, vLLM's extension point"),
    ("kv_cache/specs.py", "kv_sharing_target_layer_name",
     "a layer without full heads shares its companion's cache"),
    ("worker/seeded_sampling.py", "generator", "a seeded request's generator made rewindable"),
    ("kv_cache/prefix_cache.py", "_insert_block_hash", "the block pool's: one more key on a block"),
    ("kv_cache/sink_window.py", "_ensure_registered",
     "vLLM's built-in specs registered before ours (`register_specs`, every spec's)"),
)

# Not vLLM's names, set or read privately by the glue (torch's, argparse's): no upstream hook
# retires them, so they are not counted with TOUCHED; the layout scan accepts them all the same.
NOT_VLLM = (
    ("entrypoints/cli.py", "_actions", "argparse's: add the --kv-* group once"),
    ("attention/flex_attention.py", "_dynamo", "torch's compiler config (below)"),
    ("attention/flex_attention.py", "recompile_limit",
     "torch's, raised above vLLM's 16: one compilation per layer's count of full / streaming "
     "heads"),
)


def touched_sites() -> set[tuple[str, str]]:
    """(file, attribute) for every file of every TOUCHED and NOT_VLLM row."""
    return {(file, attribute) for files, attribute, _ in TOUCHED + NOT_VLLM
            for file in files.split(", ")}


# vLLM's public-but-internal state the glue reads (attributes of its engine objects, no
# underscore, set in vLLM's own __init__ or fields): not a hook, so not in RELIED_ON, but a
# vLLM change to any of them breaks the glue all the same. Counted apart by the contract
# report, so a smaller table above is no blind spot; tests/test_vllm_contract.py checks each
# is read in the glue and is there on the installed vLLM ("Owner.attribute" of vLLM's class).
_S, _M = "vllm.v1.core.sched.scheduler.Scheduler.", \
    "vllm.v1.core.single_type_kv_cache_manager.SingleTypeKVCacheManager."
_P, _R = "vllm.v1.core.block_pool.BlockPool.", "vllm.v1.request.Request."
_C = "vllm.v1.attention.backend.CommonAttentionMetadata."
PUBLIC_INTERNALS = (
    # the scheduler's state (core/: admission, the token ledger, our scheduler; kv_stats/)
    _S + "kv_cache_manager", _S + "kv_cache_config", _S + "requests", _S + "waiting",
    _S + "running", _S + "connector",
    "vllm.v1.core.kv_cache_manager.KVCacheManager.coordinator",
    "vllm.v1.core.kv_cache_coordinator.KVCacheCoordinator.single_type_managers",
    # each KV-cache group's manager, its block pool and blocks
    _M + "req_to_blocks", _M + "num_cached_block", _M + "block_pool", _M + "kv_cache_group_id",
    _M + "kv_cache_spec", _M + "enable_caching", _M + "use_eagle",
    _P + "null_block", _P + "hash_block_size", _P + "get_cached_block", _P + "get_new_blocks",
    _P + "free_blocks", _P + "get_usage",
    "vllm.v1.core.kv_cache_utils.KVCacheBlock.block_id",
    "vllm.v1.core.kv_cache_utils.KVCacheBlock.is_null",
    # the engine's request
    _R + "num_computed_tokens", _R + "num_prompt_tokens", _R + "num_output_tokens",
    _R + "num_preemptions", _R + "prompt_token_ids", _R + "block_hashes",
    _R + "get_finished_reason",
    # the worker and vLLM's V2 model runner (worker/runners.py, question_rows.py)
    "vllm.v1.worker.gpu_worker.Worker.model_runner",
    "vllm.v1.worker.gpu.model_runner.GPUModelRunner.req_states",
    "vllm.v1.worker.gpu.model_runner.GPUModelRunner.block_tables",
    "vllm.v1.worker.gpu.model_runner.GPUModelRunner.model_state",
    "vllm.v1.worker.gpu.states.RequestState.req_id_to_index",
    "vllm.v1.worker.gpu.states.RequestState.index_to_req_id",
    "vllm.v1.worker.gpu.states.RequestState.prompt_len",
    "vllm.v1.worker.gpu.block_table.BlockTables.num_blocks",
    # the step's attention metadata and forward context (attention/, kv_cache/head_pages.py)
    _C + "num_actual_tokens", _C + "query_start_loc_cpu", _C + "slot_mapping",
    _C + "block_table_tensor",
    "vllm.forward_context.ForwardContext.attn_metadata",
    "vllm.forward_context.ForwardContext.no_compile_layers",
)
# (the V1 model runner's, where it exists: `versions.V1_RUNNER`)
V1_RUNNER_INTERNALS = (
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner.input_batch",
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner.requests",
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner.shared_kv_cache_layers",
    "vllm.v1.worker.gpu_input_batch.InputBatch.req_ids",
    "vllm.v1.worker.gpu_input_batch.InputBatch.num_prompt_tokens",
    "vllm.v1.worker.gpu_input_batch.InputBatch.block_table",
    "vllm.v1.worker.block_table.MultiGroupBlockTable.block_tables",
    "vllm.v1.worker.block_table.BlockTable.num_blocks_per_row",
)
if V1_RUNNER:
    PUBLIC_INTERNALS += V1_RUNNER_INTERNALS

PATCHED = tuple(w.target.replace(":", ".") for w in WRAPS)

# Where the plugin is inactive (`support.py`), only these rows apply (a policy gets our error)
INERT_WRAPS = ("vllm.engine.arg_utils:EngineArgs.add_cli_args",
               "vllm.engine.arg_utils:EngineArgs.from_cli_args",
               "vllm.engine.arg_utils:EngineArgs.create_engine_config")
