"""vLLM general plugin (entry point `vllm.general_plugins`): runs in every vLLM process.

It must stay importable and idempotent: workers are spawned and load it again. All touches of
vLLM internals start here; each patched name is listed in `PATCHED` and checked by
tests/test_vllm_contract.py so a vLLM upgrade fails loudly instead of serving wrong attention.
"""

from __future__ import annotations

import functools
import logging

logger = logging.getLogger("vllm_kvevict")
_registered = False

PATCHED = (
    "vllm.engine.arg_utils.EngineArgs.add_cli_args",
    "vllm.engine.arg_utils.EngineArgs.from_cli_args",
    "vllm.engine.arg_utils.EngineArgs.create_engine_config",
    "vllm.v1.attention.backends.registry.register_backend(CPU_ATTN)",
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner.get_kv_cache_spec",
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner.execute_model",
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner._model_forward",
    "vllm.v1.core.kv_cache_manager.KVCacheManager.allocate_slots",
    "vllm.v1.worker.gpu_model_runner.add_kv_sharing_layers_to_kv_cache_groups",
    "vllm.v1.worker.block_table.MultiGroupBlockTable.compute_slot_mapping",
    "vllm.v1.core.sched.scheduler.Scheduler.__init__",
    "vllm.v1.core.sched.scheduler.Scheduler.schedule",
    "vllm.v1.core.sched.scheduler.Scheduler._reserve_prefill_lookahead",
    "vllm.v1.core.single_type_kv_cache_manager.SingleTypeKVCacheManager"
    ".get_num_blocks_to_allocate",
    "vllm.v1.core.single_type_kv_cache_manager.SingleTypeKVCacheManager.allocate_new_blocks",
    # relied on, not patched: per-tier KV-cache groups (integration/tiers.py)
    "vllm.v1.kv_cache_interface.FullAttentionSpec.merge",
    "vllm.v1.kv_cache_interface.KVCacheSpec.is_uniform_with_collection",
    "vllm.v1.core.kv_cache_utils._get_kv_cache_groups_uniform_page_size",
    "vllm.v1.core.kv_cache_coordinator.KVCacheCoordinatorNoPrefixCache",
    # kv_stats (_install_stats; the Scheduler hook is set by integration/connector.py when the
    # engine core creates our stats connector)
    "vllm.v1.core.sched.scheduler.Scheduler.update_from_output",
    "vllm.v1.engine.output_processor.RequestState.make_request_output",
    "vllm.entrypoints.launchers.api_server.entry.build_app",
)


def register() -> None:
    global _registered
    if _registered:
        return
    _registered = True
    _patch_cli()
    _register_backend()
    _patch_runner()
    _patch_scheduler()
    _install_stats()


def _patch_cli() -> None:
    from vllm.engine.arg_utils import EngineArgs

    from vllm_kvevict.integration import cli
    from vllm_kvevict.integration.validation import validate_against_model

    original_add = EngineArgs.add_cli_args
    original_from = EngineArgs.from_cli_args.__func__
    original_create = EngineArgs.create_engine_config

    @functools.wraps(original_add)
    def add_cli_args(parser, *a, **kw):
        parser = original_add(parser, *a, **kw)
        cli.add_kv_policy_args(parser)
        return parser

    @functools.wraps(original_from)
    def from_cli_args(cls, args):
        engine_args = original_from(cls, args)
        cli.fold_into_engine_args(engine_args, args)
        return engine_args

    @functools.wraps(original_create)
    def create_engine_config(self, *a, **kw):
        vllm_config = original_create(self, *a, **kw)
        validate_against_model(vllm_config)
        return vllm_config

    EngineArgs.add_cli_args = staticmethod(add_cli_args)
    EngineArgs.from_cli_args = classmethod(from_cli_args)
    EngineArgs.create_engine_config = create_engine_config


def _register_backend() -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN,
                     "vllm_kvevict.integration.backend.KVEvictAttentionBackend")


def _patch_runner() -> None:
    """Worker side: per-layer paged specs with full heads only, and per-step bookkeeping."""
    import dataclasses

    import torch
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.models.utils import extract_layer_index
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs
    from vllm.v1.worker import gpu_model_runner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.config import get_layers_from_vllm_config

    from vllm_kvevict.integration.head_split import paged_spec
    from vllm_kvevict.integration.tiers import tier_specs
    from vllm_kvevict.integration.worker_state import get_state, init_state

    original_spec = GPUModelRunner.get_kv_cache_spec
    original_execute = GPUModelRunner.execute_model
    original_share = gpu_model_runner.add_kv_sharing_layers_to_kv_cache_groups

    @functools.wraps(original_spec)
    def get_kv_cache_spec(self):
        state = init_state(self.vllm_config)
        if state is None:
            return original_spec(self)
        state.runner = self
        layers = get_layers_from_vllm_config(self.vllm_config, Attention)
        index = {name: extract_layer_index(name) for name in layers}
        with_full = [n for n in layers if state.heads[index[n]].full_kv]
        # vLLM needs one paged layer to schedule blocks at all; with every head streaming,
        # the first layer keeps a 1-head placeholder (reported as held bytes, never read).
        target = with_full[0] if with_full else next(iter(layers))
        for name, layer in layers.items():
            if name != target and not state.heads[index[name]].full_kv:
                layer.kv_sharing_target_layer_name = target
        specs = original_spec(self)
        for name, spec in list(specs.items()):
            heads = state.heads[index[name]]
            specs[name] = paged_spec(spec, heads) or dataclasses.replace(spec, num_kv_heads=1)
        if state.token is not None:
            # Token eviction: one KV-cache group (block table) per tier of layers.
            num_layers = state.policy.num_layers
            specs = tier_specs(specs, index, num_layers, state.config.num_tiers(num_layers))
        return specs

    @functools.wraps(original_share)
    def add_kv_sharing_layers(shared, groups, runner_only=None):
        original_share(shared, groups, runner_only)
        # vLLM's helper adds the layer names but not their per-layer spec entry; a layer
        # sharing another's cache shares its spec too.
        for group in groups:
            spec = group.kv_cache_spec
            if isinstance(spec, UniformTypeKVCacheSpecs):
                for name, target in shared.items():
                    if target in spec.kv_cache_specs:
                        spec.kv_cache_specs.setdefault(name, spec.kv_cache_specs[target])

    @functools.wraps(original_execute)
    def execute_model(self, scheduler_output, *args, **kwargs):
        state = get_state()
        if state is not None:
            state.runner = self
            state.step += 1
            state.release(scheduler_output.finished_req_ids)
            state.release(getattr(scheduler_output, "preempted_req_ids", None))
        output = original_execute(self, scheduler_output, *args, **kwargs)
        if state is not None:
            state.finish_step()
        return output

    original_forward = GPUModelRunner._model_forward

    @functools.wraps(original_forward)
    def model_forward(self, input_ids=None, positions=None, *args, **kwargs):
        # Patched chunked eviction: the question tokens ride along as extra rows after the
        # (padded) batch; the attention backend knows where they are from the step plan.
        state = get_state()
        plan = None if state is None or state.token is None else state.plan
        if plan is None or not plan.valid or not plan.num_questions or input_ids is None:
            return original_forward(self, input_ids, positions, *args, **kwargs)
        plan.question_offset = input_ids.shape[0]
        input_ids = torch.cat([input_ids, plan.question_ids.to(input_ids.dtype)])
        positions = torch.cat([positions, plan.question_positions.to(positions.dtype)])
        out = original_forward(self, input_ids, positions, *args, **kwargs)
        return out[: plan.question_offset] if isinstance(out, torch.Tensor) else out

    from vllm.v1.worker.block_table import MultiGroupBlockTable

    original_slot_mapping = MultiGroupBlockTable.compute_slot_mapping

    @functools.wraps(original_slot_mapping)
    def compute_slot_mapping(self, num_reqs, query_start_loc, positions):
        # Token eviction writes each layer's KV at its own physical slots (the step plan) and
        # never reads vLLM's logical slot mappings; with one KV-cache group per tier, computing
        # them costs one OpenMP kernel call per group and step. Group 0's is kept.
        state = get_state()
        if state is None or state.token is None or len(self.block_tables) == 1:
            return original_slot_mapping(self, num_reqs, query_start_loc, positions)
        self.block_tables[0].compute_slot_mapping(num_reqs, query_start_loc, positions)

    MultiGroupBlockTable.compute_slot_mapping = compute_slot_mapping
    GPUModelRunner._model_forward = model_forward
    GPUModelRunner.get_kv_cache_spec = get_kv_cache_spec
    GPUModelRunner.execute_model = execute_model
    gpu_model_runner.add_kv_sharing_layers_to_kv_cache_groups = add_kv_sharing_layers


def _patch_scheduler() -> None:
    """Engine-core side of token eviction: physical block accounting and tail-block freeing."""
    import inspect

    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager

    from vllm_kvevict.integration import scheduler_side

    original_init = Scheduler.__init__
    original_schedule = Scheduler.schedule
    original_lookahead = Scheduler._reserve_prefill_lookahead
    original_count = SingleTypeKVCacheManager.get_num_blocks_to_allocate
    original_allocate = SingleTypeKVCacheManager.allocate_new_blocks
    count_signature = inspect.signature(original_count)

    @functools.wraps(original_init)
    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        scheduler_side.attach(self)

    @functools.wraps(original_schedule)
    def schedule(self, *args, **kwargs):
        ledger = scheduler_side.ledger_of(self)
        reserve = scheduler_side.reserve_of(self)  # the ledger itself for token eviction
        if ledger is not None:
            ledger.before_schedule()
        output = original_schedule(self, *args, **kwargs)
        if reserve is not None:
            reserve.record_chunks(output)
        if ledger is not None:
            ledger.after_schedule(output)  # forgets finished requests too
        elif reserve is not None:
            reserve.forget_finished(output)
        return output

    # Both of vLLM's scheduling branches (running and waiting) end their token count with
    # this call, right before "0 tokens: skip the request": the one place to make a preempted
    # request's recompute follow its first run's chunks (admission.py, replay_cap) and to keep
    # prefill steps inside eviction chunks (token_eviction.py, step_cap).
    @functools.wraps(original_lookahead)
    def reserve_prefill_lookahead(self, request, num_computed_tokens, num_new_tokens):
        num_new_tokens = original_lookahead(self, request, num_computed_tokens, num_new_tokens)
        reserve = scheduler_side.reserve_of(self)
        if reserve is None:
            return num_new_tokens
        return reserve.step_cap(request, num_computed_tokens, num_new_tokens)

    # Per KV-cache group (one manager each): vLLM's logical token counts -> the group's
    # physical slots (the coordinator asks every group's manager with the same counts).
    # Admission (apply_admission_cap: vLLM's full-sequence gate) of every evicting policy:
    # the growth reserve (`admission.py`), so no admitted request is ever preempted.
    @functools.wraps(original_count)
    def get_num_blocks_to_allocate(self, *args, **kwargs):
        ledger, reserve = scheduler_side.current(), scheduler_side.reserve()
        if reserve is None:
            return original_count(self, *args, **kwargs)
        bound = count_signature.bind(self, *args, **kwargs)
        arguments, group = bound.arguments, self.kv_cache_group_id
        request_id, num_tokens = arguments["request_id"], arguments["num_tokens"]
        if arguments.get("apply_admission_cap"):
            num_tokens = reserve.admission_tokens(request_id, num_tokens, group)
        elif ledger is not None:
            num_tokens = ledger.physical(request_id, num_tokens, group)
        else:
            return original_count(self, *args, **kwargs)
        arguments["num_tokens"] = num_tokens
        if "num_tokens_main_model" in arguments:
            arguments["num_tokens_main_model"] = min(arguments["num_tokens_main_model"],
                                                     num_tokens)
        return original_count(*bound.args, **bound.kwargs)

    @functools.wraps(original_allocate)
    def allocate_new_blocks(self, request_id, num_tokens, num_tokens_main_model, *args,
                            **kwargs):
        ledger = scheduler_side.current()
        if ledger is not None:
            group = self.kv_cache_group_id
            num_tokens = ledger.physical(request_id, num_tokens, group)
            num_tokens_main_model = ledger.physical(request_id, num_tokens_main_model, group)
        return original_allocate(self, request_id, num_tokens, num_tokens_main_model, *args,
                                 **kwargs)

    from vllm.v1.core.kv_cache_manager import KVCacheManager

    original_alloc_slots = KVCacheManager.allocate_slots

    @functools.wraps(original_alloc_slots)
    def allocate_slots(self, request, num_new_tokens, *args, **kwargs):
        # Patched eviction: a non-final prefill chunk also writes its question's k KVs right
        # after the chunk; reserve those slots (the mechanism speculative decoding uses).
        ledger = scheduler_side.current()
        policy = None if ledger is None else ledger.request_policy(request)
        if policy is not None and policy.config.patched:
            n, end = request.num_prompt_tokens, request.num_computed_tokens + num_new_tokens
            if end < n and policy.config.is_eviction_point(end, n):
                extra = min(policy.config.obs_window, n)
                kwargs["num_lookahead_tokens"] = kwargs.get("num_lookahead_tokens", 0) + extra
        return original_alloc_slots(self, request, num_new_tokens, *args, **kwargs)

    KVCacheManager.allocate_slots = allocate_slots
    Scheduler.__init__ = init
    Scheduler.schedule = schedule
    Scheduler._reserve_prefill_lookahead = reserve_prefill_lookahead
    SingleTypeKVCacheManager.get_num_blocks_to_allocate = get_num_blocks_to_allocate
    SingleTypeKVCacheManager.allocate_new_blocks = allocate_new_blocks


def _install_stats() -> None:
    """Per-request kv_stats (server/README.md). Every process: `create_engine_config` gives the
    engine our stats connector (integration/connector.py) unless the user chose a KV connector
    or set VLLM_KVEVICT_STATS=0. API-server process only (vLLM's `vllm serve` has imported its
    app builder before plugins load): the output-processor hook that records each finished
    request's stats, and the app builder that adds /v1/kv_stats, the response middleware and
    the Prometheus series."""
    import sys

    from vllm.engine.arg_utils import EngineArgs

    from vllm_kvevict.integration import connector

    original_create = EngineArgs.create_engine_config

    @functools.wraps(original_create)
    def create_engine_config(self, *a, **kw):
        connector.inject_config(self)
        return original_create(self, *a, **kw)

    EngineArgs.create_engine_config = create_engine_config

    entry = sys.modules.get("vllm.entrypoints.launchers.api_server.entry")
    if entry is None:
        return
    from vllm.v1.engine.output_processor import RequestState

    original_output = RequestState.make_request_output
    original_build = entry.build_app

    @functools.wraps(original_output)
    def make_request_output(self, *args, **kwargs):
        # vLLM passes (new_token_ids, pooling_output, finish_reason, stop_reason,
        # kv_transfer_params, ...); only a finished request carries kv_transfer_params.
        params = kwargs.get("kv_transfer_params", args[4] if len(args) > 4 else None)
        if params is not None and isinstance(params, dict) and "kv_stats" in params:
            try:
                from server.kv_stats import record_engine_output

                record_engine_output(self.request_id, self.external_req_id, params)
            except Exception:
                logger.exception("vllm-kvevict: recording kv_stats failed")
        return original_output(self, *args, **kwargs)

    @functools.wraps(original_build)
    def build_app(*args, **kwargs):
        app = original_build(*args, **kwargs)
        from server.kv_stats import install_app

        install_app(app)
        return app

    RequestState.make_request_output = make_request_output
    entry.build_app = build_app
