"""One module per policy behind one interface (`base.KVPolicy`); `build_policy` picks one."""

from __future__ import annotations

import torch

from vllm_kvevict.config import HEAD_MASK_POLICIES, KVPolicyConfig
from vllm_kvevict.policies.base import ChunkKeep, KVPolicy
from vllm_kvevict.policies.full import FullPolicy
from vllm_kvevict.policies.head_mask import HeadMaskPolicy
from vllm_kvevict.policies.hybrid import HybridPolicy
from vllm_kvevict.policies.pyramidkv import PyramidKVPolicy
from vllm_kvevict.policies.snapkv import SnapKVPolicy
from vllm_kvevict.policies.streaming import StreamingPolicy

__all__ = ["ChunkKeep", "KVPolicy", "FullPolicy", "StreamingPolicy", "HeadMaskPolicy",
           "SnapKVPolicy", "PyramidKVPolicy", "HybridPolicy", "build_policy"]


def build_policy(config: KVPolicyConfig, num_layers: int, num_kv_heads: int,
                 full_heads: torch.Tensor | None = None, mask_source: str = "") -> KVPolicy:
    """The policy for a model shape. Head-mask policies need `full_heads` (bool [L, H],
    True = full head), already thresholded at the configured sparsity (see `masks`)."""
    args = dict(config=config, num_layers=num_layers, num_kv_heads=num_kv_heads)
    if config.policy == "full":
        return FullPolicy(**args)
    if config.policy == "streaming":
        return StreamingPolicy(**args)
    if config.policy in HEAD_MASK_POLICIES:
        cls = HybridPolicy if config.token_policy is not None else HeadMaskPolicy
        return cls(**args, full_heads=full_heads, mask_source=mask_source)
    if config.policy == "snapkv":
        return SnapKVPolicy(**args)
    if config.policy == "pyramidkv":
        return PyramidKVPolicy(**args)
    raise ValueError(f"no policy module for {config.policy!r}")
