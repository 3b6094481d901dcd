"""The KV connector that measures every request and hands `kv_stats` back with its output.

vLLM's KV-connector API (`--kv-transfer-config`) is the one sanctioned channel from the
scheduler to a request's OpenAI response: the dict a scheduler-side connector returns from
`request_finished` arrives verbatim as `kv_transfer_params`. This connector transfers nothing:
its worker side is no-ops, its scheduler side only reads (the accounting:
`request_stats.RequestStatsTracker`), and `get_kv_connector_stats` carries what no response
does (pool snapshots, aborted requests) to our stat-logger plugin. It declares `SupportsHMA`
(vLLM keeps the hybrid KV-cache manager) and role `kv_producer` (`kv_consumer` would defer
block frees under async scheduling). Nothing here may raise into the engine: a failure is
logged once and reported in the stats. Design: docs/design/kv_stats.md, docs/design.md.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                               KVConnectorMetadata,
                                                               KVConnectorRole, SupportsHMA)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from vllm_kvevict.integration.kv_stats.connector_stats import KVEvictConnectorStats, NoPromMetrics
from vllm_kvevict.integration.kv_stats.request_stats import RequestStatsTracker
from vllm_kvevict.served import served_policy
from vllm_kvevict.stats import STATS_KEY

logger = logging.getLogger("vllm.kvevict")  # under vLLM's logger: its handler and format


# -- the connector ------------------------------------------------------------------------------

@dataclass
class KVEvictStatsMetadata(KVConnectorMetadata):
    """Nothing travels to the workers."""


class KVEvictStatsConnector(KVConnectorBase_V1, SupportsHMA):

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self._manager = None  # the scheduler's KV-cache manager (`bind_kv_cache_manager`)
        self._stats: RequestStatsTracker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._stats = RequestStatsTracker(served_policy(vllm_config), vllm_config,
                                              kv_cache_config)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None):
        return KVEvictConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        # Our series come from server/metrics.py; but under a MultiConnector every child whose
        # stats travel must have an entry here, or vLLM's Prometheus logger asserts.
        return NoPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._stats is None:
            return None
        return self._stats.guard(self._stats.take_connector_stats)

    @property
    def requires_kv_delivery(self) -> bool:
        return False

    # -- worker side: no-ops -------------------------------------------------------------------
    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    # -- scheduler side ------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        return None

    def on_new_request(self, request) -> None:
        if self._stats is not None:
            self._stats.guard(self._stats.add, request)

    def bind_admission_rule(self, rule) -> None:
        """Our scheduler hands its admission rule / token ledger over once built."""
        if self._stats is not None:
            self._stats.bind_rule(rule)

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        """The scheduler hands its KV-cache manager over once built (for pool snapshots)."""
        super().bind_kv_cache_manager(kv_cache_manager)
        self._manager = kv_cache_manager

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        if self._stats is not None:
            self._stats.guard(self._stats.on_schedule, scheduler_output, self._manager)
        return KVEvictStatsMetadata()

    def on_step_output(self, scheduler_output) -> None:
        if self._stats is not None:
            self._stats.guard(self._stats.on_step_done, scheduler_output)

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request, block_ids) -> tuple[bool, dict | None]:
        if self._stats is None:
            return False, None
        stats = self._stats.guard(self._stats.finish, request)
        return False, ({STATS_KEY: stats} if stats is not None else None)


def ours_in(connector) -> "KVEvictStatsConnector | None":
    """Our connector: the scheduler's, or among a MultiConnector's children."""
    if isinstance(connector, KVEvictStatsConnector):
        return connector
    for child in getattr(connector, "sub_connectors", None) or ():
        if isinstance(child, KVEvictStatsConnector):
            return child
    return None


def on_rule_attached(scheduler, rule) -> None:
    """Our scheduler's `__init__`, its admission rule built (`StockAdmission` for `full`): to kv_stats."""
    connector = ours_in(getattr(scheduler, "connector", None))
    if connector is not None:
        connector.bind_admission_rule(rule)


def on_step_output(scheduler, scheduler_output) -> None:
    """Our scheduler's `update_from_output` (before vLLM's own): a step's output is back."""
    connector = ours_in(getattr(scheduler, "connector", None))
    if connector is not None:
        connector.on_step_output(scheduler_output)
