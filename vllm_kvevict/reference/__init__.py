"""The reference oracle: every policy in plain PyTorch over a transformers causal decoder
(Llama, Llama 3, Mistral, Qwen2, Qwen3; see `runner.py`).

The vLLM path is tested against it (token-identical greedy outputs) and the mask trainer reuses
its streaming attention. It shares no attention code with the vLLM path: the policy objects are
asked only which heads stream and how many tokens a layer keeps per chunk.

- `attention.py`: the explicit per-layer KV cache, the visibility rules, masked attention;
- `eviction.py`: chunk scoring by observation queries, pooling, top-k selection;
- `runner.py`: the chunk loop and greedy generation (`ReferenceRunner`).
"""

from vllm_kvevict.reference.attention import (EMPTY, KVCache, LayerKV, attend,
                                              chunked_streaming_visibility, streaming_cut,
                                              visibility)
from vllm_kvevict.reference.eviction import average_pool, observation_scores, select_kept
from vllm_kvevict.reference.runner import (PrefillResult, ReferenceOutput, ReferenceRunner, Step,
                                           chunk_boundaries)

__all__ = ["EMPTY", "KVCache", "LayerKV", "attend", "chunked_streaming_visibility",
           "streaming_cut", "visibility", "average_pool", "observation_scores", "select_kept",
           "PrefillResult", "ReferenceOutput", "ReferenceRunner", "Step", "chunk_boundaries"]
