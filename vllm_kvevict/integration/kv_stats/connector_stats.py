"""The payload of our connector-stats channel: what the stats connector (engine core) hands
vLLM from `get_kv_connector_stats` after a step, and how the stat-logger plugin (API server)
finds it again in `SchedulerStats.kv_connector_stats` (a plain dict once it crossed processes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (KVConnectorPromMetrics,
                                                                  KVConnectorStats)

SNAPSHOT_INTERVAL_S = 0.25  # live view resolution; a snapshot costs one pass over held blocks
PENDING_LIMIT = 256  # snapshots / finished requests' stats kept while no one collects them


@dataclass
class KVEvictConnectorStats(KVConnectorStats):
    """`data = {"snapshots": [...], "finished": [...]}`, the payload vLLM carries from the
    scheduler to the API server's stat loggers (as a plain dict across processes)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "KVEvictConnectorStats":
        for key in ("snapshots", "finished"):
            self.data.setdefault(key, []).extend(other.data.get(key, ()))
        return self

    def reduce(self) -> dict[str, int]:
        last = (self.data.get("snapshots") or [{}])[-1]
        return {"kvevict_pool_blocks_used": sum(last.get("blocks_used", ())),
                "kvevict_finished_requests_reported": len(self.data.get("finished", ()))}

    def is_empty(self) -> bool:
        return not (self.data.get("snapshots") or self.data.get("finished"))


class NoPromMetrics(KVConnectorPromMetrics):
    """vLLM's Prometheus logger observes every connector's stats; ours become series in the
    API server (server/metrics.py), not here."""

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        return None


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


