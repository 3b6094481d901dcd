"""API-server process: the one adapter between vLLM's OpenAI server and `server/`.

`server/` (endpoints, response shaping, Prometheus) imports nothing from vLLM or from us: it is
found through the entry-point group `vllm_kvevict.server` and installed on vLLM's FastAPI app
with a `ServerContext` (what it needs to know, fixed at start-up). Its installer returns its
recorder (`finished`, `output_finished`, `engine_stats`), which the output-processor hook below
and the stat-logger plugin (`stat_logger.py`) call. Data flows one way: engine core (stats
connector) -> kv_transfer_params / scheduler stats -> here -> server/ -> the response.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, Protocol

from vllm_kvevict.integration.kv_stats.kv_transfer import stats_status
from vllm_kvevict.overrides import check_vllm_xargs
from vllm_kvevict.served import served_policy, serving
from vllm_kvevict.stats import STATS_KEY

logger = logging.getLogger("vllm.kvevict")  # under vLLM's logger: its handler and format

ENTRY_POINT_GROUP = "vllm_kvevict.server"
# several API servers: the directory of the log they share (server/shared.py), made by the
# launcher and inherited by the API-server processes it starts
SHARED_DIR_ENV = "VLLM_KVEVICT_SHARED_DIR"
SHARED_BY_ENV = "VLLM_KVEVICT_SHARED_BY"  # the launcher's pid: an inherited stale one is ignored


class Recorder(Protocol):
    """What a server/ extension's installer returns."""

    def finished(self, engine_id: str, external_id: str, kv_transfer_params: dict) -> None:
        """A finished request's output carries its kv_stats."""

    def output_finished(self, engine_id: str, external_id: str, finish_reason: str,
                        stop_reason: Any) -> None:
        """A request finished in the API server without kv_stats (a stop string: the
        engine reports the request as aborted, later, through `engine_stats`)."""

    def engine_stats(self, payload: dict, running: int, waiting: int,
                     usage: float | None, engine: int = 0) -> None:
        """Our connector's payload of one engine step (pool snapshots, aborted requests'
        kv_stats) with vLLM's running / waiting counts and KV-cache usage; `engine`: the
        engine core's index (data parallel)."""


@dataclass(frozen=True)
class ServerContext:
    """What server/ is told at install time."""

    policy: str = "full"
    params: dict = field(default_factory=dict)  # ServedPolicy.describe(): everything served
    max_model_len: int | None = None
    obs_window_max: int | None = None  # KVPolicyConfig.max_obs_window
    stats_enabled: bool = False
    stats_disabled_reason: str = "server not initialised"
    stats_key: str = STATS_KEY
    shared_dir: str | None = None  # one of several API servers: their shared log's directory

    def check_vllm_xargs(self, xargs: Any) -> str | None:
        """Why a request's `vllm_xargs` is refused (HTTP 400), or None."""
        return check_vllm_xargs(xargs, self.policy, self.max_model_len, self.obs_window_max,
                                self.params.get("decode_budget") is not None)


_vllm_config = None  # the engine config this process created (create_engine_config)
_recorders: list[Recorder] = []


def remember_config(vllm_config) -> None:
    global _vllm_config
    _vllm_config = vllm_config


def server_context(model_config=None) -> ServerContext:
    if _vllm_config is None:
        return ServerContext()
    served = served_policy(_vllm_config)
    enabled, reason = stats_status(_vllm_config)
    model_config = model_config or _vllm_config.model_config
    return ServerContext(policy=served.config.policy, params=serving(served, _vllm_config),
                         max_model_len=getattr(model_config, "max_model_len", None),
                         obs_window_max=served.config.max_obs_window,
                         stats_enabled=enabled, stats_disabled_reason=reason,
                         shared_dir=shared_dir())


def shared_dir() -> str | None:
    """The shared log's directory when this process is one of several API servers: made by
    this process's launcher (its parent), not one inherited from an unrelated `vllm serve`."""
    if os.environ.get(SHARED_BY_ENV) != str(os.getppid()):
        return None
    return os.environ.get(SHARED_DIR_ENV) or None


def share_between_api_servers(count: int | None) -> None:
    """In `vllm serve`'s launcher, before it starts `count` API servers: the directory of
    their shared kv_stats log (removed when the launcher exits)."""
    # (an API server's own from_cli_args: its launcher, the parent, made it already)
    if (count or 1) <= 1 or os.environ.get(SHARED_BY_ENV) in (str(os.getpid()),
                                                               str(os.getppid())):
        return
    directory = tempfile.mkdtemp(prefix="vllm-kvevict-")
    os.environ[SHARED_DIR_ENV], os.environ[SHARED_BY_ENV] = directory, str(os.getpid())
    atexit.register(shutil.rmtree, directory, ignore_errors=True)


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


def _arg(args, kwargs, index: int, name: str):
    return kwargs[name] if name in kwargs else (args[index] if len(args) > index else None)


def make_request_output(state, stock_make_request_output, *args, **kwargs):
    """`RequestState.make_request_output`: vLLM passes (new_token_ids, pooling_output,
    finish_reason, stop_reason, kv_transfer_params, ...); only a request the engine finished
    carries kv_transfer_params. The recorders complete the dict in place before the response
    is built, so the response body carries the same numbers as the server's store."""
    finish_reason = _arg(args, kwargs, 2, "finish_reason")
    if finish_reason is not None and _recorders:
        params = _arg(args, kwargs, 4, "kv_transfer_params")
        for recorder in _recorders:
            try:
                if isinstance(params, dict) and STATS_KEY in params:
                    recorder.finished(state.request_id, state.external_req_id, params)
                else:
                    recorder.output_finished(state.request_id, state.external_req_id,
                                             str(finish_reason), _arg(args, kwargs, 3,
                                                                      "stop_reason"))
            except Exception:
                logger.exception("vllm-kvevict: recording kv_stats failed")
    return stock_make_request_output(state, *args, **kwargs)


def engine_stats(payload: dict, running: int, waiting: int, usage: float | None,
                 engine: int = 0) -> None:
    """From the stat-logger plugin: our connector's payload of one engine core's step."""
    for recorder in _recorders:
        recorder.engine_stats(payload, running, waiting, usage, engine)
