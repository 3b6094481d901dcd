"""What `--kv-attention-backend flex` serves so far, and the one-line refusal of the rest (plain
Python; `integration/entrypoints/validation.py` calls `flex_error` with the other start-up checks).

Served: `full`; the head masks `streaming`, `duo`, `prulong` (block-sparse masks: a streaming
head computes only its sink, window and chunk pages; its blocks go back to vLLM's pool as the
window moves, as on the CPU path), with vLLM's prefix caching (chunks canonical: multiples of
the step budget or of `--kv-eviction-chunk`, per token); the token policies
`snapkv`, `pyramidkv` (naive and patched, their tiers, `--kv-eviction-chunk`), whose evicted
blocks go back to vLLM's pool as on the CPU path; a head mask with `--kv-token-policy` (its
full heads evicting tokens, its streaming heads block-sparse, patched scoring's question rows
on both). Tensor parallel: each rank its slice of the heads, as on the CPU path
(`features.parallel_error` refuses what that path refuses); data parallel: one engine core per
replica, as on the CPU path.
"""

from __future__ import annotations

SERVED_POLICIES = ("full", "streaming", "duo", "prulong", "snapkv", "pyramidkv")
SUPPORTED = ("--kv-attention-backend flex serves --kv-policy full, streaming, duo, prulong "
             "(with or without --kv-token-policy), snapkv, pyramidkv; "
             "unquantized KV, tensor and data parallel (no pipeline parallel), no "
             "speculative decoding")


def _refusal(what: str) -> str:
    return f"--kv-attention-backend flex does not serve {what} yet; supported: {SUPPORTED}"


def flex_error(cfg, vllm_config) -> str | None:
    """Why this configuration cannot be served on the FlexAttention path (None: it can)."""
    if getattr(cfg, "attention_backend", "cpu") != "flex":
        return None
    if cfg.policy not in SERVED_POLICIES:
        return _refusal(f"--kv-policy {cfg.policy}")
    cache = getattr(vllm_config, "cache_config", None)
    dtype = str(getattr(cache, "cache_dtype", "auto"))
    if dtype not in ("auto", "float16", "bfloat16", "float32"):
        return _refusal(f"--kv-cache-dtype {dtype}")
    parallel = getattr(vllm_config, "parallel_config", None)
    size = int(getattr(parallel, "pipeline_parallel_size", 1) or 1)
    if size != 1:
        return _refusal(f"--pipeline-parallel-size {size}")
    if getattr(vllm_config, "speculative_config", None) is not None:
        return _refusal("speculative decoding")
    return None


# -- off the CPU platform: FlexAttention is the path (vLLM's CPU kernel exists only there) ------

def default_backend(raw: dict, platform: str) -> None:
    """A policy given without --kv-attention-backend runs on the platform's path: vLLM's CPU
    attention kernel on the CPU platform (the config's default), FlexAttention elsewhere.
    `raw`: the policy as the user gave it (`additional_config["kv_policy"]`), edited in place
    so every later process serves the same path."""
    if platform != "cpu" and raw.get("policy", "full") != "full":
        raw.setdefault("attention_backend", "flex")


def platform_error(cfg, platform: str, vllm_backend: str | None) -> str | None:
    """Off the CPU platform a policy runs on vLLM's FLEX_ATTENTION backend (ours, registered
    under that name): refuse the CPU kernel and any other vLLM attention backend.
    `vllm_backend`: the user's `--attention-backend` (None: not chosen)."""
    if platform == "cpu" or cfg.policy == "full":
        return None
    if cfg.attention_backend == "cpu":
        return (f"--kv-attention-backend {cfg.attention_backend} is vLLM's CPU attention "
                f"kernel, which platform {platform!r} does not have; valid there: "
                "--kv-attention-backend flex (the default off the CPU platform)")
    if vllm_backend not in (None, "FLEX_ATTENTION"):
        return (f"--attention-backend {vllm_backend}: --kv-policy {cfg.policy} runs on vLLM's "
                "FlexAttention backend off the CPU platform; valid: leave --attention-backend "
                "out, or --attention-backend FLEX_ATTENTION")
    return None
