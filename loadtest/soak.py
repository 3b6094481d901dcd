"""Soak: many mixed requests against one live server, then what a reliable server must show.

    python -m loadtest.soak --base-url http://127.0.0.1:8000 --requests 1000 --concurrency 24 \\
        --out docs/results/soak/prulong.json
    python -m loadtest.soak --report docs/results/soak > docs/results/soak/table.md

The traffic (seeded, so a rerun sends the same requests): plain and streamed completions and
chats over three shared prefixes (prefix-cache hits), stop strings, `n = 2`, per-request
`vllm_xargs` the served policy accepts, seeded sampling over several prefill steps, long prompts,
streams the client cancels (during prefill or after 1-4 chunks), and malformed requests
(`BAD_REQUESTS`). `--concurrency` of them in flight.

Afterwards (`check`): no answer was a 5xx; every bad request got a 4xx naming what is wrong;
every completed response carried its kv_stats (a streamed one in its last chunk); once idle,
vLLM's pool usage and every KV-cache group's blocks held are 0; the server's aggregates count
each engine request once (each completed response's, plus at most one per cancel) with a finish
reason; a greedy probe answers as before the soak; /health is 200.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

MODEL = "smollm2"
KINDS = {  # kind -> weight in the mix
    "completion": 14, "chat": 12, "stop": 12, "stream": 12, "cancel": 12, "cancel_prefill": 4,
    "n2": 8, "override": 8, "seeded": 4, "long": 4, "bad": 10,
}
WORDS = ("river stone garden light paper window music silver morning letter harbor field "
         "candle market winter orange forest bridge engine story number cloud").split()


def bad_requests(model: str) -> list[tuple[str, str, Any, str]]:
    """(path, name, JSON body or raw bytes, a word the 4xx message must contain)."""
    c, ch = "/v1/completions", "/v1/chat/completions"
    msgs = [{"role": "user", "content": "hi"}]
    return [
        (c, "unknown vllm_xargs key", {"model": model, "prompt": "hi", "max_tokens": 2,
                                       "vllm_xargs": {"kv_sparsity_typo": 0.5}}, "kv_sparsity_typo"),
        (c, "kv_teacher_forced not an int", {"model": model, "prompt": "hi", "max_tokens": 2,
                                             "vllm_xargs": {"kv_teacher_forced": "x"}},
         "kv_teacher_forced"),
        (c, "negative max_tokens", {"model": model, "prompt": "hi", "max_tokens": -3},
         "max_tokens"),
        (c, "temperature out of range", {"model": model, "prompt": "hi", "max_tokens": 2,
                                         "temperature": -1}, "temperature"),
        (c, "unknown model", {"model": "no-such-model", "prompt": "hi", "max_tokens": 2},
         "model"),
        (c, "malformed JSON", b'{"model": "' + model.encode() + b'", "prompt": ', "json"),
        (c, "prompt longer than the context", {"model": model, "prompt": [11] * 9000,
                                               "max_tokens": 2}, "context"),
        (ch, "messages not a list", {"model": model, "messages": "hi", "max_tokens": 2},
         "messages"),
        (ch, "n = 0", {"model": model, "messages": msgs, "max_tokens": 2, "n": 0}, "n"),
        (ch, "top_p above 1", {"model": model, "messages": msgs, "max_tokens": 2, "top_p": 3},
         "top_p"),
    ]


@dataclass
class SoakResult:
    requests: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)
    completed: int = 0  # 2xx with a whole body
    engine_requests_completed: int = 0  # n per completed response
    side_requests: int = 0  # requests the caller sent beside the soak (each recorded once)
    without_kv_stats: list[str] = field(default_factory=list)  # kind:response id
    cancelled: int = 0
    bad: int = 0
    bad_answered_4xx: int = 0
    bad_unnamed: list[str] = field(default_factory=list)  # 4xx whose message misses the field
    server_errors: list[str] = field(default_factory=list)  # 5xx or broken connections
    statuses: dict[str, int] = field(default_factory=dict)
    duration_s: float = 0.0
    # after the soak
    recorded_delta: int | None = None  # aggregates.requests after - before
    finish_reasons_delta: dict[str, int] = field(default_factory=dict)
    pool_usage_after: float | None = None
    blocks_used_after: list[int] | None = None
    preemptions: float | None = None
    probe_same: bool | None = None
    healthy_after: bool | None = None
    failures: list[str] = field(default_factory=list)


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(100, 20000) for _ in range(n)]


def _text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


class Soak:
    def __init__(self, base_url: str, model: str = MODEL, seed: int = 0,
                 xargs: list[dict] | None = None, long_tokens: int = 1500,
                 timeout_s: float = 900.0, salts: tuple[str, ...] = ()) -> None:
        self.base_url, self.model, self.seed = base_url.rstrip("/"), model, seed
        self.salts = salts  # tenants: each well-formed request under one of their cache_salts
        self.xargs = xargs or [{"kv_teacher_forced": 4}]
        self.long_tokens, self.timeout_s = long_tokens, timeout_s
        rng = random.Random(seed)
        self.prefixes = [_ids(rng, n) for n in (200, 400, 600)]
        self.chat_prefixes = [_text(rng, n) for n in (120, 300)]
        self.bad = bad_requests(model)
        self.result = SoakResult()

    # -- one request of each kind ---------------------------------------------------------------
    def body(self, kind: str, rng: random.Random) -> tuple[str, Any, dict]:
        """(path, body, how to treat it)."""
        m, c, ch = self.model, "/v1/completions", "/v1/chat/completions"
        prompt = rng.choice(self.prefixes) + _ids(rng, rng.randint(5, 120))
        if kind == "completion":
            return c, {"model": m, "prompt": prompt, "max_tokens": rng.randint(4, 24),
                       "temperature": 0}, {}
        if kind == "chat":
            msgs = [{"role": "system", "content": rng.choice(self.chat_prefixes)},
                    {"role": "user", "content": _text(rng, rng.randint(5, 40))}]
            return ch, {"model": m, "messages": msgs, "max_tokens": rng.randint(4, 24),
                        "temperature": 0}, {}
        if kind == "stop":
            msgs = [{"role": "user", "content": "Write three sentences about " + _text(rng, 3)}]
            return ch, {"model": m, "messages": msgs, "max_tokens": 48, "temperature": 0,
                        "stop": ["."]}, {}
        if kind == "stream":
            return c, {"model": m, "prompt": prompt, "max_tokens": rng.randint(4, 24),
                       "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": rng.random() < 0.5}}, {"stream": True}
        if kind in ("cancel", "cancel_prefill"):
            long = kind == "cancel_prefill"
            p = _ids(rng, self.long_tokens) if long else prompt
            return c, {"model": m, "prompt": p, "max_tokens": 64, "temperature": 0,
                       "stream": True, "ignore_eos": True}, \
                {"stream": True, "cancel_after": 0 if long else rng.randint(1, 4),
                 "cancel_s": rng.uniform(0.05, 0.5)}
        if kind == "n2":
            return c, {"model": m, "prompt": prompt, "max_tokens": 8, "n": 2,
                       "temperature": 0.7, "seed": rng.randint(0, 1000)}, {"n": 2}
        if kind == "override":
            return c, {"model": m, "prompt": prompt, "max_tokens": 8, "temperature": 0,
                       "vllm_xargs": rng.choice(self.xargs)}, {}
        if kind == "seeded":
            return c, {"model": m, "prompt": _ids(rng, self.long_tokens // 2 + 300),
                       "max_tokens": 8, "temperature": 0.8, "seed": rng.randint(0, 1000)}, {}
        if kind == "long":
            return c, {"model": m, "prompt": _ids(rng, self.long_tokens), "max_tokens": 12,
                       "temperature": 0}, {}
        path, name, body, word = rng.choice(self.bad)
        return path, body, {"bad": name, "word": word}

    async def one(self, client: httpx.AsyncClient, kind: str, rng: random.Random) -> None:
        r = self.result
        path, body, how = self.body(kind, rng)
        if self.salts and isinstance(body, dict) and "bad" not in how:
            body["cache_salt"] = rng.choice(self.salts)
        url = self.base_url + path
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {"content-type": "application/json"}
        try:
            if how.get("stream"):
                await self._stream(client, url, raw, headers, kind, how)
                return
            resp = await client.post(url, content=raw, headers=headers, timeout=self.timeout_s)
        except httpx.HTTPError as exc:
            r.server_errors.append(f"{kind}: {type(exc).__name__}: {exc}")
            return
        self._status(resp.status_code)
        if "bad" in how:
            self._bad(resp, how)
            return
        if resp.status_code != 200:
            r.server_errors.append(f"{kind}: HTTP {resp.status_code}: {resp.text[:200]}")
            return
        payload = resp.json()
        r.completed += 1
        r.engine_requests_completed += how.get("n", 1)
        if payload.get("kv_stats") is None:
            r.without_kv_stats.append(f"{kind}:{payload.get('id')}")

    def _status(self, code: int) -> None:
        key = str(code)
        self.result.statuses[key] = self.result.statuses.get(key, 0) + 1

    def _bad(self, resp: httpx.Response, how: dict) -> None:
        r = self.result
        r.bad += 1
        if 400 <= resp.status_code < 500:
            r.bad_answered_4xx += 1
            if how["word"].lower() not in resp.text.lower():
                r.bad_unnamed.append(f"{how['bad']}: {resp.text[:200]}")
        else:
            r.server_errors.append(f"bad request {how['bad']!r}: HTTP {resp.status_code}: "
                                   f"{resp.text[:200]}")

    async def _stream(self, client, url, raw, headers, kind, how) -> None:
        r = self.result
        cancel_after = how.get("cancel_after")
        last = None
        async with client.stream("POST", url, content=raw, headers=headers,
                                 timeout=self.timeout_s) as resp:
            self._status(resp.status_code)
            if resp.status_code != 200:
                r.server_errors.append(f"{kind}: HTTP {resp.status_code}")
                return
            if cancel_after == 0:  # during prefill: the client goes away before any token
                await asyncio.sleep(how["cancel_s"])
                r.cancelled += 1
                return
            chunks = 0
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunks += 1
                if cancel_after is not None and chunks >= cancel_after:
                    r.cancelled += 1
                    return
                last = json.loads(data)
        r.completed += 1
        r.engine_requests_completed += 1
        if not isinstance(last, dict) or last.get("kv_stats") is None:
            r.without_kv_stats.append(f"{kind}:{(last or {}).get('id')}")

    # -- the run and its checks -----------------------------------------------------------------
    async def run(self, num_requests: int, concurrency: int, progress: bool = True,
                  every_kind: bool = False) -> SoakResult:
        """`every_kind`: one request of each kind first (a short soak's few requests would
        otherwise miss some), the rest drawn by weight."""
        rng = random.Random(self.seed + 1)
        first = list(KINDS)[:num_requests] if every_kind else []
        kinds = first + rng.choices(list(KINDS), weights=list(KINDS.values()),
                                    k=num_requests - len(first))
        self.result.requests = num_requests
        self.result.by_kind = dict(Counter(kinds))
        sem = asyncio.Semaphore(concurrency)
        bar = _progress(num_requests, progress)
        start = time.monotonic()

        async def guarded(client, kind, seed):
            async with sem:
                await self.one(client, kind, random.Random(seed))
                bar.update(1)

        limits = httpx.Limits(max_connections=concurrency + 4)
        async with httpx.AsyncClient(limits=limits, trust_env=False) as client:
            await asyncio.gather(*(guarded(client, k, self.seed * 1_000_003 + i)
                                   for i, k in enumerate(kinds)))
        bar.close()
        self.result.duration_s = round(time.monotonic() - start, 1)
        return self.result


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc="soak", disable=not enabled, mininterval=5.0)


# -- server state around a soak -------------------------------------------------------------------

def metrics(base_url: str) -> dict[str, list[tuple[dict, float]]]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list[tuple[dict, float]]] = {}
    text = httpx.get(base_url + "/metrics", timeout=30, trust_env=False).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return out


def metric_sum(m: dict, name: str) -> float | None:
    return sum(v for _, v in m[name]) if name in m else None


def aggregates(base_url: str) -> dict[str, Any]:
    return httpx.get(base_url + "/v1/kv_stats", params={"limit": 0}, timeout=30,
                     trust_env=False).json()


def probe(base_url: str, model: str = MODEL) -> str:
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": 12,
            "temperature": 0}
    r = httpx.post(base_url + "/v1/completions", json=body, timeout=120, trust_env=False)
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def wait_idle(base_url: str, timeout_s: float = 120.0) -> tuple[float | None, list[int] | None]:
    """vLLM's pool usage and our per-group blocks held, once both are 0 (or at the timeout).
    Requests are done, but an engine step may still be freeing the last cancelled one."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = metrics(base_url)
        usage = metric_sum(m, "vllm:kv_cache_usage_perc")
        blocks = [int(v) for _, v in m.get("vllm_kvevict_pool_blocks_used", ())]
        if (not usage and not any(blocks)) or time.monotonic() > deadline:
            return usage, blocks
        time.sleep(1.0)


def run_soak(base_url: str, num_requests: int, concurrency: int, seed: int = 0,
             xargs: list[dict] | None = None, long_tokens: int = 1500,
             progress: bool = True, side_requests: int = 0,
             every_kind: bool = False, salts: tuple[str, ...] = ()) -> SoakResult:
    """The soak and its checks; `result.failures` lists every check that did not hold.
    `side_requests`: whole requests the caller sends to the server meanwhile (counted among
    the recorded ones); `every_kind`: each kind of request at least once (`Soak.run`);
    `salts`: tenants' cache_salts, one on each well-formed request."""
    before_probe = probe(base_url)
    before = aggregates(base_url)["aggregates"]
    m0 = metrics(base_url)
    soak = Soak(base_url, seed=seed, xargs=xargs, long_tokens=long_tokens, salts=salts)
    result = asyncio.run(soak.run(num_requests, concurrency, progress, every_kind))
    result.side_requests = side_requests
    # every completed response's engine requests, and at most one per cancel, get recorded
    # (a cancel's stats come with the engine step that handles the abort)
    deadline = time.monotonic() + 120
    while True:
        after = aggregates(base_url)
        agg = after["aggregates"]
        result.recorded_delta = agg["requests"] - before["requests"]
        if (result.recorded_delta >= result.engine_requests_completed + side_requests
                and after.get("stats_owed", 0) == 0) or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    reasons0 = before.get("requests_per_finish_reason", {})
    result.finish_reasons_delta = {k: v - reasons0.get(k, 0)
                                   for k, v in agg.get("requests_per_finish_reason", {}).items()
                                   if v - reasons0.get(k, 0)}
    result.pool_usage_after, result.blocks_used_after = wait_idle(base_url)
    m1 = metrics(base_url)
    p0, p1 = (metric_sum(x, "vllm:num_preemptions_total") for x in (m0, m1))
    result.preemptions = None if p1 is None else p1 - (p0 or 0)
    result.probe_same = probe(base_url) == before_probe
    result.healthy_after = httpx.get(base_url + "/health", timeout=30,
                                     trust_env=False).status_code == 200
    result.failures = check(result)
    return result


def check(r: SoakResult) -> list[str]:
    out = []
    if r.server_errors:
        out.append(f"{len(r.server_errors)} 5xx or broken answers, e.g. {r.server_errors[:3]}")
    if r.bad_answered_4xx != r.bad:
        out.append(f"{r.bad - r.bad_answered_4xx} of {r.bad} bad requests not answered 4xx")
    if r.bad_unnamed:
        out.append(f"4xx messages that do not name the field: {r.bad_unnamed[:3]}")
    if r.without_kv_stats:
        out.append(f"{len(r.without_kv_stats)} of {r.completed} completed responses without "
                   f"kv_stats: {r.without_kv_stats[:5]}")
    low = r.engine_requests_completed + r.side_requests
    high = low + r.cancelled
    if r.recorded_delta is None or not low <= r.recorded_delta <= high:
        out.append(f"recorded {r.recorded_delta} requests, expected {low}..{high}")
    if sum(r.finish_reasons_delta.values()) != (r.recorded_delta or 0):
        out.append(f"finish reasons {r.finish_reasons_delta} do not add up to the "
                   f"{r.recorded_delta} recorded")
    if r.pool_usage_after or (r.blocks_used_after and any(r.blocks_used_after)):
        out.append(f"pool not empty after the soak: usage {r.pool_usage_after}, blocks held "
                   f"per group {r.blocks_used_after}")
    if not r.probe_same:
        out.append("the probe prompt answers differently after the soak")
    if not r.healthy_after:
        out.append("/health is not 200 after the soak")
    return out


def report(results_dir: Path) -> str:
    """docs/results/soak/table.md: one row per mechanism's JSON record."""
    head = ("| mechanism | requests | completed (engine requests) | cancelled | bad -> 4xx | "
            "5xx | without kv_stats | recorded (finish reasons) | preemptions | pool after | "
            "probe same | healthy | s | same as reference (cached) | commit |\n|" + "---|" * 15)
    rows = []
    for path in sorted(results_dir.glob("*.json")):
        r = json.loads(path.read_text())
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(r["finish_reasons_delta"].items()))
        blocks = "0 in every group" if not any(r["blocks_used_after"] or ()) else \
            str(r["blocks_used_after"])
        samples = r.get("reference_samples")
        same = "-" if samples is None else \
            f"{samples - len(r['reference_mismatches'])}/{samples} ({r['reference_cached']})"
        rows.append(f"| {r.get('mechanism', path.stem)} | {r['requests']} | {r['completed']} "
                    f"({r['engine_requests_completed']}) | {r['cancelled']} | {r['bad']} -> "
                    f"{r['bad_answered_4xx']} | {len(r['server_errors'])} | "
                    f"{len(r['without_kv_stats'])} | {r['recorded_delta']} ({reasons}) | "
                    f"{r['preemptions']:g} | usage {r['pool_usage_after']:g}, {blocks} | "
                    f"{r['probe_same']} | {r['healthy_after']} | {r['duration_s']:g} | "
                    f"{same} | {r.get('commit', '-')} |")
    return head + "\n" + "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--long-tokens", type=int, default=1500)
    ap.add_argument("--xargs", default='[{"kv_teacher_forced": 4}]',
                    help="JSON list of vllm_xargs dicts the override requests choose from")
    ap.add_argument("--out", type=Path, help="write the result as JSON here")
    ap.add_argument("--report", type=Path, metavar="DIR",
                    help="only print the table of the JSON records in DIR")
    args = ap.parse_args(argv)
    if args.report:
        print(report(args.report), end="")
        return 0
    result = run_soak(args.base_url, args.requests, args.concurrency, args.seed,
                      json.loads(args.xargs), args.long_tokens)
    text = json.dumps(asdict(result), indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)
    return 1 if result.failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
