"""Which KV heads of each layer a worker holds are full and which streaming, by tensor-parallel
rank, and how they are indexed in the [tokens, heads, d] tensors attention gets (plain Python
and torch: `specs.py` declares specs from them, the attention paths run on them).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LayerHeads:
    """Which KV heads of one layer this worker holds are full / streaming (indices local to
    the worker's slice), their query heads (GQA groups), and how many heads the layer's paged
    cache declares (`paged_kv`: its full heads, padded under tensor parallel, below)."""

    layer: int
    num_kv_heads: int
    queries_per_kv: int
    full_kv: tuple[int, ...]
    streaming_kv: tuple[int, ...]
    paged_kv: int = -1  # -1: len(full_kv)
    pool_streaming_kv: int = -1  # heads of the pool's streaming companion (-1: streaming_kv's)

    @property
    def all_full(self) -> bool:
        return not self.streaming_kv

    @property
    def paged_heads(self) -> int:
        return len(self.full_kv) if self.paged_kv < 0 else self.paged_kv

    @property
    def companion_heads(self) -> int:
        """Heads the layer's streaming companion declares with pool storage (padded as
        `paged_kv` is; 0: no rank has a streaming head in this layer)."""
        return len(self.streaming_kv) if self.pool_streaming_kv < 0 else self.pool_streaming_kv

    def q_heads(self, kv_heads: tuple[int, ...]) -> list[int]:
        g = self.queries_per_kv
        return [h * g + i for h in kv_heads for i in range(g)]

    @functools.cached_property  # (built once: every layer reads them on every step)
    def full_q(self) -> torch.Tensor:
        return torch.tensor(self.q_heads(self.full_kv), dtype=torch.long)

    @functools.cached_property
    def streaming_q(self) -> torch.Tensor:
        return torch.tensor(self.q_heads(self.streaming_kv), dtype=torch.long)

    @functools.cached_property
    def full_kv_at(self) -> slice | torch.Tensor:
        """Index of the full KV heads in a [tokens, heads, d] tensor: a slice (a view, which
        vLLM's cache write takes) where they sit side by side, else an index tensor."""
        return _heads_index(self.full_kv)

    @functools.cached_property
    def streaming_kv_at(self) -> slice | torch.Tensor:
        return _heads_index(self.streaming_kv)

    @functools.cached_property
    def full_q_at(self) -> slice | torch.Tensor:
        return _heads_index(tuple(self.q_heads(self.full_kv)))

    @functools.cached_property
    def streaming_q_at(self) -> slice | torch.Tensor:
        return _heads_index(tuple(self.q_heads(self.streaming_kv)))


def _heads_index(heads: tuple[int, ...]) -> slice | torch.Tensor:
    if heads and heads == tuple(range(heads[0], heads[-1] + 1)):
        return slice(heads[0], heads[-1] + 1)
    return torch.tensor(heads, dtype=torch.long)


def layer_heads(streaming: torch.Tensor, queries_per_kv: int, rank: int = 0,
                world: int = 1) -> list[LayerHeads]:
    """Per-layer head split of tensor-parallel rank `rank` of `world` from a bool [L, H_kv]
    streaming mask over the model's KV heads. vLLM gives rank r the contiguous KV heads
    [r H/world, (r + 1) H/world) (`QKVParallelLinear`; world divides H, `features.py`); with
    world a multiple of H, KV head floor(r H/world), replicated, and a share of its queries.

    vLLM requires every rank to declare the same KV-cache spec per layer
    (`get_kv_cache_configs`), but a mask gives ranks different numbers of full heads in a
    layer: each rank declares the most any rank holds there (full heads, and the streaming
    heads' companion caches), and a rank with fewer leaves the padding heads unused."""
    num_kv = streaming.shape[1]
    if world > num_kv and world % num_kv == 0:  # replicated: one replica per rank
        replicas, num_kv = world // num_kv, world
        streaming = streaming.repeat_interleave(replicas, dim=1)
        queries_per_kv //= replicas  # (vLLM's ranks split the query heads evenly)
    if num_kv % world:
        raise ValueError(f"{world} tensor-parallel ranks do not divide {num_kv} KV heads")
    per_rank = num_kv // world
    slices = streaming.view(streaming.shape[0], world, per_rank)
    padded = (~slices).sum(dim=2).max(dim=1).values.tolist()
    padded_streaming = slices.sum(dim=2).max(dim=1).values.tolist()
    return [LayerHeads(layer=layer, num_kv_heads=per_rank, queries_per_kv=queries_per_kv,
                       full_kv=tuple(h for h, s in enumerate(row) if not s),
                       streaming_kv=tuple(h for h, s in enumerate(row) if s),
                       paged_kv=int(padded[layer]),
                       pool_streaming_kv=int(padded_streaming[layer]))
            for layer, row in enumerate(slices[:, rank].tolist())]
