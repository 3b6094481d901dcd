"""Serving additions of vllm-kvevict in vLLM's API server: per-request `kv_stats` in OpenAI
responses, GET /v1/kv_stats, Prometheus series (see README.md here)."""
