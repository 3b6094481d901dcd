"""API-server process: the one adapter between vLLM's OpenAI server and `server/`.

`server/` (endpoints, response shaping, Prometheus) imports nothing from vLLM or from us: it is
found through the entry-point group `vllm_kvevict.server` and installed on vLLM's FastAPI app
with a `ServerContext` (what it needs to know, fixed at start-up). Its installer returns the
function that records a finished request's kv_stats, which the output-processor hook below
calls. Data flows one way: engine core (stats connector) -> kv_transfer_params -> here ->
server/ -> the response.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, Callable

from vllm_kvevict.overrides import check_vllm_xargs
from vllm_kvevict.stats import STATS_KEY

logger = logging.getLogger("vllm.kvevict")  # under vLLM's logger: its handler and format

ENTRY_POINT_GROUP = "vllm_kvevict.server"

Recorder = Callable[[str, str, dict], None]  # (engine id, response id, kv_transfer_params)


@dataclass(frozen=True)
class ServerContext:
    """What server/ is told at install time."""

    policy: str = "full"
    params: dict = field(default_factory=dict)  # ServedPolicy.describe(): everything served
    max_model_len: int | None = None
    stats_enabled: bool = False
    stats_disabled_reason: str = "server not initialised"
    stats_key: str = STATS_KEY

    def check_vllm_xargs(self, xargs: Any) -> str | None:
        """Why a request's `vllm_xargs` is refused (HTTP 400), or None."""
        return check_vllm_xargs(xargs, self.policy, self.max_model_len)


_vllm_config = None  # the engine config this process created (create_engine_config)
_recorders: list[Recorder] = []


def remember_config(vllm_config) -> None:
    global _vllm_config
    _vllm_config = vllm_config


def server_context(model_config=None) -> ServerContext:
    from vllm_kvevict.integration.kv_transfer import stats_status
    from vllm_kvevict.served import served_policy, serving

    if _vllm_config is None:
        return ServerContext()
    served = served_policy(_vllm_config)
    enabled, reason = stats_status(_vllm_config)
    model_config = model_config or _vllm_config.model_config
    return ServerContext(policy=served.config.policy, params=serving(served, _vllm_config),
                         max_model_len=getattr(model_config, "max_model_len", None),
                         stats_enabled=enabled, stats_disabled_reason=reason)


def build_app(stock_build_app, *args, **kwargs):
    """`entry.build_app`: vLLM's app, then every installed server/ extension on it."""
    app = stock_build_app(*args, **kwargs)
    model_config = args[2] if len(args) > 2 else kwargs.get("model_config")
    context = server_context(model_config)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            recorder = ep.load()(app, context)
        except Exception:
            logger.exception("vllm-kvevict: server extension %s failed to install", ep.name)
            continue
        if recorder is not None:
            _recorders.append(recorder)
    return app


def make_request_output(state, stock_make_request_output, *args, **kwargs):
    """`RequestState.make_request_output`: vLLM passes (new_token_ids, pooling_output,
    finish_reason, stop_reason, kv_transfer_params, ...); only a finished request carries
    kv_transfer_params. The recorders complete the dict in place before the response is
    built, so the response body carries the same numbers as the server's store."""
    params = kwargs.get("kv_transfer_params", args[4] if len(args) > 4 else None)
    if isinstance(params, dict) and STATS_KEY in params:
        for record in _recorders:
            try:
                record(state.request_id, state.external_req_id, params)
            except Exception:
                logger.exception("vllm-kvevict: recording kv_stats failed")
    return stock_make_request_output(state, *args, **kwargs)
