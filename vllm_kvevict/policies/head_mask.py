"""`duo` and `prulong`: a learned binary mask per (layer, KV head), full or streaming.

DuoAttention (Xiao et al. 2025) and PruLong (Bhaskar et al. 2025, "Cache Me If You Can") differ
in how the mask is trained (see `vllm_kvevict.train`), not in how it is served: streaming heads
follow `streaming.py`'s semantics, full heads keep every KV. All query heads of a GQA group
follow their KV head. The mask arrives already thresholded at the configured head sparsity.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vllm_kvevict.policies.base import KVPolicy


@dataclass
class HeadMaskPolicy(KVPolicy):
    # Bool [num_layers, num_kv_heads], True = full (retrieval) head.
    full_heads: torch.Tensor = field(default=None)  # type: ignore[assignment]
    mask_source: str = ""

    def __post_init__(self) -> None:
        self.name = self.config.policy
        expected = (self.num_layers, self.num_kv_heads)
        if self.full_heads is None or tuple(self.full_heads.shape) != expected:
            got = None if self.full_heads is None else tuple(self.full_heads.shape)
            raise ValueError(f"head mask shape {got} does not match the model {expected}")
        self.full_heads = self.full_heads.to(torch.bool)

    def streaming_heads(self) -> torch.Tensor:
        return ~self.full_heads

    def describe(self) -> dict:
        out = super().describe()
        out["mask_source"] = self.mask_source
        out["streaming_head_share"] = float(self.streaming_heads().float().mean())
        return out
