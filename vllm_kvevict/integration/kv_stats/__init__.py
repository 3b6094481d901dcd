"""Per-request kv_stats (vLLM's KV connectors and stat loggers): the measuring KV connector, its
accounting and pool snapshots, the KV-transfer config that installs it, and the stat-logger
plugin that carries its stats to the API server.
"""
