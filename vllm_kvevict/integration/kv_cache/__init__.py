"""vLLM's KV cache (`vllm/v1/kv_cache_interface.py`, `vllm/v1/core/kv_cache_utils.py`): the specs
each layer declares, their grouping, the sink + window spec and manager of streaming heads, head
pages, token eviction's prefix cache.
"""
