"""vLLM's engine core (`vllm/v1/core`): the Scheduler subclass, the admission rule its KV-cache
managers count by (built once by `kv_cache_manager.attach`), the token-eviction ledger of
physical slots.
"""
