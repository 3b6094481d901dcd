"""The one interface every KV policy implements.

A policy answers two questions, and only these, for the vLLM glue, the reference oracle and the
footprint: which KV heads stream (sink + local window), and how many of a prefill chunk's KVs a
layer keeps. No vLLM import and no attention code here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vllm_kvevict.config import KVPolicyConfig


@dataclass(frozen=True)
class ChunkKeep:
    """What a layer keeps of one prefill chunk of `chunk_len` tokens (token-eviction policies).

    `window` trailing tokens of the chunk are always kept (the observation window); `selected`
    more are chosen by score among the other `chunk_len - window` tokens.
    """

    chunk_len: int
    window: int
    selected: int

    @property
    def kept(self) -> int:
        return self.window + self.selected


@dataclass
class KVPolicy:
    """Base: keeps everything (the `full` policy)."""

    config: KVPolicyConfig
    num_layers: int
    num_kv_heads: int
    name: str = field(init=False, default="full")

    # -- head masks ----------------------------------------------------------------------
    def streaming_heads(self) -> torch.Tensor:
        """Bool [num_layers, num_kv_heads]: True where the KV head is a streaming head."""
        return torch.zeros(self.num_layers, self.num_kv_heads, dtype=torch.bool)

    @property
    def has_streaming_heads(self) -> bool:
        return bool(self.streaming_heads().any())

    # -- token eviction ------------------------------------------------------------------
    @property
    def evicts_tokens(self) -> bool:
        return False

    def chunk_keep(self, layer: int, chunk_len: int, is_final: bool) -> ChunkKeep:
        return ChunkKeep(chunk_len=chunk_len, window=0, selected=chunk_len)

    def decode_keep(self, layer: int, length: int) -> ChunkKeep | None:
        """Decode-time eviction: what a layer holding `length` tokens keeps (None: all)."""
        return None

    def describe(self) -> dict:
        """Policy and parameters as reported per request."""
        return {"policy": self.name, **self.config.to_dict()}
