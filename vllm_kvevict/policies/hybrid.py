"""`duo` / `prulong` with `token_policy`: a head mask whose full heads also evict tokens.

The paper's conclusion: head-level and token-level eviction are complementary. Streaming heads
keep sink + window exactly as under `head_mask.py`; full heads keep, of each prefill chunk, what
the token policy (`snapkv.py`, `pyramidkv.py`) keeps at token sparsity `token_sparsity`, by
patched or naive chunked eviction, scored per full KV head over its own GQA group. The head
mask arrives thresholded at the head sparsity `sparsity`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vllm_kvevict.policies.base import ChunkKeep
from vllm_kvevict.policies.head_mask import HeadMaskPolicy
from vllm_kvevict.policies.pyramidkv import PyramidKVPolicy
from vllm_kvevict.policies.snapkv import SnapKVPolicy


@dataclass
class HybridPolicy(HeadMaskPolicy):
    token: SnapKVPolicy = field(init=False, default=None)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        super().__post_init__()
        # the token policy alone, at the token sparsity (its own config: no mask, no head part)
        cfg = self.config.replace(policy=self.config.token_policy, token_policy=None,
                                  sparsity=self.config.token_sparsity, mask_path=None)
        cls = PyramidKVPolicy if cfg.policy == "pyramidkv" else SnapKVPolicy
        self.token = cls(config=cfg, num_layers=self.num_layers, num_kv_heads=self.num_kv_heads)

    @property
    def evicts_tokens(self) -> bool:
        return True

    def chunk_keep(self, layer: int, chunk_len: int, is_final: bool) -> ChunkKeep:
        """What each full head of `layer` keeps of a chunk (streaming heads: sink + window)."""
        return self.token.chunk_keep(layer, chunk_len, is_final)

    def decode_budget(self, layer: int) -> int:
        """Decode-time eviction of the full heads (streaming heads: sink + window)."""
        return self.token.decode_budget(layer)

    def decode_keep(self, layer: int, length: int) -> ChunkKeep | None:
        return self.token.decode_keep(layer, length)

    def score(self, obs_queries: torch.Tensor, chunk_keys: torch.Tensor, obs_offset: int,
              window: int) -> torch.Tensor:
        return self.token.score(obs_queries, chunk_keys, obs_offset, window)

    select = staticmethod(SnapKVPolicy.select)
