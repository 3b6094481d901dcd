"""Token eviction (snapkv, pyramidkv): the engine core's physical-slot ledger and the worker's step plan and chunk booking (scoring and compaction run in backend.py from this plan)."""
