"""Start-up validation against the served model (API-server process, when vLLM creates the
engine config): a policy that cannot be served exactly stops the server with one clear line
before any weights load (never a silent fallback). Building the served policy here resolves and
pins its head mask, so every process serves the same file."""

from __future__ import annotations

import os
import sys

from vllm_kvevict.config import KVPolicyError
from vllm_kvevict.features import speculative_error
from vllm_kvevict.integration.cli import fail
from vllm_kvevict.served import served_policy


def _running_vllm_cli() -> bool:
    return os.path.basename(sys.argv[0]) == "vllm"


def validate_against_model(vllm_config) -> None:
    try:
        served = served_policy(vllm_config)  # raises on a missing or mismatched mask
        cfg = served.config
        if cfg.policy == "full":
            return
        num_layers = served.shape.num_layers
        method = getattr(getattr(vllm_config, "speculative_config", None), "method", None)
        if error := speculative_error(cfg, method):  # features.py: what is served exactly
            raise KVPolicyError(error)
        from vllm_kvevict.integration.kv_transfer import user_connectors

        users = user_connectors(getattr(vllm_config, "kv_transfer_config", None))
        if users:
            # A connector saves and loads whole KV blocks by token position; eviction rewrites
            # them (compacted, or streaming heads outside the pool). Loaded blocks would have to
            # be what the policy kept at the same chunk boundaries: not built, so refused.
            raise KVPolicyError(
                f"--kv-transfer-config connector(s) {', '.join(users)} cannot be combined with "
                f"--kv-policy {cfg.policy}: a KV connector saves and loads KV blocks that "
                "eviction rewrites; with a connector use --kv-policy full (kv_stats stay on)")
        tiers = cfg.num_tiers(num_layers)
        if num_layers % tiers:
            # vLLM's hybrid allocator makes groups of equal layer counts: it would pad the
            # smaller tiers with phantom layers, and those cost pool memory.
            divisors = [d for d in range(1, num_layers + 1) if num_layers % d == 0]
            raise KVPolicyError(f"--kv-tiers {tiers} does not divide the model's {num_layers} "
                                f"layers; valid: {', '.join(map(str, divisors))}")
        if cfg.eviction_chunk is not None:
            # a chunk's last step must hold its observation window whole (its queries score)
            budget = vllm_config.scheduler_config.max_num_batched_tokens
            if budget < cfg.obs_window:
                raise KVPolicyError(f"--kv-eviction-chunk needs --max-num-batched-tokens >= "
                                    f"--kv-obs-window ({cfg.obs_window}), got {budget}")
    except KVPolicyError as exc:
        if _running_vllm_cli():
            fail(str(exc))
        raise
