"""Head masks that free memory: vLLM's paged cache holds only the full heads of each layer.

A vLLM block spans every KV head of a layer, so a streaming head kept in the paged cache would
hold the whole sequence. Instead each layer's KV-cache spec says `num_kv_heads = its full
heads` (vLLM then allocates, schedules and frees paged KV for full heads only) and streaming
heads live in `StreamingStore` (sink + window per request). A layer with no full head has no
paged KV at all: it is declared as sharing the cache of a layer that has one (vLLM's own
cross-layer sharing), which gives it attention metadata without allocating anything.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LayerHeads:
    """Which KV heads of one layer are full / streaming, and their query heads (GQA groups)."""

    layer: int
    num_kv_heads: int
    queries_per_kv: int
    full_kv: tuple[int, ...]
    streaming_kv: tuple[int, ...]

    @property
    def all_full(self) -> bool:
        return not self.streaming_kv

    def q_heads(self, kv_heads: tuple[int, ...]) -> list[int]:
        g = self.queries_per_kv
        return [h * g + i for h in kv_heads for i in range(g)]

    @property
    def full_q(self) -> torch.Tensor:
        return torch.tensor(self.q_heads(self.full_kv), dtype=torch.long)

    @property
    def streaming_q(self) -> torch.Tensor:
        return torch.tensor(self.q_heads(self.streaming_kv), dtype=torch.long)


def layer_heads(streaming: torch.Tensor, queries_per_kv: int) -> list[LayerHeads]:
    """Per-layer head split from a bool [L, H_kv] streaming mask."""
    out = []
    for layer, row in enumerate(streaming.tolist()):
        out.append(LayerHeads(
            layer=layer, num_kv_heads=len(row), queries_per_kv=queries_per_kv,
            full_kv=tuple(h for h, s in enumerate(row) if not s),
            streaming_kv=tuple(h for h, s in enumerate(row) if s)))
    return out


def paged_spec(spec, heads: LayerHeads):
    """The layer's stock spec with only its full heads (None if it has none)."""
    if not heads.full_kv:
        return None
    return dataclasses.replace(spec, num_kv_heads=len(heads.full_kv))
