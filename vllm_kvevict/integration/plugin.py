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
    "vllm.v1.worker.gpu_model_runner.add_kv_sharing_layers_to_kv_cache_groups",
)


def register() -> None:
    global _registered
    if _registered:
        return
    _registered = True
    _patch_cli()
    _register_backend()
    _patch_runner()


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

    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.models.utils import extract_layer_index
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs
    from vllm.v1.worker import gpu_model_runner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.config import get_layers_from_vllm_config

    from vllm_kvevict.integration.head_split import paged_spec
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
        return original_execute(self, scheduler_output, *args, **kwargs)

    GPUModelRunner.get_kv_cache_spec = get_kv_cache_spec
    GPUModelRunner.execute_model = execute_model
    gpu_model_runner.add_kv_sharing_layers_to_kv_cache_groups = add_kv_sharing_layers
