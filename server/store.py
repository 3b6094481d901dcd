"""kv_stats in the API-server process: the store of finished requests' stats, the running
aggregates, the server's memory, and the one process-wide state (`ServerStats`) that the
responses and endpoints read.

The numbers come from the engine core: vLLM carries each finished request's stats as
`kv_transfer_params = {"kv_stats": {...}}` to this process, where the API-server adapter of
vllm_kvevict hands them to `record_engine_output` (adding the server's peak RSS) before the
response is written. Nothing here imports vLLM or vllm_kvevict: what the server serves arrives
at install time (`endpoints.install`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import threading
import time
from collections import OrderedDict, deque
from typing import Any

from server.shared import OWED_LIMIT, SharedLog

logger = logging.getLogger("vllm.kvevict")  # under vLLM's logger: its handler and format

STATS_KEY = "kv_stats"  # the response field (and kv_transfer_params key) of our stats
DEFAULT_CAPACITY = int(os.environ.get("VLLM_KVEVICT_STATS_CAPACITY", "1000"))


# -- the server's memory ------------------------------------------------------------------------

class ProcessTreeRSS:
    """Resident memory of a process and all its descendants (API server, engine core, workers),
    sampled by a daemon thread and at every finished request; `peak` is the largest sum seen."""

    def __init__(self, pid: int | None = None, interval_s: float = 0.5) -> None:
        self.pid = pid or os.getpid()
        self.interval_s = interval_s
        self.current = 0
        self.peak = 0
        self._thread: threading.Thread | None = None

    def sample(self) -> int:
        import psutil

        try:
            root = psutil.Process(self.pid)
            procs = [root] + root.children(recursive=True)
        except psutil.Error:
            return self.current
        total = 0
        for proc in procs:
            try:
                total += proc.memory_info().rss
            except psutil.Error:
                pass
        self.current = total
        self.peak = max(self.peak, total)
        return total

    def start(self) -> None:
        if self._thread is not None:
            return

        def loop() -> None:
            while True:
                self.sample()
                time.sleep(self.interval_s)

        self._thread = threading.Thread(target=loop, name="kvevict-rss", daemon=True)
        self._thread.start()


# -- store and aggregates -----------------------------------------------------------------------

_MEANS = ("footprint", "measured_footprint", "peak_kv", "ttft_s", "prefill_tokens_per_s",
          "decode_tokens_per_s")
_SUMS = ("kv_bytes_saved", "kv_bytes_peak", "full_kv_bytes_peak", "kv_bytes_integral",
         "full_kv_bytes_integral", "blocks_freed", "prompt_tokens", "completion_tokens")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class _Aggregate:
    def __init__(self) -> None:
        self.requests = 0
        self.errors = 0
        self.sums = {k: 0 for k in _SUMS}
        self.mean_sums = {k: 0.0 for k in _MEANS}
        self.mean_counts = {k: 0 for k in _MEANS}

    def add(self, stats: dict[str, Any]) -> None:
        self.requests += 1
        if "error" in stats:
            self.errors += 1
        for key in _SUMS:
            if _number(stats.get(key)):
                self.sums[key] += stats[key]
        for key in _MEANS:
            if _number(stats.get(key)):
                self.mean_sums[key] += stats[key]
                self.mean_counts[key] += 1

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"requests": self.requests}
        for key in _MEANS:
            n = self.mean_counts[key]
            out[f"mean_{key}"] = self.mean_sums[key] / n if n else None
        out.update(self.sums)
        full = self.sums["full_kv_bytes_integral"]
        # Pooled over requests: all real KV byte-tokens / all full-attention byte-tokens.
        out["measured_footprint_pooled"] = self.sums["kv_bytes_integral"] / full if full else None
        out["errors"] = self.errors
        return out


class KVStatsStore:
    """Recent per-request kv_stats (bounded) and running aggregates over all requests."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = max(1, capacity)
        self._lock = threading.Lock()
        self._by_engine: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._by_external: dict[str, list[str]] = {}
        self._total = _Aggregate()
        self._per_policy: dict[str, _Aggregate] = {}
        self._per_reason: dict[str, _Aggregate] = {}

    def record(self, stats: dict[str, Any], external_id: str | None = None) -> bool:
        """Keep one request's stats; False (and nothing counted) if that engine request was
        already recorded."""
        engine_id = str(stats.get("engine_request_id") or external_id or id(stats))
        policy = str(stats.get("policy") or "unknown")
        reason = str(stats.get("finish_reason") or "unknown")
        with self._lock:
            if engine_id in self._by_engine:
                return False
            self._total.add(stats)
            self._per_policy.setdefault(policy, _Aggregate()).add(stats)
            self._per_reason.setdefault(reason, _Aggregate()).add(stats)
            self._by_engine[engine_id] = stats
            if external_id:
                self._by_external.setdefault(external_id, []).append(engine_id)
            while len(self._by_engine) > self.capacity:
                self._forget(next(iter(self._by_engine)))
        return True

    def has(self, engine_id: str) -> bool:
        with self._lock:
            return engine_id in self._by_engine

    def _forget(self, engine_id: str) -> None:
        stats = self._by_engine.pop(engine_id)
        external = stats.get("request_id")
        ids = self._by_external.get(external)
        if ids is not None:
            if engine_id in ids:
                ids.remove(engine_id)
            if not ids:
                del self._by_external[external]

    def _external(self, external_id: str) -> list[dict[str, Any]]:
        return [self._by_engine[e] for e in self._by_external.get(external_id, ())
                if e in self._by_engine]

    def for_response(self, response_id: str) -> list[dict[str, Any]]:
        """kv_stats of every engine request behind one OpenAI response id. vLLM names them
        `<id>` (one chat prompt), `<id>-<i>` (completions, prompt i) or `<id>_<i>` (several chat
        prompts); n > 1 puts several engine requests under one of those."""
        with self._lock:
            found = self._external(response_id)
            for sep in ("-", "_"):
                i, misses = 0, 0
                while misses < 16:  # tolerate prompts already dropped from the store
                    key = f"{response_id}{sep}{i}"
                    if key in self._by_external:
                        found.extend(self._external(key))
                        misses = 0
                    else:
                        misses += 1
                    i += 1
            return found

    def get(self, request_id: str) -> dict[str, Any] | None:
        with self._lock:
            if request_id in self._by_engine:
                return self._by_engine[request_id]
        found = self.for_response(request_id)
        return found[0] if found else None

    def recent(self, limit: int) -> list[dict[str, Any]]:
        with self._lock:
            items = list(self._by_engine.values())
        return items[-limit:][::-1] if limit > 0 else []

    def aggregates(self) -> dict[str, Any]:
        with self._lock:
            out = self._total.to_dict()
            out["requests_per_policy"] = {p: a.requests for p, a in self._per_policy.items()}
            out["per_policy"] = {p: a.to_dict() for p, a in self._per_policy.items()}
            out["requests_per_finish_reason"] = {r: a.requests
                                                 for r, a in self._per_reason.items()}
            out["per_finish_reason"] = {r: a.to_dict() for r, a in self._per_reason.items()}
            return out

# -- engine request ids --------------------------------------------------------------------------

_SIBLING = re.compile(r"^(\d+)_(.+)$")
_SUFFIX = re.compile(r"-[0-9a-f]{8}$")


def sibling_index(engine_id: str) -> int:
    """vLLM names the n samples of one prompt `<i>_<parent engine id>`; others are sample 0."""
    m = _SIBLING.match(engine_id)
    return int(m.group(1)) if m else 0


def external_of(engine_id: str) -> str:
    """The API id of an engine request id: vLLM appends `-<8 hex>` to the API id (and puts
    `<i>_` before it for the n samples of one prompt). For requests that ended without an
    output naming them (client cancel)."""
    m = _SIBLING.match(engine_id)
    return _SUFFIX.sub("", m.group(2) if m else engine_id)


# -- the live view's timeline ---------------------------------------------------------------------

class Timeline:
    """Pool snapshots and per-request KV bytes over time, from the engine's connector stats
    (`GET /v1/kv_stats/timeline`, the `/kv` page). Bounded: `max_samples` pool samples, the last
    `max_requests` requests, at most `max_points` points each (older points thinned)."""

    def __init__(self, max_samples: int = 2400, max_requests: int = 48,
                 max_points: int = 600) -> None:
        self.max_requests, self.max_points = max_requests, max_points
        self._lock = threading.Lock()
        self.samples: deque[dict[str, Any]] = deque(maxlen=max_samples)
        self.pool: dict[str, Any] = {"num_blocks": None, "group_names": [],
                                     "bytes_per_block": [], "block_size": None}
        self.traces: OrderedDict[str, dict[str, Any]] = OrderedDict()

    def add(self, snapshot: dict[str, Any], running: int, waiting: int,
            usage: float | None) -> None:
        t = float(snapshot["t"])
        with self._lock:
            self.pool = {k: snapshot.get(k) for k in self.pool}
            self.samples.append({"t": t, "blocks_used": list(snapshot.get("blocks_used", ())),
                                 "running": running, "waiting": waiting, "usage": usage})
            live = snapshot.get("requests") or {}
            for engine_id, (held, full) in live.items():
                trace = self.traces.get(engine_id)
                if trace is None:
                    trace = self.traces[engine_id] = {
                        "request_id": external_of(engine_id), "engine_request_id": engine_id,
                        "index": sibling_index(engine_id), "first_t": t, "finished": False,
                        "finish_reason": None, "points": []}
                points = trace["points"]
                points.append([t, held, full])
                if len(points) > self.max_points:  # thin the older half
                    half = len(points) // 2
                    points[:half] = points[:half:2]
            for engine_id, trace in self.traces.items():
                if engine_id not in live:
                    trace["finished"] = True
            while len(self.traces) > self.max_requests:
                self.traces.popitem(last=False)

    def finished(self, engine_id: str, reason: str | None) -> None:
        with self._lock:
            trace = self.traces.get(engine_id)
            if trace is not None:
                trace["finished"], trace["finish_reason"] = True, reason

    def view(self, since: float = 0.0) -> dict[str, Any]:
        with self._lock:
            return {
                "pool": dict(self.pool),
                "samples": [s for s in self.samples if s["t"] > since],
                "requests": [{**tr, "points": [p for p in tr["points"] if p[0] > since]}
                             for tr in self.traces.values()],
            }


# -- the process-wide state ---------------------------------------------------------------------

class ServerStats:
    _instance: "ServerStats | None" = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.store = KVStatsStore()
        # one timeline per engine core (data parallel: one per replica, by its index)
        self.timelines: dict[int, Timeline] = {0: Timeline()}
        # several API servers: the log they all append to and replay (`use_shared`)
        self.shared: SharedLog | None = None
        self._sync_lock = threading.Lock()
        self.rss = ProcessTreeRSS()
        # engine id -> (API id, finish reason, stop reason) of requests that finished in the
        # API server without kv_stats (stop strings): their stats come later, in the engine's
        # connector stats.
        self.pending: OrderedDict[str, tuple[str, str, Any]] = OrderedDict()
        self.context = None  # what the server serves (set by endpoints.install)
        self._metrics = None
        self._recorded: asyncio.Event | None = None  # set at the next recorded request
        self._loop: asyncio.AbstractEventLoop | None = None
        self.stats_wait_timeouts = 0  # responses sent without stats the engine still owed

    @property
    def timeline(self) -> Timeline:
        """Engine 0's (the only one without data parallel)."""
        return self.timelines[0]

    def timeline_of(self, engine: int) -> Timeline:
        with self._lock:
            return self.timelines.setdefault(int(engine), Timeline())

    def timeline_view(self, since: float) -> dict[str, Any]:
        """Engine 0's timeline at the top (the live page reads it), and with data parallel
        every engine's under `engines`, by index."""
        view = self.timeline.view(since)
        if len(self.timelines) > 1:
            view["engines"] = {str(i): t.view(since) for i, t in sorted(self.timelines.items())}
        return view

    @classmethod
    def get(cls) -> "ServerStats":
        with cls._lock:
            if cls._instance is None:
                cls._instance = ServerStats()
            return cls._instance

    @property
    def metrics(self):
        if self._metrics is None:
            from server.metrics import get_metrics

            self._metrics = get_metrics()
        return self._metrics

    async def next_recorded(self) -> None:
        """Returns when the next request's stats are recorded (from any source)."""
        if self._recorded is None:
            self._loop, self._recorded = asyncio.get_running_loop(), asyncio.Event()
        await self._recorded.wait()

    def notify_recorded(self) -> None:
        event, loop = self._recorded, self._loop
        if event is None:
            return
        self._recorded = None  # later waiters wait for the request after this one
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            event.set()
        else:  # recorded off the event loop's thread
            loop.call_soon_threadsafe(event.set)

    def use_shared(self, directory: str) -> None:
        """This process is one of several API servers (`server/shared.py`). Its memory is
        the launcher's tree then: API servers and engine cores are the launcher's children."""
        self.shared = SharedLog(directory)
        self.rss = ProcessTreeRSS(os.getppid())

    def keep(self, stats: dict[str, Any]) -> bool:
        """A finished request's full record into this process's store and timeline; False if
        it was there already."""
        engine_id = stats["engine_request_id"]
        if not self.store.record(stats, stats["request_id"]):
            return False
        self.pending.pop(engine_id, None)
        self.timeline_of(engine_index(stats)).finished(engine_id, stats.get("finish_reason"))
        return True

    def sync(self) -> None:
        """Several API servers: replay what the others appended to the shared log."""
        if self.shared is None:
            return
        with self._sync_lock:
            replayed = False
            for engine, event in self.shared.new_events():
                if event["kind"] == "snapshot":
                    self.timeline_of(engine).add(event["snapshot"], event["running"],
                                                 event["waiting"], event["usage"])
                else:
                    replayed = self.keep(event["stats"]) or replayed
        if replayed:
            self.notify_recorded()

    def owes_stats(self, response_id: str) -> bool:
        """A request of this response ended in the API server and its stats are on the way."""
        return any(external == response_id or external.startswith((response_id + "-",
                                                                   response_id + "_"))
                   for external, _, _ in list(self.pending.values()))

    def info(self) -> dict[str, Any]:
        """Policy, context length and whether kv_stats are on."""
        c = self.context
        if c is None:
            return {"policy": "full", "params": {}, "max_model_len": None, "enabled": False,
                    "reason": "server not initialised"}
        return {"policy": c.policy, "params": dict(c.params), "max_model_len": c.max_model_len,
                "enabled": c.stats_enabled, "reason": c.stats_disabled_reason}


def engine_index(stats: dict[str, Any]) -> int:
    """The data-parallel engine a finished request ran on (0 without data parallelism)."""
    rank = stats.get("data_parallel_rank")
    return rank if isinstance(rank, int) else 0


def _record(engine_id: str, external_id: str, stats: dict[str, Any]) -> dict[str, Any]:
    state = ServerStats.get()
    state.rss.sample()
    full = {"request_id": external_id, **stats, "engine_request_id": engine_id,
            "index": sibling_index(engine_id), "server_peak_rss_bytes": state.rss.peak}
    pending = state.pending.get(engine_id)
    if state.shared is not None:  # the API server that ended it may be another one
        pending = state.shared.settle(engine_id) or pending
    if pending is not None:  # an API server ended it (stop string): its reason wins
        full["request_id"], full["finish_reason"], full["stop_reason"] = pending
    if state.shared is None:
        first = state.keep(full)
    else:  # first writer wins; the replay puts it in this process's store
        first = state.shared.append_finished(engine_id, engine_index(full), full)
        state.sync()
    if first:
        try:
            state.metrics.observe(full)
        except Exception:  # metrics must never break a response
            logger.exception("vllm-kvevict: Prometheus update failed")
    state.notify_recorded()
    return full


def record_engine_output(engine_id: str, external_id: str,
                         kv_transfer_params: dict[str, Any]) -> None:
    """A finished request's kv_transfer_params arrived from the engine core (called by the
    output-processor hook, in the event loop, before the response is built). Completes the
    dict in place, so the response body carries the same numbers as the store."""
    stats = kv_transfer_params.get(STATS_KEY)
    if isinstance(stats, dict):
        kv_transfer_params[STATS_KEY] = _record(engine_id, external_id, stats)


def record_output_finished(engine_id: str, external_id: str, finish_reason: str,
                           stop_reason: Any) -> None:
    """A request ended in the API server with no kv_stats yet (a stop string)."""
    state = ServerStats.get()
    state.pending[engine_id] = (external_id, finish_reason, stop_reason)
    while len(state.pending) > OWED_LIMIT:
        state.pending.popitem(last=False)
    if state.shared is not None:  # its stats may reach another API server
        state.shared.owe(engine_id, external_id, finish_reason, stop_reason)


def record_engine_stats(payload: dict[str, Any], running: int, waiting: int,
                        usage: float | None, engine: int = 0) -> None:
    """One engine step's connector payload: pool snapshots and a copy of every finished
    request's kv_stats (recorded here when no output carried them: aborts, stop strings).
    `engine`: which engine core sent it (data parallel: the replica's index)."""
    state = ServerStats.get()
    snapshots = payload.get("snapshots") or ()
    for snapshot in snapshots:
        if state.shared is None:
            state.timeline_of(engine).add(snapshot, running, waiting, usage)
        else:
            state.shared.append_snapshot(engine, snapshot, running, waiting, usage)
    state.sync()
    for stats in payload.get("finished") or ():
        engine_id = str(stats.get("engine_request_id"))
        if state.store.has(engine_id):  # its output carried them already
            continue
        pending = state.pending.get(engine_id)
        _record(engine_id, pending[0] if pending else external_of(engine_id), stats)
    if snapshots:
        try:
            policy = state.context.policy if state.context is not None else "unknown"
            state.metrics.observe_pool(policy, snapshots[-1], engine)
        except Exception:
            logger.exception("vllm-kvevict: Prometheus update failed")


class Recorder:
    """What `endpoints.install` returns to vllm_kvevict's API-server adapter."""

    finished = staticmethod(record_engine_output)
    output_finished = staticmethod(record_output_finished)
    engine_stats = staticmethod(record_engine_stats)
