"""kv_stats in OpenAI responses: the ASGI middleware that validates `vllm_xargs` and shapes
response bodies, and its pure helpers (unit-tested).

`KVStatsMiddleware` (innermost ASGI middleware, so vLLM's --api-key check runs first):
- validates `vllm_xargs` of POST /v1/completions and /v1/chat/completions (HTTP 400 with the
  valid keys and ranges, before the request reaches the engine);
- non-streaming 200 JSON responses: moves `kv_transfer_params.kv_stats` to a top-level
  `kv_stats` field (`kv_transfer_params` becomes null when that was all it held);
- streamed responses: vLLM does not carry kv_transfer_params in streams. With
  `stream_options.include_usage` the final usage chunk (`choices: []`) gets `kv_stats` (and
  `kv_stats_per_request` for n > 1 or several prompts); without it one more chunk of that shape
  goes just before `data: [DONE]` (none where vLLM streamed no chunk at all).
- a request ended by a stop string reaches the engine as an abort, and its stats arrive with a
  later engine step: the response waits for them (`settled`: until they are recorded, however
  loaded the engine is).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from typing import Any

from server.lifecycle import WATCH
from server.store import STATS_KEY, ServerStats

logger = logging.getLogger("vllm.kvevict")  # under vLLM's logger: its handler and format

GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions")
# A stop-string request's stats come with the engine step that handles its abort: a step
# later when idle, many seconds later on a loaded engine. The response waits for them, not for
# a time; this bound only ends a wait for an engine that will never report (it is logged).
STATS_WAIT_S = float(os.environ.get("VLLM_KVEVICT_STATS_WAIT_S", "600"))
SHARED_POLL_S = 0.05


async def settled(response_id: str | None) -> None:
    """Wait until no request of this response still owes its stats (stop strings)."""
    state = ServerStats.get()
    state.sync()
    if not response_id or not state.owes_stats(response_id):
        return
    deadline = time.monotonic() + STATS_WAIT_S
    while state.owes_stats(response_id):
        if WATCH.engine_gone:  # e.g. a request vLLM refused while draining: never scheduled
            return
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            state.stats_wait_timeouts += 1
            logger.warning("vllm-kvevict: response %s sent without the kv_stats the engine "
                           "still owes after %.0f s (VLLM_KVEVICT_STATS_WAIT_S)", response_id,
                           STATS_WAIT_S)
            return
        try:
            # re-check (sooner once a shutdown is under way: the engine may stop meanwhile)
            # (with several API servers another may record them: look at the log often)
            await asyncio.wait_for(state.next_recorded(), min(
                remaining, SHARED_POLL_S if state.shared is not None else
                1.0 if WATCH.stop_requested else 5.0))
        except asyncio.TimeoutError:
            pass
        state.sync()


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
    return with_stats(payload, found or ([carried] if carried is not None else []))


def with_stats(chunk: dict[str, Any], found: list[dict[str, Any]]) -> dict[str, Any]:
    """`kv_stats` (the first request's) and, for several, `kv_stats_per_request`."""
    chunk[STATS_KEY] = found[0] if found else None
    if len(found) > 1:
        chunk["kv_stats_per_request"] = found
    return chunk


def _sse(chunk: dict[str, Any]) -> bytes:
    return (b"data: " + json.dumps(chunk, ensure_ascii=False, separators=(",", ":")).encode()
            + b"\n\n")


def stats_chunk(first_chunk: dict[str, Any] | None, response_id: str | None,
                found: list[dict[str, Any]]) -> bytes:
    """The extra last SSE chunk of a streamed response without a usage chunk."""
    first = first_chunk or {}
    chunk = {"id": response_id or first.get("id"), "object": first.get("object"),
             "created": first.get("created"), "model": first.get("model"), "choices": []}
    return _sse(with_stats(chunk, found))


def is_usage_chunk(chunk: Any) -> bool:
    """vLLM's final chunk under `stream_options.include_usage`."""
    return (isinstance(chunk, dict) and chunk.get("choices") == []
            and isinstance(chunk.get("usage"), dict))


class SSERewriter:
    """Passes an SSE byte stream through event by event; puts the kv_stats into the final
    usage chunk, or into one more chunk before `data: [DONE]` (`lookup(response_id)` gives
    the response's stats, a list, at that moment)."""

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
            # (no chunk before it: vLLM streamed nothing, as for a request refused while
            # draining; a chunk of ours would name no response)
            if self.injected or self.first is None:
                return event
            self.injected = True
            rid = self.first.get("id")
            return stats_chunk(self.first, rid, self.lookup(rid) if rid else []) + event
        if self.first is None or (b'"usage"' in data and b'"choices":[]' in data):
            try:
                chunk = json.loads(data)
            except ValueError:
                return event
            if self.first is None and isinstance(chunk, dict) and "id" in chunk:
                self.first = chunk
            if is_usage_chunk(chunk) and not self.injected:
                self.injected = True
                rid = chunk.get("id")
                return _sse(with_stats(chunk, self.lookup(rid) if rid else []))
        return event

    def response_id(self) -> str | None:
        return (self.first or {}).get("id")


# -- ASGI middleware ----------------------------------------------------------------------------

def _error_body(message: str, param: str = "vllm_xargs") -> bytes:
    return json.dumps({"error": {"message": message, "type": "BadRequestError", "param": param,
                                 "code": 400}}).encode()


def shape_error(path: str, payload: dict[str, Any]) -> str | None:
    """What vLLM 0.32 refuses without naming the field: a chat whose `messages` is not a list
    ("'NoneType' object is not iterable"). Everything else is vLLM's to judge."""
    messages = payload.get("messages", [])
    if path == "/v1/chat/completions" and not isinstance(messages, list):
        kind = "null" if messages is None else type(messages).__name__
        return (f"`messages` must be a list of message objects ({{\"role\": ..., "
                f"\"content\": ...}}), got {kind}")
    return None


class KVStatsMiddleware:
    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if not WATCH.started:  # the first scope (lifespan startup): watch the engine
            WATCH.start(scope.get("app"))
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
        state = ServerStats.get()
        info = state.info()
        error = None
        try:
            payload = json.loads(body) if body else None
        except ValueError:
            payload = None  # vLLM answers malformed JSON itself
        param = "vllm_xargs"
        if isinstance(payload, dict):
            error = shape_error(path, payload)
            if error:
                param = "messages"
            elif state.context is not None:
                error = state.context.check_vllm_xargs(payload.get("vllm_xargs"))
        if error:
            content = _error_body(error, param)
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
                self.sse = SSERewriter(ServerStats.get().store.for_response)
            return await self._send(message)
        if kind != "http.response.body" or self.mode == "pass":
            return await self._send(message)
        more = message.get("more_body", False)
        if self.mode == "sse":
            body = message.get("body", b"")
            if b"[DONE]" in body or b'"usage"' in body or not more:
                # before the stats are looked up: a stop-string request's come a step later
                rid = self.sse.response_id() or _peek_id(body)
                await settled(rid)
            data = self.sse.feed(body, final=not more)
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
                await settled(rid)
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


def _peek_id(body: bytes) -> str | None:
    """The id of the first event in a body (when the stream's first chunk is in it)."""
    if not body.startswith(b"data:"):
        return None
    try:
        chunk = json.loads(body.split(b"\n\n", 1)[0][len(b"data:"):])
    except ValueError:
        return None
    return chunk.get("id") if isinstance(chunk, dict) else None
