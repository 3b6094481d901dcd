"""Background samplers of the server during a run: its /metrics (KV pool usage, preemptions,
queue) every second, and the resident memory of its whole process tree every 0.5 s.

Each sampler takes one sample before the load starts and one after it ends, so counter deltas
(preemptions) cover the whole run. A failing sample is skipped, never fatal: monitoring must
not abort a load test.
"""

from __future__ import annotations

import abc
import asyncio
import time
from typing import Any

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

# Sample name -> our key, and how samples of several engines combine.
VLLM_METRICS = {
    "vllm:kv_cache_usage_perc": ("kv_cache_usage", max),
    "vllm:gpu_cache_usage_perc": ("kv_cache_usage", max),  # name before vLLM 0.10
    "vllm:num_preemptions_total": ("preemptions", sum),
    "vllm:num_requests_running": ("running", sum),
    "vllm:num_requests_waiting": ("waiting", sum),
    "vllm:prefix_cache_queries_total": ("prefix_cache_queries", sum),  # tokens looked up
    "vllm:prefix_cache_hits_total": ("prefix_cache_hits", sum),  # tokens found cached
    # each finished request's first scheduling -> last token, summed (vLLM's histogram)
    "vllm:request_inference_time_seconds_sum": ("inference_seconds", sum),
    # ours (server/metrics.py): blocks the running requests hold, over KV-cache groups
    "vllm_kvevict_pool_blocks_used": ("kvevict_blocks_used", sum),
    "vllm_kvevict_pool_blocks": ("kvevict_pool_blocks", max),
    "vllm_kvevict_pool_usage_vllm": ("kvevict_vllm_usage", max),  # vLLM's, same step
}


def parse_vllm_metrics(text: str) -> dict[str, float]:
    """The vLLM scheduler metrics in a Prometheus text page; missing ones are left out."""
    values: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in VLLM_METRICS:
                values.setdefault(sample.name, []).append(float(sample.value))
    out: dict[str, float] = {}
    for name, vals in values.items():
        key, combine = VLLM_METRICS[name]
        out.setdefault(key, combine(vals))
    return out


class _Sampler(abc.ABC):
    """Calls `_sample()` every `interval` seconds between start() and stop() (subclasses:
    `MetricsSampler`, `RssSampler`)."""

    interval = 1.0

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None

    @abc.abstractmethod
    async def _sample(self) -> None:
        """Take one sample."""

    async def start(self, t0: float) -> None:
        self.t0 = t0
        await self._sample()
        self._task = asyncio.create_task(self._loop())

    async def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                await asyncio.wait_for(self._stop.wait(), self.interval)
            except TimeoutError:
                await self._sample()

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            await self._task
        await self._sample()


class MetricsSampler(_Sampler):
    """Scrapes {base_url}/metrics; `timeline` holds {t, kv_cache_usage, running, waiting,
    preemptions} rows, t in seconds after the run started."""

    def __init__(self, client: httpx.AsyncClient, base_url: str, interval: float = 1.0) -> None:
        super().__init__()
        self.client, self.url, self.interval = client, f"{base_url}/metrics", interval
        self.timeline: list[dict[str, float]] = []
        self.errors = 0

    async def _sample(self) -> None:
        try:
            resp = await self.client.get(self.url, timeout=5.0)
            resp.raise_for_status()
            row = parse_vllm_metrics(resp.text)
        except (httpx.HTTPError, ValueError):
            self.errors += 1
            return
        if row:
            self.timeline.append({"t": round(time.perf_counter() - self.t0, 3), **row})

    def summary(self) -> dict[str, Any]:
        usage = [r["kv_cache_usage"] for r in self.timeline if "kv_cache_usage" in r]
        preempt = [r["preemptions"] for r in self.timeline if "preemptions" in r]
        running = [r["running"] for r in self.timeline if "running" in r]
        queries, hits = ([r[k] for r in self.timeline if k in r]
                         for k in ("prefix_cache_queries", "prefix_cache_hits"))
        looked_up = queries[-1] - queries[0] if queries else 0
        busy = [(r["t"], r["inference_seconds"]) for r in self.timeline
                if "inference_seconds" in r]
        return {
            "running_peak": max(running) if running else None,
            "running_mean": sum(running) / len(running) if running else None,
            # requests scheduled at once, averaged over the run from vLLM's per-request
            # times (first scheduled -> last token), not from the gauge's 1 s samples
            "running_time_mean": (busy[-1][1] - busy[0][1]) / (busy[-1][0] - busy[0][0])
            if len(busy) > 1 and busy[-1][0] > busy[0][0] else None,
            # vLLM's own count over the run: prompt tokens found in the prefix cache / looked up
            "prefix_cache_hit_rate": (hits[-1] - hits[0]) / looked_up
            if hits and looked_up > 0 else None,
            "kv_cache_usage_peak": max(usage) if usage else None,
            "kv_cache_usage_mean": sum(usage) / len(usage) if usage else None,
            "preemptions": round(preempt[-1] - preempt[0]) if preempt else None,
            "scrapes": len(self.timeline),
            "scrape_errors": self.errors,
            "timeline": self.timeline,
        }


def tree_rss_bytes(pid: int) -> int:
    """Resident memory of a process and all its descendants (vLLM runs the engine in a child)."""
    root = psutil.Process(pid)
    total = root.memory_info().rss
    for child in root.children(recursive=True):
        try:
            total += child.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total


class RssSampler(_Sampler):
    """Samples tree_rss_bytes(pid); `timeline` holds {t, rss_bytes} rows."""

    def __init__(self, pid: int, interval: float = 0.5) -> None:
        super().__init__()
        self.pid, self.interval = pid, interval
        self.timeline: list[dict[str, float]] = []

    async def _sample(self) -> None:
        try:
            rss = tree_rss_bytes(self.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return
        self.timeline.append({"t": round(time.perf_counter() - self.t0, 3), "rss_bytes": rss})

    def summary(self) -> dict[str, Any]:
        values = [r["rss_bytes"] for r in self.timeline]
        return {"pid": self.pid, "peak_rss_bytes": max(values) if values else None,
                "timeline": self.timeline}
