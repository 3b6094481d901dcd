"""API-server process: a vLLM stat-logger plugin (entry-point group `vllm.stat_logger_plugins`)
that receives what our stats connector sends with vLLM's scheduler stats after each step (pool
snapshots for the live view, a copy of every finished request's kv_stats) and hands it to `server/`
through the API-server adapter, with vLLM's own running / waiting counts and KV-cache usage of
the same step. Data flows one way: stats connector -> SchedulerStats -> here -> server/.

vLLM turns its stats collection on when a stat-logger plugin is installed, even under
`--disable-log-stats` (then without its own loggers); that is what keeps kv_stats of aborted
requests and the live view working there too.
"""

from __future__ import annotations

import logging

from vllm.v1.metrics.loggers import StatLoggerBase

from vllm_kvevict.integration.entrypoints.api_server import engine_stats
from vllm_kvevict.integration.kv_stats.connector_stats import our_payload

logger = logging.getLogger("vllm.kvevict")


class KVEvictStatLogger(StatLoggerBase):
    def __init__(self, vllm_config, engine_index: int = 0) -> None:
        self.engine_index = engine_index

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None,
               engine_idx: int = 0) -> None:
        payload = our_payload(getattr(scheduler_stats, "kv_connector_stats", None))
        if payload is None:
            return
        try:
            engine_stats(payload, running=scheduler_stats.num_running_reqs,
                         waiting=scheduler_stats.num_waiting_reqs,
                         usage=scheduler_stats.kv_cache_usage, engine=engine_idx)
        except Exception:  # never break vLLM's output loop for a statistic
            logger.exception("vllm-kvevict: recording engine stats failed")

    def log_engine_initialized(self) -> None:
        pass
