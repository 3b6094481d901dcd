"""`full`: no eviction; must be bit-for-bit stock vLLM."""

from __future__ import annotations

from dataclasses import dataclass

from vllm_kvevict.policies.base import KVPolicy


@dataclass
class FullPolicy(KVPolicy):
    def __post_init__(self) -> None:
        self.name = "full"
