"""`pyramidkv` (Cai et al. 2024): SnapKV's scoring with a per-layer budget that shrinks with depth.

Schedule as in PruLong's evaluation code: with chunk capacity B and window w inside the chunk,
m = B - w, lo = m // 20, hi = min(2m - lo, c - w); layer l selects hi - l * ((hi - lo) // (L - 1))
tokens besides the window, so the mean over layers stays near m.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_kvevict.policies.snapkv import SnapKVPolicy


@dataclass
class PyramidKVPolicy(SnapKVPolicy):
    def __post_init__(self) -> None:
        self.name = "pyramidkv"

    def layer_selection(self, layer: int, candidates: int, budget: int) -> int:
        lo = budget // 20
        hi = min(2 * budget - lo, candidates)
        step = (hi - lo) // (self.num_layers - 1) if self.num_layers > 1 else 0
        return max(hi - layer * step, 0)
