"""One streamed /v1/completions request and its timing.

Streaming is what makes TTFT and per-token timing observable: TTFT is the first chunk carrying
`choices`, TPOT = (e2e - ttft) / (output_tokens - 1), and the gaps between chunks are the
inter-token latencies. Outcomes are classified so that a server saying "no" (4xx, e.g. a prompt
longer than the context) is counted as `rejected`, apart from real failures (5xx, connection
errors, broken streams) and from requests cut off by the run's deadline (`cancelled`).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from loadtest.workloads import Prompt

OUTCOMES = ("ok", "rejected", "failed", "cancelled")


@dataclass
class RequestResult:
    index: int
    kind: str
    outcome: str = "failed"
    http_status: int | None = None
    error_type: str | None = None
    error: str | None = None
    input_tokens: int = 0
    output_tokens: int = 0
    start_s: float = 0.0  # seconds after the run started
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    kv_stats: dict[str, Any] | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details (--enable-prompt-tokens-details)
    token_ids: list[int] = field(default_factory=list)  # the answer's ids (return_token_ids)

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def make_http_client(timeout_s: float) -> httpx.AsyncClient:
    """One shared client; no connection cap (a pool limit would queue requests invisibly and
    inflate TTFT) and no proxies from the environment (targets are local servers)."""
    return httpx.AsyncClient(
        timeout=httpx.Timeout(timeout_s, connect=10.0),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        trust_env=False,
    )


def request_body(model: str, prompt: Prompt, ignore_eos: bool = True,
                 return_token_ids: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt.token_ids,
        "max_tokens": prompt.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:  # vLLM extension: generate exactly max_tokens so output lengths are fixed
        body["ignore_eos"] = True
    if return_token_ids:  # vLLM extension: the answer's ids, e.g. to append to a conversation
        body["return_token_ids"] = True
    return body


def find_kv_stats(payload: dict[str, Any]) -> dict[str, Any] | None:
    """kv_stats as a top-level field or inside kv_transfer_params."""
    stats = payload.get("kv_stats")
    if isinstance(stats, dict):
        return stats
    params = payload.get("kv_transfer_params")
    if isinstance(params, dict) and isinstance(params.get("kv_stats"), dict):
        return params["kv_stats"]
    return None


def _stream_error(chunk: dict[str, Any]) -> dict[str, Any] | None:
    """An error sent inside a 200 stream: `{"error": {...}}`, or older vLLM's
    `{"object": "error", ...}`."""
    if "error" in chunk:
        return chunk["error"] if isinstance(chunk["error"], dict) else {"message": chunk["error"]}
    if chunk.get("object") == "error":
        return chunk
    return None


def _classify_status(status: int) -> str:
    return "rejected" if 400 <= status < 500 else "failed"


async def send_request(client: httpx.AsyncClient, base_url: str, model: str, prompt: Prompt,
                       t0: float, deadline: float, timeout_s: float,
                       ignore_eos: bool = True, return_token_ids: bool = False
                       ) -> RequestResult:
    """Send one prompt and time it; never raises except on cancellation of the caller.

    t0 is the run's start (perf_counter) and deadline the loop time (asyncio clock) after which
    the request is abandoned as `cancelled`, so a hung server cannot stretch the run past its
    duration bound. A request taking longer than timeout_s before that is `failed`.
    """
    res = RequestResult(index=prompt.index, kind=prompt.kind, input_tokens=len(prompt.token_ids))
    loop = asyncio.get_running_loop()
    start = time.perf_counter()
    res.start_s = start - t0
    last_chunk_at: float | None = None
    done = False
    try:
        async with asyncio.timeout_at(min(deadline, loop.time() + timeout_s)):
            async with client.stream("POST", f"{base_url}/v1/completions",
                                     json=request_body(model, prompt, ignore_eos,
                                                       return_token_ids)) as resp:
                res.http_status = resp.status_code
                if resp.status_code >= 400:
                    body = (await resp.aread()).decode(errors="replace")
                    res.outcome = _classify_status(resp.status_code)
                    res.error_type = f"HTTP {resp.status_code}"
                    res.error = body[:500]
                    return res
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[len("data:"):].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    chunk = json.loads(data)
                    now = time.perf_counter()
                    err = _stream_error(chunk)
                    if err is not None:
                        code = err.get("code") if isinstance(err.get("code"), int) else 500
                        res.outcome = _classify_status(code)
                        res.error_type = f"stream error {code}"
                        res.error = str(err.get("message", err))[:500]
                        return res
                    if chunk.get("choices"):
                        if res.ttft_s is None:
                            res.ttft_s = now - start
                        else:
                            res.itl_s.append(now - last_chunk_at)
                        last_chunk_at = now
                        res.output_tokens += 1
                        res.token_ids += chunk["choices"][0].get("token_ids") or []
                    usage = chunk.get("usage")
                    if isinstance(usage, dict):
                        res.input_tokens = usage.get("prompt_tokens") or res.input_tokens
                        res.output_tokens = usage.get("completion_tokens") or res.output_tokens
                        details = usage.get("prompt_tokens_details")
                        if isinstance(details, dict) and details.get("cached_tokens") is not None:
                            res.cached_tokens = int(details["cached_tokens"])
                    res.kv_stats = find_kv_stats(chunk) or res.kv_stats
        res.e2e_s = time.perf_counter() - start
        if not done:
            res.outcome, res.error_type = "failed", "IncompleteStream"
            res.error = "stream ended without [DONE]"
        elif res.ttft_s is None:
            res.outcome, res.error_type = "failed", "EmptyStream"
            res.error = "stream carried no tokens"
        else:
            res.outcome = "ok"
    except TimeoutError:
        if loop.time() >= deadline:
            res.outcome, res.error_type = "cancelled", "Deadline"
            res.error = "run duration bound reached before the request finished"
        else:
            res.outcome, res.error_type = "failed", "RequestTimeout"
            res.error = f"no complete answer within {timeout_s:g} s"
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as exc:
        res.outcome, res.error_type = "failed", type(exc).__name__
        res.error = str(exc)[:500] or type(exc).__name__
    return res
