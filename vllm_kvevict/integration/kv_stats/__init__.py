"""Per-request kv_stats (vLLM's KV connectors and stat loggers): the measuring KV connector, its
accounting and pool snapshots, and the KV-transfer config that installs it (the stat-logger
plugin that receives its stats in the API server is `entrypoints/stat_logger.py`).
"""
