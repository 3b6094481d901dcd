"""The reference oracle's fp8 KV cache: what a served fp8 cache holds, written independently.

A cached key or value x becomes q * scale, where q is x / scale rounded toward zero to the fp8
format's grid and saturated at its largest finite value (vLLM's CPU kernels' rule; `auto`
leaves x alone). Attention then reads q * scale in float32. Scoring for token eviction uses the
forward's own (unquantized) keys, as the served path does.

Rounding toward zero is computed from torch's round-to-nearest cast: where that cast rounded
away from zero, step the code's magnitude down by one (the codes of an fp8 format's
non-negative values are ordered like the values).
"""

from __future__ import annotations

import torch

FP8_FORMATS = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
               "fp8_e5m2": torch.float8_e5m2}
KV_CACHE_DTYPES = ("auto", *FP8_FORMATS)


def cached_kv(x: torch.Tensor, kv_cache_dtype: str = "auto", scale: float = 1.0) -> torch.Tensor:
    """x as the KV cache holds it, in x's dtype."""
    if kv_cache_dtype == "auto":
        return x
    if kv_cache_dtype not in FP8_FORMATS:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r}; valid: {', '.join(KV_CACHE_DTYPES)}")
    fmt = FP8_FORMATS[kv_cache_dtype]
    largest = torch.finfo(fmt).max
    magnitude = (x.float() / scale).abs().clamp(max=largest)
    code = magnitude.to(fmt).view(torch.uint8)
    rounded_up = code.view(fmt).float() > magnitude
    code = torch.where(rounded_up, code - 1, code)
    q = code.view(fmt).float().copysign(x.float())
    return (q * scale).to(x.dtype)
