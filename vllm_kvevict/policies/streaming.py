"""`streaming` (StreamingLLM, Xiao et al. 2024, with chunk-level semantics as in PruLong).

Every KV head keeps the first `sink` tokens and the last `window` tokens. During a prefill chunk
[a, b) queries see the sink, the last `window` tokens before a, and the whole chunk causally;
after the chunk the cache is cut back to sink + window. A decode step sees sink + window + itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_kvevict.policies.base import KVPolicy


@dataclass
class StreamingPolicy(KVPolicy):
    def __post_init__(self) -> None:
        self.name = "streaming"

    def streaming_heads(self) -> torch.Tensor:
        return torch.ones(self.num_layers, self.num_kv_heads, dtype=torch.bool)
