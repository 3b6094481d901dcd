"""vLLM's entry points (`vllm/entrypoints`, API-server process): our CLI flags, start-up validation
against the model, the adapter that puts kv_stats into OpenAI responses, and the stat-logger
plugin that receives the stats connector's stats.
"""
