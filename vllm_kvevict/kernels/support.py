"""What `--kv-attention-backend triton` serves so far, and the one-line refusal of the rest
(plain Python; `integration/entrypoints/validation.py` calls `triton_error` with the other
start-up checks). The path: our head-pages kernel (`head_pages.py`) over the FlexAttention
path's pool storage, a cache layer per KV head (`integration/attention/triton_attention.py`).
On the CPU platform it runs only in Triton's interpreter (exact, slow: tests); its GPU
serving waits for the kernel's first timing on a GPU (issue 86)."""

from __future__ import annotations

SUPPORTED = ("--kv-attention-backend triton serves every --kv-policy (with or without "
             "--kv-token-policy) on the CPU platform under Triton's interpreter "
             "(TRITON_INTERPRET=1); unquantized KV, one rank, no speculative decoding")


def _refusal(what: str) -> str:
    return f"--kv-attention-backend triton does not serve {what} yet; supported: {SUPPORTED}"


def triton_error(cfg, vllm_config, platform: str, interpreting: bool) -> str | None:
    """Why this configuration cannot be served on the Triton path (None: it can).
    `interpreting`: TRITON_INTERPRET=1 in this process's environment (the workers inherit it)."""
    if getattr(cfg, "attention_backend", "cpu") != "triton":
        return None
    if platform != "cpu":
        return _refusal(f"platform {platform!r}")
    if not interpreting:
        return _refusal("the CPU platform without TRITON_INTERPRET=1 (Triton has no CPU "
                        "backend here)")
    cache = getattr(vllm_config, "cache_config", None)
    dtype = str(getattr(cache, "cache_dtype", "auto"))
    if dtype not in ("auto", "float16", "bfloat16", "float32"):
        return _refusal(f"--kv-cache-dtype {dtype}")
    parallel = getattr(vllm_config, "parallel_config", None)
    for flag, field in (("--tensor-parallel-size", "tensor_parallel_size"),
                        ("--pipeline-parallel-size", "pipeline_parallel_size"),
                        ("--data-parallel-size", "data_parallel_size")):
        size = int(getattr(parallel, field, 1) or 1)
        if size != 1:
            return _refusal(f"{flag} {size}")
    if getattr(vllm_config, "speculative_config", None) is not None:
        return _refusal("speculative decoding")
    return None
