"""Prometheus series of vllm-kvevict, served on vLLM's own /metrics (same registry).

- vllm_kvevict_footprint{policy}: histogram of the paper's KV footprint per finished request;
- vllm_kvevict_measured_footprint{policy}: histogram of real KV bytes x tokens / full attention's;
- vllm_kvevict_kv_bytes_saved_total{policy}: counter, sum over requests of
  full_kv_bytes_peak - kv_bytes_peak (requests whose policy held more than full attention add 0;
  their signed value is in kv_stats and in GET /v1/kv_stats);
- vllm_kvevict_blocks_freed_total{policy}: counter of KV blocks that eviction returned to vLLM's
  block pool while requests ran (counted per request by block id, preemption excluded);
- vllm_kvevict_requests_total{policy,finish_reason}: counter of requests that reported
  kv_stats, by how they ended (stop, length, abort, error);
- vllm_kvevict_pool_blocks_used{policy,group}, vllm_kvevict_pool_blocks{policy}: gauges of the
  KV pool at the last engine step: distinct blocks held per KV-cache group, and the pool's size;
- vllm_kvevict_pool_usage_vllm{policy}: vLLM's own pool usage at that same step (the value of
  vllm:kv_cache_usage_perc then), so the two accountings can be compared exactly.

Created lazily in the API-server process, in prometheus_client's default registry, which is the
one vLLM's /metrics serves (with PROMETHEUS_MULTIPROC_DIR set, prometheus_client writes them to
the multiprocess directory that vLLM's collector reads).
"""

from __future__ import annotations

import threading
from typing import Any, Mapping

FOOTPRINT_BUCKETS = (0.02, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9,
                     0.95, 0.99, 1.0)


class KVEvictMetrics:
    def __init__(self, registry=None) -> None:
        from prometheus_client import REGISTRY, Counter, Gauge, Histogram

        registry = registry if registry is not None else REGISTRY
        labels = ["policy"]
        self.footprint = Histogram(
            "vllm_kvevict_footprint", "KV footprint (paper's metric: un-evicted KV entries over "
            "all query positions / full causal attention's) per finished request.", labels,
            buckets=FOOTPRINT_BUCKETS, registry=registry)
        self.measured_footprint = Histogram(
            "vllm_kvevict_measured_footprint", "Real KV bytes held x tokens processed, over "
            "stock full attention's, per finished request.", labels,
            buckets=FOOTPRINT_BUCKETS, registry=registry)
        self.bytes_saved = Counter(
            "vllm_kvevict_kv_bytes_saved", "Peak KV bytes saved against stock full attention "
            "(full_kv_bytes_peak - kv_bytes_peak, >= 0), summed over requests.", labels,
            registry=registry)
        self.blocks_freed = Counter(
            "vllm_kvevict_blocks_freed", "KV-cache blocks returned to vLLM's block pool by "
            "eviction while requests ran.", labels, registry=registry)
        self.requests = Counter(
            "vllm_kvevict_requests", "Finished requests that reported kv_stats, by how they "
            "ended (stop, length, abort, error).", labels + ["finish_reason"],
            registry=registry)
        # Gauges of each engine core's last step (label `engine`, as vLLM's own series: the
        # data-parallel replica's index; 0 without data parallel).
        pool = labels + ["engine"]
        self.pool_blocks_used = Gauge(
            "vllm_kvevict_pool_blocks_used", "Blocks of vLLM's KV pool held by requests, per "
            "KV-cache group.", pool + ["group"], registry=registry,
            multiprocess_mode="mostrecent")
        self.pool_usage_vllm = Gauge(
            "vllm_kvevict_pool_usage_vllm", "vLLM's own KV pool usage (block_pool.get_usage, "
            "what vllm:kv_cache_usage_perc reports) at the step of vllm_kvevict_pool_blocks_used.",
            pool, registry=registry, multiprocess_mode="mostrecent")
        self.pool_blocks = Gauge(
            "vllm_kvevict_pool_blocks", "Blocks in vLLM's KV pool (shared by all KV-cache "
            "groups).", pool, registry=registry, multiprocess_mode="mostrecent")

    def observe(self, stats: Mapping[str, Any]) -> None:
        policy = str(stats.get("policy") or "unknown")
        self.requests.labels(policy, str(stats.get("finish_reason") or "unknown")).inc()
        if isinstance(stats.get("footprint"), (int, float)):
            self.footprint.labels(policy).observe(stats["footprint"])
        if isinstance(stats.get("measured_footprint"), (int, float)):
            self.measured_footprint.labels(policy).observe(stats["measured_footprint"])
        saved = stats.get("kv_bytes_saved")
        self.bytes_saved.labels(policy).inc(max(saved, 0) if isinstance(saved, int) else 0)
        freed = stats.get("blocks_freed")
        self.blocks_freed.labels(policy).inc(max(freed, 0) if isinstance(freed, int) else 0)

    def observe_pool(self, policy: str, snapshot: Mapping[str, Any], engine: int = 0) -> None:
        engine = str(engine)
        for group, used in enumerate(snapshot.get("blocks_used") or ()):
            self.pool_blocks_used.labels(policy, engine, str(group)).set(used)
        if isinstance(snapshot.get("vllm_usage"), float):
            self.pool_usage_vllm.labels(policy, engine).set(snapshot["vllm_usage"])
        if isinstance(snapshot.get("num_blocks"), int):
            self.pool_blocks.labels(policy, engine).set(snapshot["num_blocks"])


_metrics: KVEvictMetrics | None = None
_lock = threading.Lock()


def get_metrics() -> KVEvictMetrics:
    global _metrics
    with _lock:
        if _metrics is None:
            _metrics = KVEvictMetrics()
        return _metrics
