"""kv_stats endpoints on vLLM's app, and `install`, which vllm_kvevict's API-server adapter
calls through the entry-point group `vllm_kvevict.server` (pyproject.toml) with a context that
says what this server serves.

- `GET /v1/kv_stats` (recent requests and aggregates) and `GET /v1/kv_stats/{request_id}`
  (a response id, e.g. `cmpl-...`/`chatcmpl-...`, or vLLM's per-prompt or engine id); both under
  /v1, so behind --api-key when it is set.
- Prometheus series (`metrics.py`) on vLLM's /metrics.
Documented in server/README.md.
"""

from __future__ import annotations

import os
import time

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse

from server.responses import KVStatsMiddleware
from server.store import Recorder, ServerStats


def make_router():
    from fastapi import APIRouter

    router = APIRouter()

    @router.get("/v1/kv_stats")
    async def kv_stats_summary(request: Request, limit: int = 20) -> JSONResponse:
        state = ServerStats.get()
        state.sync()
        info = state.info()
        state.rss.sample()
        limit = max(0, min(limit, state.store.capacity))
        return JSONResponse({
            "enabled": info["enabled"],
            "disabled_reason": info["reason"] or None,
            "policy": info["policy"],
            "params": info["params"],
            # which API server answered (several with --api-server-count: all answer the same)
            "api_server_pid": os.getpid(),
            "server_rss_bytes": state.rss.current,
            "server_peak_rss_bytes": state.rss.peak,
            "aggregates": state.store.aggregates(),
            # stop-string requests whose stats the engine still owes, and responses that went
            # out without them after VLLM_KVEVICT_STATS_WAIT_S (an engine that never reported)
            "stats_owed": len(state.pending),
            "stats_wait_timeouts": state.stats_wait_timeouts,
            "recent": state.store.recent(limit),
        })

    # Before /v1/kv_stats/{request_id}, which would take "timeline" as a request id.
    @router.get("/v1/kv_stats/timeline")
    async def kv_stats_timeline(since: float = 0.0) -> JSONResponse:
        state = ServerStats.get()
        state.sync()
        info = state.info()
        return JSONResponse({"now": time.time(), "policy": info["policy"],
                             "params": info["params"], **state.timeline_view(since)})

    @router.get("/kv")
    async def live_view() -> HTMLResponse:
        from server.live import page

        return HTMLResponse(page())

    @router.get("/v1/kv_stats/{request_id}")
    async def kv_stats_one(request_id: str) -> JSONResponse:
        state = ServerStats.get()
        state.sync()
        stats = state.store.get(request_id)
        if stats is None:
            return JSONResponse(status_code=404, content={"error": {
                "message": f"no kv_stats for request {request_id!r} (unknown, unfinished, or "
                           f"older than the last {ServerStats.get().store.capacity} requests)",
                "type": "NotFoundError", "param": "request_id", "code": 404}})
        return JSONResponse(stats)

    return router


def install(app, context):
    """Add the endpoints and the middleware to vLLM's FastAPI app (before it starts); return the
    function that records a finished request's stats. `context` (vllm_kvevict's
    `ServerContext`): policy, params, max_model_len, stats_enabled, stats_disabled_reason,
    shared_dir (several API servers: `server/shared.py`) and
    `check_vllm_xargs(xargs) -> error or None`."""
    from starlette.middleware import Middleware

    ServerStats.get().context = context
    if getattr(context, "shared_dir", None):  # one of several API servers
        ServerStats.get().use_shared(context.shared_dir)
    app.include_router(make_router())
    # Innermost (appended last): vLLM's authentication and CORS run before it.
    app.user_middleware.append(Middleware(KVStatsMiddleware))
    if app.middleware_stack is not None:
        # vLLM's SageMaker bootstrap (model_hosting_container_standards) builds the stack
        # inside build_app already; rebuild it as that bootstrap does, before serving starts.
        app.middleware_stack = app.build_middleware_stack()
    ServerStats.get().rss.start()
    return Recorder()
