"""`pyramidkv` (Cai et al. 2024): SnapKV's scoring with a per-layer budget that shrinks with depth.

Schedule as in PruLong's evaluation code (PyramidKV's `update_kv`): with chunk capacity B and
window w inside the chunk, m = B - w, lo = m // 20, hi = 2m - lo; if hi exceeds the c - w
candidates, hi = c - w and lo = 2m - hi, so the mean over layers stays m. Layer l selects
hi - l * ((hi - lo) // (L - 1)) tokens besides the window (never more than the candidates).
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
        hi = 2 * budget - lo
        if hi > candidates:
            hi = candidates
            lo = 2 * budget - hi
        step = (hi - lo) // (self.num_layers - 1) if self.num_layers > 1 else 0
        return min(max(hi - layer * step, 0), candidates)
