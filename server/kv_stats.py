"""`kv_stats` in the OpenAI API: store, aggregates, endpoints and the response middleware.

Runs in the API-server process (`vllm serve`); wired by `vllm_kvevict.integration.plugin.
_install_stats`. The numbers come from the engine core: our KV connector
(`vllm_kvevict/integration/connector.py`) returns them from `request_finished`, vLLM carries them
as `kv_transfer_params = {"kv_stats": {...}}` to this process, and a hook on vLLM's output
processor hands each finished request's dict to `record_engine_output` here (adding the
server's peak RSS), before the response is written. Then:

- `KVStatsMiddleware` (innermost ASGI middleware, so vLLM's --api-key check runs first):
  * validates `vllm_xargs` of POST /v1/completions and /v1/chat/completions (HTTP 400 with the
    valid keys and ranges, before the request reaches the engine);
  * non-streaming 200 JSON responses: moves `kv_transfer_params.kv_stats` to a top-level
    `kv_stats` field (`kv_transfer_params` becomes null when that was all it held);
  * streamed responses: vLLM does not carry kv_transfer_params in streams, so just before
    `data: [DONE]` it sends one more chunk, `{"id", "object", "created", "model",
    "choices": [], "kv_stats": {...}}`.
- `GET /v1/kv_stats` (recent requests and aggregates) and `GET /v1/kv_stats/{request_id}`
  (a response id, e.g. `cmpl-...`/`chatcmpl-...`, or vLLM's per-prompt or engine id); both under
  /v1, so behind --api-key when it is set.
- Prometheus series (`server/metrics.py`).

Documented in server/README.md.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import OrderedDict
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from vllm_kvevict.integration.request_stats import STATS_KEY, check_vllm_xargs

logger = logging.getLogger("vllm_kvevict")

GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions")
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

    def record(self, stats: dict[str, Any], external_id: str | None = None) -> None:
        engine_id = str(stats.get("engine_request_id") or external_id or id(stats))
        policy = str(stats.get("policy") or "unknown")
        with self._lock:
            self._total.add(stats)
            self._per_policy.setdefault(policy, _Aggregate()).add(stats)
            if engine_id in self._by_engine:
                self._forget(engine_id)
            self._by_engine[engine_id] = stats
            if external_id:
                self._by_external.setdefault(external_id, []).append(engine_id)
            while len(self._by_engine) > self.capacity:
                self._forget(next(iter(self._by_engine)))

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
            return out


# -- the process-wide state ---------------------------------------------------------------------

class ServerStats:
    _instance: "ServerStats | None" = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.store = KVStatsStore()
        self.rss = ProcessTreeRSS()
        self._metrics = None

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


def record_engine_output(engine_id: str, external_id: str,
                         kv_transfer_params: dict[str, Any]) -> None:
    """A finished request's kv_transfer_params arrived from the engine core (called by the
    output-processor hook, in the event loop, before the response is built). Completes the
    dict in place, so the response body carries the same numbers as the store."""
    stats = kv_transfer_params.get(STATS_KEY)
    if not isinstance(stats, dict):
        return
    state = ServerStats.get()
    state.rss.sample()
    full = {"request_id": external_id, **stats, "engine_request_id": engine_id,
            "server_peak_rss_bytes": state.rss.peak}
    kv_transfer_params[STATS_KEY] = full
    state.store.record(full, external_id)
    try:
        state.metrics.observe(full)
    except Exception:  # metrics must never break a response
        logger.exception("vllm-kvevict: Prometheus update failed")


# -- response shaping (pure functions; unit-tested) ---------------------------------------------

def lift_kv_stats(payload: dict[str, Any], found: list[dict[str, Any]]) -> dict[str, Any]:
    """A non-streaming completion/chat body with `kv_stats` at top level: the store's entries
    for this response if any (several for n > 1 or several prompts: all in
    `kv_stats_per_request`), else what the body carried in kv_transfer_params, else null."""
    params = payload.get("kv_transfer_params")
    carried = None
    if isinstance(params, dict) and STATS_KEY in params:
        params = dict(params)
        carried = params.pop(STATS_KEY)
        payload["kv_transfer_params"] = params or None
    payload[STATS_KEY] = found[0] if found else carried
    if len(found) > 1:
        payload["kv_stats_per_request"] = found
    return payload


def stats_chunk(first_chunk: dict[str, Any] | None, response_id: str | None,
                stats: dict[str, Any] | None) -> bytes:
    """The extra last SSE chunk of a streamed response."""
    first = first_chunk or {}
    chunk = {"id": response_id or first.get("id"), "object": first.get("object"),
             "created": first.get("created"), "model": first.get("model"), "choices": [],
             STATS_KEY: stats}
    return (b"data: " + json.dumps(chunk, ensure_ascii=False, separators=(",", ":")).encode()
            + b"\n\n")


class SSERewriter:
    """Passes an SSE byte stream through event by event and inserts the kv_stats chunk before
    `data: [DONE]` (`lookup(response_id)` gives the stats at that moment)."""

    def __init__(self, lookup) -> None:
        self.lookup = lookup
        self.buffer = b""
        self.first: dict[str, Any] | None = None
        self.injected = False

    def feed(self, data: bytes, final: bool = False) -> bytes:
        self.buffer += data
        out = []
        while True:
            cut = self.buffer.find(b"\n\n")
            if cut < 0:
                break
            event, self.buffer = self.buffer[:cut + 2], self.buffer[cut + 2:]
            out.append(self._event(event))
        if final and self.buffer:
            out.append(self.buffer)
            self.buffer = b""
        return b"".join(out)

    def _event(self, event: bytes) -> bytes:
        text = event.strip()
        if not text.startswith(b"data:"):
            return event
        data = text[len(b"data:"):].strip()
        if data == b"[DONE]":
            if self.injected:
                return event
            self.injected = True
            rid = (self.first or {}).get("id")
            return stats_chunk(self.first, rid, self.lookup(rid) if rid else None) + event
        if self.first is None:
            try:
                chunk = json.loads(data)
            except ValueError:
                return event
            if isinstance(chunk, dict) and "id" in chunk:
                self.first = chunk
        return event


# -- ASGI middleware ----------------------------------------------------------------------------

def _error_body(message: str, param: str = "vllm_xargs") -> bytes:
    return json.dumps({"error": {"message": message, "type": "BadRequestError", "param": param,
                                 "code": 400}}).encode()


def _server_info(app) -> dict[str, Any]:
    """Policy, context length and whether kv_stats are on (from app.state.vllm_config)."""
    info = getattr(app.state, "_kvevict_info", None) if app is not None else None
    if info is not None:
        return info
    vllm_config = getattr(getattr(app, "state", None), "vllm_config", None)
    if vllm_config is None:
        return {"policy": "full", "max_model_len": None, "enabled": False,
                "reason": "server not initialised"}
    from vllm_kvevict.integration.connector import stats_status
    from vllm_kvevict.integration.validation import policy_config_of

    enabled, reason = stats_status(vllm_config)
    info = {"policy": policy_config_of(vllm_config).policy,
            "max_model_len": getattr(vllm_config.model_config, "max_model_len", None),
            "enabled": enabled, "reason": reason}
    app.state._kvevict_info = info
    return info


class KVStatsMiddleware:
    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            return await self.app(scope, receive, send)
        path = scope["path"].removeprefix(scope.get("root_path", "") or "")
        if path not in GENERATE_PATHS:
            return await self.app(scope, receive, send)

        chunks, disconnected = [], False
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                disconnected = True
                break
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        body = b"".join(chunks)
        info = _server_info(scope.get("app"))
        error = None
        try:
            payload = json.loads(body) if body else None
        except ValueError:
            payload = None  # vLLM answers malformed JSON itself
        if isinstance(payload, dict):
            error = check_vllm_xargs(payload.get("vllm_xargs"), info["policy"],
                                     info["max_model_len"])
        if error:
            content = _error_body(error)
            await send({"type": "http.response.start", "status": 400,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(content)).encode())]})
            await send({"type": "http.response.body", "body": content})
            return

        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                if disconnected:
                    return {"type": "http.disconnect"}
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        if not info["enabled"]:
            return await self.app(scope, replay, send)
        await self.app(scope, replay, _ResponseShaper(send).send)


class _ResponseShaper:
    def __init__(self, send) -> None:
        self._send = send
        self.mode = "pass"
        self.start: dict | None = None
        self.parts: list[bytes] = []
        self.sse: SSERewriter | None = None

    async def send(self, message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            headers = {k.lower(): v for k, v in message.get("headers", [])}
            ctype = headers.get(b"content-type", b"").decode("latin-1")
            if message.get("status") == 200 and ctype.startswith("application/json"):
                self.mode, self.start = "json", message
                return
            if message.get("status") == 200 and ctype.startswith("text/event-stream"):
                self.mode = "sse"
                self.sse = SSERewriter(_lookup_first)
            return await self._send(message)
        if kind != "http.response.body" or self.mode == "pass":
            return await self._send(message)
        more = message.get("more_body", False)
        if self.mode == "sse":
            data = self.sse.feed(message.get("body", b""), final=not more)
            if data or not more:
                await self._send({"type": "http.response.body", "body": data, "more_body": more})
            return
        self.parts.append(message.get("body", b""))
        if more:
            return
        body = b"".join(self.parts)
        try:
            payload = json.loads(body)
            if isinstance(payload, dict) and "choices" in payload:
                rid = payload.get("id")
                found = ServerStats.get().store.for_response(rid) if rid else []
                body = json.dumps(lift_kv_stats(payload, found), ensure_ascii=False,
                                  separators=(",", ":")).encode()
        except Exception:
            logger.exception("vllm-kvevict: could not attach kv_stats to a response")
        headers = [(k, v) for k, v in self.start.get("headers", [])
                   if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        await self._send({**self.start, "headers": headers})
        await self._send({"type": "http.response.body", "body": body, "more_body": False})


def _lookup_first(response_id: str) -> dict[str, Any] | None:
    found = ServerStats.get().store.for_response(response_id)
    return found[0] if found else None


# -- endpoints ----------------------------------------------------------------------------------

def make_router():
    from fastapi import APIRouter

    router = APIRouter()

    @router.get("/v1/kv_stats")
    async def kv_stats_summary(request: Request, limit: int = 20) -> JSONResponse:
        state = ServerStats.get()
        info = _server_info(request.app)
        state.rss.sample()
        limit = max(0, min(limit, state.store.capacity))
        return JSONResponse({
            "enabled": info["enabled"],
            "disabled_reason": info["reason"] or None,
            "policy": info["policy"],
            "server_rss_bytes": state.rss.current,
            "server_peak_rss_bytes": state.rss.peak,
            "aggregates": state.store.aggregates(),
            "recent": state.store.recent(limit),
        })

    @router.get("/v1/kv_stats/{request_id}")
    async def kv_stats_one(request_id: str) -> JSONResponse:
        stats = ServerStats.get().store.get(request_id)
        if stats is None:
            return JSONResponse(status_code=404, content={"error": {
                "message": f"no kv_stats for request {request_id!r} (unknown, unfinished, or "
                           f"older than the last {ServerStats.get().store.capacity} requests)",
                "type": "NotFoundError", "param": "request_id", "code": 404}})
        return JSONResponse(stats)

    return router


def install_app(app) -> None:
    """Add the endpoints and the middleware to vLLM's FastAPI app (before it starts)."""
    from starlette.middleware import Middleware

    app.include_router(make_router())
    # Innermost (appended last): vLLM's authentication and CORS run before it.
    app.user_middleware.append(Middleware(KVStatsMiddleware))
    if app.middleware_stack is not None:
        # vLLM's SageMaker bootstrap (model_hosting_container_standards) builds the stack
        # inside build_app already; rebuild it as that bootstrap does, before serving starts.
        app.middleware_stack = app.build_middleware_stack()
    ServerStats.get().rss.start()

