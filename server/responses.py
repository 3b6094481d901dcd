"""kv_stats in OpenAI responses: the ASGI middleware that validates `vllm_xargs` and shapes
response bodies, and its pure helpers (unit-tested).

`KVStatsMiddleware` (innermost ASGI middleware, so vLLM's --api-key check runs first):
- validates `vllm_xargs` of POST /v1/completions and /v1/chat/completions (HTTP 400 with the
  valid keys and ranges, before the request reaches the engine);
- non-streaming 200 JSON responses: moves `kv_transfer_params.kv_stats` to a top-level
  `kv_stats` field (`kv_transfer_params` becomes null when that was all it held);
- streamed responses: vLLM does not carry kv_transfer_params in streams, so just before
  `data: [DONE]` it sends one more chunk, `{"id", "object", "created", "model",
  "choices": [], "kv_stats": {...}}`.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from server.store import STATS_KEY, ServerStats

logger = logging.getLogger("vllm.kvevict")  # under vLLM's logger: its handler and format

GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions")


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
        state = ServerStats.get()
        info = state.info()
        error = None
        try:
            payload = json.loads(body) if body else None
        except ValueError:
            payload = None  # vLLM answers malformed JSON itself
        if isinstance(payload, dict):
            if state.context is not None:
                error = state.context.check_vllm_xargs(payload.get("vllm_xargs"))
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
