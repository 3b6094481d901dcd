"""Serving additions of vllm-kvevict in vLLM's API server: per-request `kv_stats` in OpenAI
responses, GET /v1/kv_stats, Prometheus series (see README.md here).

store.py (the stats store and aggregates), responses.py (JSON and SSE shaping, the middleware),
endpoints.py (routes and `install`), metrics.py (Prometheus). Installed on vLLM's app by
vllm_kvevict's API-server adapter through the entry-point group `vllm_kvevict.server`; nothing
here imports vLLM or vllm_kvevict."""
