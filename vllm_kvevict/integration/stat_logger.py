"""API-server process: a vLLM stat-logger plugin (entry-point group `vllm.stat_logger_plugins`)
that receives what our stats connector sends with vLLM's scheduler stats after each step (pool
snapshots for the live view, the kv_stats of aborted requests) and hands it to `server/`
through the API-server adapter, with vLLM's own running / waiting counts and KV-cache usage of
the same step. Data flows one way: stats connector -> SchedulerStats -> here -> server/.

vLLM turns its stats collection on when a stat-logger plugin is installed, even under
`--disable-log-stats` (then without its own loggers); that is what keeps kv_stats of aborted
requests and the live view working there too.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.v1.metrics.loggers import StatLoggerBase

logger = logging.getLogger("vllm.kvevict")

CONNECTOR_NAME = "KVEvictStatsConnector"  # MultiConnector keys its children's stats by class name


def our_payload(kv_connector_stats: Any) -> dict | None:
    """Our connector's dict in `SchedulerStats.kv_connector_stats`: alone, or under our class
    name when a MultiConnector runs ours beside a user's connector."""
    if not isinstance(kv_connector_stats, dict):
        return None
    if "snapshots" in kv_connector_stats or "finished" in kv_connector_stats:
        return kv_connector_stats
    nested = kv_connector_stats.get(CONNECTOR_NAME)
    return nested if isinstance(nested, dict) else None


class KVEvictStatLogger(StatLoggerBase):
    def __init__(self, vllm_config, engine_index: int = 0) -> None:
        self.engine_index = engine_index

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None,
               engine_idx: int = 0) -> None:
        payload = our_payload(getattr(scheduler_stats, "kv_connector_stats", None))
        if payload is None:
            return
        from vllm_kvevict.integration.api_server import engine_stats

        try:
            engine_stats(payload, running=scheduler_stats.num_running_reqs,
                         waiting=scheduler_stats.num_waiting_reqs,
                         usage=scheduler_stats.kv_cache_usage)
        except Exception:  # never break vLLM's output loop for a statistic
            logger.exception("vllm-kvevict: recording engine stats failed")

    def log_engine_initialized(self) -> None:
        pass
