"""Scheduler-side accounting behind kv_stats (engine-core process, scheduler thread only): one
`RequestRecord` per request fed from every engine step's block tables, the pool snapshots of
the live view, and the queue of finished requests' stats. Driven by the stats connector
(`stats_connector.py`); its payload type is in `connector_stats.py`.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from vllm_kvevict.integration.kv_cache.sink_window import canonical_chunk
from vllm_kvevict.integration.kv_stats.connector_stats import (PENDING_LIMIT, SNAPSHOT_INTERVAL_S,
                                                               KVEvictConnectorStats)
from vllm_kvevict.overrides import effective_config, request_prompt_len
from vllm_kvevict.served import ServedPolicy
from vllm_kvevict.stats import ByteLayout, RequestRecord, finite_or_none, footprint_function

logger = logging.getLogger("vllm.kvevict")  # under vLLM's logger: its handler and format


# -- scheduler-side accounting ------------------------------------------------------------------

def _group_name(group) -> str:
    spec = group.kv_cache_spec
    kind = type(getattr(spec, "first_spec", spec)).__name__.removesuffix("Spec")
    return f"{kind} x{len(group.layer_names)} layers"


def _dtype_bytes(dtype) -> int:
    return torch.tensor([], dtype=dtype).element_size()


def _group_bytes_per_block(kv_cache_config) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Real bytes one block of each KV-cache group reserves, and of those the bytes its layers'
    pages hold (the rest is the pool plan's padding: a group narrower than the widest).

    vLLM 0.32 lays all groups over one allocation (`get_kv_cache_config_from_groups`: every
    KVCacheTensor has size = bytes_per_block x num_blocks, groups alias from byte 0, and
    bytes_per_block is the largest group's), and block ids are global, so a block of any group
    ties up bytes_per_block of the pool. With one group that is the sum of the group's per-layer
    pages (UniformTypeKVCacheSpecs.page_size_bytes already sums them).
    """
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    groups = kv_cache_config.kv_cache_groups
    pages = []
    for group in groups:
        spec = group.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            pages.append(spec.page_size_bytes)
        else:
            pages.append(spec.page_size_bytes * len(group.layer_names))
    tensors = [t for t in kv_cache_config.kv_cache_tensors if not getattr(t, "host_resident", False)]
    num_blocks = kv_cache_config.num_blocks
    allocation = tensors[0].size // num_blocks if tensors and num_blocks else 0
    if allocation and any(t.size != tensors[0].size for t in tensors):
        allocation = 0  # not the aliasing layout this reasoning is about: use the pages
    if len(groups) == 1:
        if allocation and allocation != pages[0]:
            logger.info("vllm-kvevict: KV pool reserves %d bytes per block, the group's pages "
                        "sum to %d; reporting the reservation", allocation, pages[0])
        return (allocation or pages[0],), (pages[0],)
    return tuple(allocation or p for p in pages), tuple(pages)


class RequestStatsTracker:
    """Per-request records of one scheduler (engine-core process, scheduler thread only)."""

    def __init__(self, served: ServedPolicy, vllm_config, kv_cache_config) -> None:
        self._failed: set[str] = set()
        self.served = served
        self.cfg = served.config
        shape = served.shape
        # full attention as this server would hold it: every head a full head, in the full
        # heads' blocks (`--kv-full-block-size`, or the fast layout's 128, features.fast_layout)
        block_size = self.cfg.full_block_size or vllm_config.cache_config.block_size
        first = kv_cache_config.kv_cache_groups[0].kv_cache_spec if kv_cache_config else None
        spec = getattr(first, "first_spec", first)  # UniformTypeKVCacheSpecs -> a layer's spec
        kv_dtype = getattr(spec, "dtype", None) or vllm_config.model_config.dtype
        head_size = getattr(spec, "head_size", None) or shape.head_dim
        # Tensor parallel: every rank declares the same specs (kv_cache_specs.layer_heads), so a
        # block id ties up its bytes on each rank; with fewer KV heads than ranks stock vLLM
        # holds a replica per rank
        ranks = int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1) or 1)
        held_heads = max(shape.num_kv_heads, ranks) if ranks % shape.num_kv_heads == 0 \
            else shape.num_kv_heads
        full_bytes_per_block = (shape.num_layers * 2 * block_size * held_heads
                                * head_size * _dtype_bytes(kv_dtype))
        reserved, in_heads = _group_bytes_per_block(kv_cache_config)
        self.layout = ByteLayout(
            block_size=block_size, group_bytes_per_block=tuple(ranks * b for b in reserved),
            full_bytes_per_block=full_bytes_per_block, ranks=ranks,
            group_head_bytes_per_block=tuple(ranks * b for b in in_heads))
        # a head mask with prefix caching: the prompt is chunked at multiples of the budget
        self.canonical_chunk = canonical_chunk(vllm_config)
        # data parallel: which engine core (replica) serves the request. vLLM runs a dense
        # model's replicas as independent engines (their data_parallel_rank reset to 0); the
        # replica's index stays in data_parallel_index
        parallel = vllm_config.parallel_config
        self.data_parallel_rank = int(getattr(parallel, "data_parallel_index",
                                              getattr(parallel, "data_parallel_rank", 0)) or 0)
        self.records: dict[str, RequestRecord] = {}
        self._requests: dict[str, Any] = {}
        # per request and KV-cache group: its blocks as last seen, and their ids held
        self._seen: dict[str, list[tuple[list, set[int]] | None]] = {}
        self.num_blocks = getattr(kv_cache_config, "num_blocks", None)
        self.group_names = [_group_name(g) for g in kv_cache_config.kv_cache_groups] \
            if kv_cache_config else []
        self._snapshots: list[dict] = []
        self._finished: list[dict] = []
        self._last_snapshot = 0.0
        self._ended_since_snapshot = False
        self._pending_first_token: dict[int, tuple[Any, list[str]]] = {}
        # --kv-prefix-reuse across-questions: the token ledger's (chunks reused, of which
        # selected under another question) per request (`bind_rule`)
        self._reuse_of = None
        logger.info("vllm-kvevict: kv_stats on (policy %s): %s bytes per block per KV-cache group, "
                    "%d per block for full attention",
                    self.cfg.policy, list(self.layout.group_bytes_per_block),
                    full_bytes_per_block)

    def bind_rule(self, rule) -> None:
        """The scheduler's admission rule / token ledger, handed over by our scheduler once
        built; only the ledger reports prefix reuse."""
        self._reuse_of = getattr(rule, "reuse_of", None)

    def guard(self, fn, *args):
        try:
            return fn(*args)
        except Exception as exc:  # never take the engine down for a statistic
            name = getattr(fn, "__name__", "stats")
            if name not in self._failed:
                self._failed.add(name)
                logger.exception("vllm-kvevict: kv_stats %s failed (logged once): %s", name, exc)
            if name == "finish" and args:
                self._forget(args[0].request_id)
                return {"error": f"{type(exc).__name__}: {exc}"}
            return None

    # -- events ---------------------------------------------------------------------------------
    def add(self, request) -> None:
        params = getattr(request, "sampling_params", None)
        extra_args = getattr(params, "extra_args", None)
        _, overrides = effective_config(self.cfg, extra_args)
        # a teacher-forced tail is served (and counted) as decode tokens
        policy_prompt = request_prompt_len(request)
        self.records[request.request_id] = RequestRecord(
            request_id=request.request_id, prompt_len=policy_prompt,
            teacher_forced=request.num_prompt_tokens - policy_prompt,
            arrival_time=getattr(request, "arrival_time", None), layout=self.layout,
            overrides=overrides, canonical_chunk=self.canonical_chunk)
        self._requests[request.request_id] = request

    def on_schedule(self, scheduler_output, kv_cache_manager) -> None:
        now = time.time()
        managers = kv_cache_manager.coordinator.single_type_managers if kv_cache_manager else ()
        ended: list[str] = []
        new_blocks: dict[str, Any] = {}  # blocks allocated this step, per request and group
        for new in scheduler_output.scheduled_new_reqs:
            new_blocks[new.req_id] = new.block_ids
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, ids in zip(cached.req_ids, cached.new_block_ids):
            if ids is not None:
                new_blocks[req_id] = ids
        for req_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            record = self.records.get(req_id)
            request = self._requests.get(req_id)
            if record is None or request is None:
                continue
            held = self._held_ids(req_id, managers)
            if record.on_step(request.num_computed_tokens, scheduled, held, now,
                              getattr(request, "num_preemptions", 0), new_blocks.get(req_id)):
                ended.append(req_id)
        if self._ended_since_snapshot or now - self._last_snapshot >= SNAPSHOT_INTERVAL_S:
            self._snapshot(now, managers)
        if ended:
            self._pending_first_token[id(scheduler_output)] = (scheduler_output, ended)
            while len(self._pending_first_token) > 16:  # outputs that never came back
                self._pending_first_token.pop(next(iter(self._pending_first_token)))

    def _held_ids(self, req_id: str, managers) -> list[set[int]]:
        """Per KV-cache group, the ids of the blocks the request holds. A decode step mostly
        leaves a group's blocks as they were: the list compares equal to the last one seen (a
        C-level pass, identity first), and its set is reused rather than rebuilt."""
        seen = self._seen.get(req_id)
        if seen is None or len(seen) != len(managers):
            seen = self._seen[req_id] = [None] * len(managers)
        held = []
        for g, manager in enumerate(managers):
            # .get: req_to_blocks is a defaultdict; indexing would insert an entry.
            blocks = manager.req_to_blocks.get(req_id) or []
            last = seen[g]
            if last is None or last[0] != blocks:
                last = seen[g] = (list(blocks), {b.block_id for b in blocks if not b.is_null})
            held.append(last[1])
        return held

    def _snapshot(self, now: float, managers) -> None:
        """The pool now: distinct blocks held per KV-cache group (a prefix-cached block shared
        by several requests counts once, as in vLLM's usage), and each running request's bytes
        against full attention's at its last step."""
        self._last_snapshot, self._ended_since_snapshot = now, False
        used = []
        for manager in managers:
            ids = {b.block_id for blocks in manager.req_to_blocks.values() for b in blocks
                   if not b.is_null}
            used.append(len(ids))
        requests = {rid: [r.bytes_now, r.full_bytes_now] for rid, r in self.records.items()
                    if r.steps}
        # vLLM's own pool usage at this very step (what vllm:kv_cache_usage_perc reports), to
        # check the per-request accounting against it without pairing two reports in time
        vllm_usage = managers[0].block_pool.get_usage() if managers else None
        self._snapshots.append({
            "t": now, "blocks_used": used, "num_blocks": self.num_blocks,
            "vllm_usage": vllm_usage,
            "group_names": self.group_names,
            "bytes_per_block": list(self.layout.group_bytes_per_block),
            "block_size": self.layout.block_size, "requests": requests})
        del self._snapshots[:-PENDING_LIMIT]

    def take_connector_stats(self) -> KVEvictConnectorStats | None:
        if not (self._snapshots or self._finished):
            return None
        stats = KVEvictConnectorStats(data={"snapshots": self._snapshots,
                                            "finished": self._finished})
        self._snapshots, self._finished = [], []
        return stats

    def on_step_done(self, scheduler_output) -> None:
        entry = self._pending_first_token.pop(id(scheduler_output), None)
        if entry is None or entry[0] is not scheduler_output:
            return
        now = time.time()
        for req_id in entry[1]:
            record = self.records.get(req_id)
            if record is not None:
                record.on_first_token(now)

    def _forget(self, request_id: str):
        self._requests.pop(request_id, None)
        self._seen.pop(request_id, None)
        return self.records.pop(request_id, None)

    def finish(self, request) -> dict[str, Any] | None:
        record = self._forget(request.request_id)
        if record is None:
            return None
        policy = self.served.variant(record.overrides)
        stats = record.finish(completion_tokens=request.num_output_tokens, now=time.time(),
                              policy_name=self.cfg.policy,
                              params=self.served.params(record.overrides),
                              footprint_of=footprint_function(policy))
        reason = request.get_finished_reason()
        stats["finish_reason"] = str(reason) if reason is not None else None
        stats["stop_reason"] = getattr(request, "stop_reason", None)
        stats["data_parallel_rank"] = self.data_parallel_rank
        reuse = self._reuse_of(request.request_id) if self._reuse_of else None
        if reuse is not None:  # cached_tokens = the reused chunks' tokens
            stats["reused_chunks"], stats["reused_chunks_other_question"] = reuse
        stats = finite_or_none(stats)
        self._ended_since_snapshot = True
        # Every request's stats also go out with this step's scheduler stats. vLLM drops an
        # aborted request's kv_transfer_params (Scheduler.finish_requests), and the API server
        # drops the output of a request it already ended on a stop string, which the engine can
        # finish by length or EOS before the abort arrives: then this copy is the only one.
        # The API server keeps the first copy of each request it sees.
        self._finished.append(stats)
        del self._finished[:-PENDING_LIMIT]
        return stats
