"""Start-up validation against the served model (API-server process, when vLLM creates the
engine config): a policy that cannot be served exactly stops the server with one clear line
before any weights load (never a silent fallback). Building the served policy here resolves and
pins its head mask, so every process serves the same file."""

from __future__ import annotations

import logging
import os
import sys

from vllm_kvevict.config import KVPolicyError
from vllm_kvevict.features import (PARALLEL_FLAGS, connector_error, cudagraph_error,
                                   decode_eviction_error, fast_layout, full_block_error,
                                   kv_cache_dtype_error,
                                   lora_error, model_error, model_runner_error, parallel_error,
                                   prefix_caching_error, prompt_embeds_error, serves_on_flex,
                                   speculative_error, tiers_error, eviction_chunk_error,
                                   token_prefix_error, v2_features_on)
from vllm_kvevict.flags import fail
from vllm_kvevict.flex.support import default_backend, flex_error, platform_error
from vllm_kvevict.integration.kv_cache.sink_window import canonical_chunk
from vllm_kvevict.integration.kv_stats.kv_transfer import inject_config, user_connectors
from vllm_kvevict.integration.plugins.support import platform_name, unlocked_dtype_error
from vllm_kvevict.integration.plugins.versions import uses_v2_runner, v2_runner_expected
from vllm_kvevict.kernels.support import triton_error
from vllm_kvevict.served import ADDITIONAL_CONFIG_KEY, policy_config_of, settle_config

logger = logging.getLogger("vllm.kvevict")  # under vLLM's logger: its handler and format


def _running_vllm_cli() -> bool:
    return os.path.basename(sys.argv[0]) == "vllm"


def validate_against_model(vllm_config, prefix_caching_requested: bool | None = None,
                           fast: bool = False) -> None:
    """`prefix_caching_requested`: the engine args' value before vLLM resolved its default
    (None: the user did not ask). `fast`: `before_create` chose the fast layout."""
    try:
        platform = platform_name()
        raw = (getattr(vllm_config, "additional_config", None) or {}).get(ADDITIONAL_CONFIG_KEY)
        if isinstance(raw, dict):
            default_backend(raw, platform)  # off the CPU platform: FlexAttention
            if fast:
                keep_fast_layout_served(vllm_config, raw)
        attention = getattr(vllm_config, "attention_config", None)
        chosen = getattr(getattr(attention, "backend", None), "name", None)
        # the model first: a mask lookup for an unsupported model would only confuse
        model = getattr(vllm_config, "model_config", None)
        error = model_error(policy_config_of(vllm_config), getattr(model, "hf_config", None))
        if error:
            raise KVPolicyError(error)
        # raises on a missing or mismatched mask; writes the policy's decisions into the config
        served = settle_config(vllm_config, prefix_caching_requested)
        cfg = served.config
        for error in feature_errors(vllm_config, served, platform, chosen,
                                    prefix_caching_requested):
            if error:
                raise KVPolicyError(error)
        if serves_on_flex(cfg, platform, chosen):
            # our backend is registered under vLLM's name (flex_attention.use_head_pages_backend)
            from vllm.v1.attention.backends.registry import AttentionBackendEnum

            attention.backend = AttentionBackendEnum.FLEX_ATTENTION
        check_tiers_and_chunk(vllm_config, served)
    except KVPolicyError as exc:
        if _running_vllm_cli():
            fail(str(exc))
        raise


def feature_errors(vllm_config, served, platform: str, chosen: str | None,
                   prefix_caching_requested: bool | None) -> tuple:
    """Each vLLM feature's refusal for the served policy (None where it is served exactly):
    features.py holds the rules, this reads vLLM's config for them."""
    cfg = served.config
    # (getattr: a VllmConfig has them all; the unit tests pass partial stand-ins)
    parallel = getattr(vllm_config, "parallel_config", None)
    sizes = {field: getattr(parallel, field, 1) for field, _ in PARALLEL_FLAGS}
    cache = getattr(vllm_config, "cache_config", None)
    cache_dtype = getattr(cache, "cache_dtype", "auto")
    users = user_connectors(getattr(vllm_config, "kv_transfer_config", None))
    method = getattr(getattr(vllm_config, "speculative_config", None), "method", None)
    # features.py: which vLLM features each policy is served exactly with
    embeds = bool(getattr(getattr(vllm_config, "model_config", None),
                          "enable_prompt_embeds", False))
    return (platform_error(cfg, platform, chosen), flex_error(cfg, vllm_config),
            triton_error(cfg, vllm_config, platform, os.environ.get("TRITON_INTERPRET") == "1"),
            parallel_error(cfg, sizes, served.shape.num_kv_heads),
            kv_cache_dtype_error(cfg, str(cache_dtype)),
            speculative_error(cfg, method), connector_error(cfg, users),
            decode_eviction_error(cfg, method, str(cache_dtype)),
            prompt_embeds_error(cfg, embeds),
            prefix_caching_error(cfg, prefix_caching_requested),
            token_prefix_error(
                cfg, bool(getattr(cache, "enable_prefix_caching", False)), sizes,
                method, getattr(vllm_config, "lora_config", None) is not None,
                cfg.eviction_chunk or 0, int(getattr(cache, "block_size", 0) or 0)),
            lora_error(cfg, getattr(vllm_config, "lora_config", None) is not None),
            full_block_error(cfg, int(getattr(cache, "block_size", 0) or 0), sizes,
                             uses_v2_runner(vllm_config),
                             canonical_chunk(vllm_config) if cfg.full_block_size
                             else 0, str(cache_dtype)),
            model_runner_error(cfg, uses_v2_runner(vllm_config), v2_features_on(vllm_config)))


def check_tiers_and_chunk(vllm_config, served) -> None:
    """--kv-tiers must divide the layers; --kv-eviction-chunk must hold the observation window."""
    budget = getattr(getattr(vllm_config, "scheduler_config", None), "max_num_batched_tokens", 0)
    for error in (tiers_error(served.config, served.shape.num_layers),
                  eviction_chunk_error(served.config, budget)):
        if error:
            raise KVPolicyError(error)


def choose_fast_layout(engine_args) -> bool:
    """CPU platform, before vLLM builds its config: a head mask's fast layout
    (`features.fast_layout`) where the user set no `--block-size` and no
    `--kv-full-block-size`, on the CPU kernel; True when chosen. With several tensor- or
    pipeline-parallel ranks or the V2 runner the full heads keep the streaming heads' block
    (`full_block_error` serves larger ones on one rank with V1 only), as the hybrid's do."""
    raw = (getattr(engine_args, "additional_config", None) or {}).get(ADDITIONAL_CONFIG_KEY)
    if not isinstance(raw, dict) or engine_args.block_size is not None:
        return False
    cfg = policy_config_of(engine_args)
    layout = fast_layout(cfg)
    if layout is None or cfg.full_block_size is not None:
        return False
    engine_args.block_size, full = layout
    if ((engine_args.tensor_parallel_size or 1) > 1
            or (engine_args.pipeline_parallel_size or 1) > 1 or v2_runner_expected()):
        full = None
    if full:
        raw["full_block_size"] = full
    logger.info("vllm-kvevict: streaming heads in %d-token blocks%s (the fast layout; "
                "--block-size or --kv-full-block-size overrides it)", layout[0],
                f", full heads in {full}" if full else "")
    return True


def keep_fast_layout_served(vllm_config, raw: dict) -> None:
    """The fast layout's full-head blocks stand where `full_block_error` serves them (e.g. the
    canonical prefill chunk a multiple of them); elsewhere the full heads keep --block-size
    too, which is as exact."""
    cache = vllm_config.cache_config
    parallel = vllm_config.parallel_config
    cfg = policy_config_of(vllm_config)
    chunk = cfg.eviction_chunk or (vllm_config.scheduler_config.max_num_batched_tokens
                                   if cache.enable_prefix_caching else 0)
    error = full_block_error(cfg, int(cache.block_size),
                             {field: getattr(parallel, field, 1) for field, _ in PARALLEL_FLAGS},
                             uses_v2_runner(vllm_config), int(chunk), str(cache.cache_dtype))
    if error and raw.pop("full_block_size", None):
        logger.info("vllm-kvevict: full heads in %d-token blocks too: %s", cache.block_size,
                    error)


def before_create(engine_args) -> bool:
    """Settled on the engine args before vLLM builds its config: our stats connector
    (`kv_transfer.inject_config`), and a policy's steps scheduled one after the other. vLLM's
    CPU platform turns async scheduling off (platforms/cpu.py), so every policy is tested that
    way; elsewhere it is vLLM's default, and it schedules step t+1 before step t's output is
    back while the policies free evicted blocks at the next schedule (untested there): off
    unless the user asked for it, and then refused. FULL CUDA graphs likewise wherever our
    attention backend runs (`cudagraph_without_attention`). On the CPU platform: the fast
    layout (`choose_fast_layout`); True when chosen."""
    inject_config(engine_args)
    if platform_name() == "cpu":
        return choose_fast_layout(engine_args)
    cfg = policy_config_of(engine_args)  # (it reads any object's additional_config)
    policy = cfg.policy
    if policy != "full" or cfg.attention_backend == "flex":
        cudagraph_without_attention(engine_args, cfg)
    if policy == "full":
        return False
    if engine_args.async_scheduling:
        raise KVPolicyError(f"--async-scheduling is not supported with --kv-policy {policy} "
                            "yet (untested: evicted blocks are freed at the next schedule); "
                            "valid: leave it out (the plugin turns it off) or "
                            "--no-async-scheduling")
    engine_args.async_scheduling = False
    return False


def cudagraph_without_attention(engine_args, cfg) -> None:
    """Our attention builds its block masks and eviction plans on the host every step, which a
    FULL CUDA graph would replay stale (`features.cudagraph_error`). vLLM's default on CUDA
    (optimization level O2, O3) is FULL_AND_PIECEWISE: when the user set no mode, PIECEWISE
    here (O0's default, NONE, stays); a FULL mode the user asked for is refused."""
    from vllm.config.compilation import CUDAGraphMode

    compilation = engine_args.compilation_config
    mode = getattr(compilation, "cudagraph_mode", None)
    error = cudagraph_error(cfg, None if mode is None else getattr(mode, "name", str(mode)))
    if error:
        raise KVPolicyError(error)
    if mode is None and int(getattr(engine_args, "optimization_level", 2)) > 0:
        compilation.cudagraph_mode = CUDAGraphMode.PIECEWISE


def check_inactive(engine_args, inactive_reason: str) -> None:
    """The plugin is inactive here: a policy in `additional_config` would be silently ignored."""
    policy = ((engine_args.additional_config or {}).get(ADDITIONAL_CONFIG_KEY)
              if isinstance(engine_args.additional_config, dict) else None)
    if isinstance(policy, dict) and policy.get("policy", "full") != "full":
        raise KVPolicyError(f"additional_config[{ADDITIONAL_CONFIG_KEY!r}] needs an active "
                            f"plugin, and it is inactive here: {inactive_reason}")


def check_unlocked(vllm_config, unlocked_by: dict[str, str]) -> None:
    """A policy on a platform unlocked by the self-check: only in a dtype it passed in."""
    if policy_config_of(vllm_config).policy == "full":
        return
    dtype = str(getattr(vllm_config.model_config, "dtype", "")).removeprefix("torch.")
    error = unlocked_dtype_error(dtype, unlocked_by)
    if error:
        raise KVPolicyError(error)


def refusing(check, *args):
    """Run a start-up step that raises KVPolicyError (its result returned): under the `vllm` CLI
    its message is the one line the server stops with."""
    try:
        return check(*args)
    except KVPolicyError as exc:
        if _running_vllm_cli():
            fail(str(exc))
        raise
