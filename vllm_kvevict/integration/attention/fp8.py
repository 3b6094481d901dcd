"""fp8 KV cache (`--kv-cache-dtype fp8|fp8_e4m3|fp8_e5m2`) on vLLM's CPU backend.

vLLM 0.32's CPU kernels (`cpu_attn_reshape_and_cache`, pinned by tests/test_vllm_contract.py)
store x as x / scale rounded toward zero to the fp8 grid, saturating (not torch's
round-to-nearest `.to(float8)`), in a uint8 tensor (`fp8` means e4m3), and attend over
code * scale in float32. The streaming heads' window, read back as codes, is laid out for the
kernel as exact grid values with scale 1 (the step's own K/V quantized here by vLLM's rule), so
the kernel reads the same values and multiplies by the layer's scale. Design:
docs/design/attention.md, "fp8 KV cache".
"""

from __future__ import annotations

import functools

import torch

FORMATS = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
           "fp8_e5m2": torch.float8_e5m2}


def is_fp8(kv_cache_dtype: str | None) -> bool:
    return (kv_cache_dtype or "auto") in FORMATS


def layer_scales(layer) -> tuple[float, float]:
    """The layer's K and V scales, as vLLM's CPU kernels read them (1.0 without fp8): the one
    place the plugin reads vLLM's private names for them."""
    return layer._k_scale_float, layer._v_scale_float


@functools.lru_cache(maxsize=None)
def _grid(fmt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(the format's finite non-negative values ascending, their uint8 codes)."""
    codes = torch.arange(128, dtype=torch.uint8)  # sign bit clear
    values = codes.view(fmt).float()
    finite = torch.isfinite(values)
    values, codes = values[finite], codes[finite]
    order = torch.argsort(values)
    return values[order], codes[order]


def quantize(x: torch.Tensor, scale: float, kv_cache_dtype: str) -> torch.Tensor:
    """uint8 codes of x / scale, rounded toward zero, saturating (vLLM's CPU rule)."""
    values, codes = _grid(FORMATS[kv_cache_dtype])
    a = (x.float() / scale).abs()
    # the largest grid value <= |x / scale| (clamped to the largest)
    index = (torch.searchsorted(values, a, right=True) - 1).clamp(min=0)
    code = codes[index]
    return torch.where(x.float() < 0, code | 0x80, code).to(torch.uint8)


def grid_values(codes: torch.Tensor, kv_cache_dtype: str, dtype: torch.dtype) -> torch.Tensor:
    """The codes as values of the format (no scale): written with scale 1 they give back the
    same codes (a negative zero comes back as +0, the same value)."""
    return codes.view(FORMATS[kv_cache_dtype]).to(dtype)
