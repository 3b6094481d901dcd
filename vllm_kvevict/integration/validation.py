"""Start-up validation against the served model: a policy that cannot be served exactly stops
the server with one clear line before any weights load (never a silent fallback)."""

from __future__ import annotations

import os
import sys

from vllm_kvevict.config import KVPolicyConfig, KVPolicyError
from vllm_kvevict.integration.cli import ADDITIONAL_CONFIG_KEY, fail


def policy_config_of(vllm_config) -> KVPolicyConfig:
    """The KVPolicyConfig carried by a VllmConfig (`full` when absent)."""
    additional = vllm_config.additional_config or {}
    raw = additional.get(ADDITIONAL_CONFIG_KEY) if isinstance(additional, dict) else None
    return KVPolicyConfig.from_dict(raw)


def model_shape(hf_config) -> tuple[int, int]:
    text = getattr(hf_config, "get_text_config", lambda: hf_config)()
    num_layers = text.num_hidden_layers
    num_kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    return num_layers, num_kv_heads


def resolve_full_heads(cfg: KVPolicyConfig, model_path: str, num_layers: int, num_kv_heads: int):
    """(bool [L, H] full-head mask, source path) for duo/prulong; raises KVPolicyError."""
    from vllm_kvevict import masks

    path = cfg.mask_path or masks.default_mask_path(model_path, cfg.policy, cfg.sparsity)
    if path is None:
        raise KVPolicyError(
            f"no {cfg.policy} head mask is shipped for model {model_path!r}; pass one with "
            "--kv-mask PATH (our JSON, a PruLong 0/1 TSV or a DuoAttention gate TSV)")
    try:
        gates = masks.load_head_gates(path)
        masks.check_shape(gates, num_layers, num_kv_heads, str(path))
        full_heads = masks.full_heads_at_sparsity(gates, cfg.sparsity)
    except masks.MaskError as exc:
        raise KVPolicyError(str(exc)) from None
    return full_heads, str(path)


def _running_vllm_cli() -> bool:
    return os.path.basename(sys.argv[0]) == "vllm"


def validate_against_model(vllm_config) -> None:
    try:
        cfg = policy_config_of(vllm_config)
        if cfg.policy == "full":
            return
        num_layers, num_kv_heads = model_shape(vllm_config.model_config.hf_config)
        # Per-request eviction state starts at token 0: a prefix-cache hit would skip it.
        vllm_config.cache_config.enable_prefix_caching = False
        tiers = cfg.num_tiers(num_layers)
        if num_layers % tiers:
            # vLLM's hybrid allocator makes groups of equal layer counts: it would pad the
            # smaller tiers with phantom layers, and those cost pool memory.
            divisors = [d for d in range(1, num_layers + 1) if num_layers % d == 0]
            raise KVPolicyError(f"tiers={tiers} does not divide the model's {num_layers} layers; "
                                f"valid: {', '.join(map(str, divisors))}")
        if cfg.eviction_chunk is not None:
            # a chunk's last step must hold its observation window whole (its queries score)
            budget = vllm_config.scheduler_config.max_num_batched_tokens
            if budget < cfg.obs_window:
                raise KVPolicyError(f"eviction_chunk needs --max-num-batched-tokens >= "
                                    f"obs_window ({cfg.obs_window}), got {budget}")
        if cfg.policy in ("duo", "prulong"):
            _, source = resolve_full_heads(cfg, vllm_config.model_config.model, num_layers,
                                           num_kv_heads)
            # Pin the resolved file so every process serves the same mask.
            vllm_config.additional_config[ADDITIONAL_CONFIG_KEY]["mask_path"] = source
    except KVPolicyError as exc:
        if _running_vllm_cli():
            fail(str(exc))
        raise
