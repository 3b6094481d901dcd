"""What an operator sees, on one `vllm serve --kv-policy prulong` (the shipped mask): every
finished request in /v1/kv_stats whatever ended it (stop string, client cancel under concurrent
load, length) with its finish reason; every request of n > 1 and multi-prompt streams in the
final usage chunk (official openai client); the start-up line and `params` naming the resolved
mask file; the live page `/kv` in headless Chromium while traffic runs; the Grafana dashboard's
series on /metrics; `vllm bench serve` against the plugin's responses.
Unit tests of the same pieces: test_kv_stats_unit.py, test_live_page.py, test_grafana.py."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from browser import Dom, ensure_chromium, polls, render
from conftest import REPO, SERVED_NAME, VENV_BIN, start_server
from test_grafana import missing_from_exposition

pytestmark = pytest.mark.server

MASK = REPO / "head_masks" / "SmolLM2-135M-Instruct" / "prulong-s0.7.json"
PROMPT = "The quick brown fox jumps over the lazy dog. " * 20 + "What does the fox do?"
REPEAT = "The quick brown fox jumps over the lazy dog. " * 30  # the model goes on repeating it


@pytest.fixture(scope="module")
def server(bundled_model_dir):
    return start_server(bundled_model_dir, ["--kv-policy", "prulong", "--kv-sparsity", "0.7",
                                            "--max-num-batched-tokens", "128",
                                            "--max-num-seqs", "4"])


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")


def stats_of(server, request_id: str) -> dict | None:
    r = httpx.get(f"{server.base_url}/v1/kv_stats/{request_id}")
    return r.json() if r.status_code == 200 else None


def wait_for(fn, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (value := fn()) is not None:
            return value
        time.sleep(0.1)
    raise TimeoutError(f"nothing after {timeout_s} s")


def test_startup_line_and_params_name_the_resolved_mask_file(server):
    line = next(x for x in server.log_tail(10 ** 7).splitlines()
                if "vllm-kvevict: serving policy=prulong" in x)
    assert f"mask_path={MASK}" in line and "mask_trained=" in line, line
    params = httpx.get(server.base_url + "/v1/kv_stats").json()["params"]
    assert params["mask_path"] == str(MASK) and params["mask_trained"]["train_sparsity"] == 0.7
    # the default storage: the streaming heads in vLLM's pool, vLLM's prefix caching kept on
    assert params["chunk"] == 128 and params["prefix_caching"] is True


def test_stop_string_requests_report_their_stats_and_reason(server):
    """vLLM ends a stop-string request in the API server and aborts it in the engine, whose
    output then carries nothing: the stats come a step later and the response waits for them."""
    c = client(server)
    done = c.completions.create(model=SERVED_NAME, prompt=REPEAT, max_tokens=32, temperature=0,
                                stop=[" over"])
    assert done.choices[0].finish_reason == "stop" and 1 < done.usage.completion_tokens < 32
    kv = done.model_extra["kv_stats"]
    assert kv is not None and (kv["finish_reason"], kv["stop_reason"]) == ("stop", " over"), kv
    assert kv["kv_bytes_peak"] > 0 and kv["prompt_tokens"] == done.usage.prompt_tokens
    assert stats_of(server, done.id) == kv

    chunks = list(c.chat.completions.create(
        model=SERVED_NAME, max_tokens=32, temperature=0, stream=True,
        stream_options={"include_usage": True}, stop=["."],
        messages=[{"role": "user", "content": "Write two sentences about a fox."}]))
    last = chunks[-1]
    assert last.usage is not None and last.choices == []
    kv = last.model_extra["kv_stats"]
    assert kv is not None and kv["finish_reason"] == "stop" and kv["request_id"] == last.id


def test_cancellations_under_concurrent_load_are_all_accounted_for(server):
    """10 streamed requests at once, 2 of them (20 %) cancelled by the client after 3 chunks:
    all 10 in /v1/kv_stats with their reason and bytes, and the pool back to empty."""
    before = httpx.get(server.base_url + "/v1/kv_stats").json()["aggregates"]

    async def one(http: httpx.AsyncClient, i: int, cancel: bool) -> str:
        body = {"model": SERVED_NAME, "prompt": f"{i}: " + PROMPT, "max_tokens": 24,
                "temperature": 0, "stream": True, "ignore_eos": True}
        rid, chunks = None, 0
        async with http.stream("POST", "/v1/completions", json=body) as resp:
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    rid = rid or re.search(r'"id":"([^"]+)"', line).group(1)
                    chunks += 1
                    if cancel and chunks == 3:
                        break  # leaving the block closes the connection: vLLM aborts it
        return rid

    async def load() -> list[str]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=300) as http:
            return await asyncio.gather(*(one(http, i, cancel=i in (3, 7)) for i in range(10)))

    ids = asyncio.run(load())
    found = {rid: wait_for(lambda rid=rid: stats_of(server, rid)) for rid in ids}
    reasons = {rid: kv["finish_reason"] for rid, kv in found.items()}
    assert sorted(reasons.values()) == ["abort"] * 2 + ["length"] * 8, reasons
    assert {reasons[ids[3]], reasons[ids[7]]} == {"abort"}
    for rid in (ids[3], ids[7]):
        kv = found[rid]
        assert kv["kv_bytes_peak"] > 0 and 2 <= kv["completion_tokens"] < 24, kv
    after = httpx.get(server.base_url + "/v1/kv_stats").json()["aggregates"]
    per = after["requests_per_finish_reason"]
    assert after["requests"] - before["requests"] == 10
    assert per["abort"] - before["requests_per_finish_reason"].get("abort", 0) == 2

    def pool_empty():
        text = httpx.get(server.base_url + "/metrics").text
        used = [float(v) for v in re.findall(r"^vllm_kvevict_pool_blocks_used\{.*\} (\S+)$",
                                             text, re.M)]
        usage = [float(v) for v in re.findall(r"^vllm:kv_cache_usage_perc\{.*\} (\S+)$",
                                              text, re.M)]
        return True if used and not any(used) and usage and not any(usage) else None
    wait_for(pool_empty)


def test_n2_and_two_prompt_streams_report_every_request(server):
    c = client(server)
    last = list(c.completions.create(
        model=SERVED_NAME, prompt="Hello, my name is", max_tokens=6, n=2, temperature=0.8,
        seed=3, stream=True, stream_options={"include_usage": True}))[-1]
    assert last.usage is not None and last.usage.completion_tokens == 12
    both = last.model_extra["kv_stats_per_request"]
    assert [kv["index"] for kv in both] == [0, 1] and last.model_extra["kv_stats"] == both[0]
    assert len({kv["engine_request_id"] for kv in both}) == 2
    assert {kv["request_id"] for kv in both} == {last.id + "-0"}

    last = list(c.completions.create(model=SERVED_NAME, prompt=["One fox", "Two dogs"],
                                     max_tokens=4, temperature=0, stream=True))[-1]
    assert last.choices == [] and last.usage is None  # no include_usage: our own last chunk
    two = last.model_extra["kv_stats_per_request"]
    assert sorted(kv["request_id"] for kv in two) == [last.id + "-0", last.id + "-1"]

    full = c.completions.create(model=SERVED_NAME, prompt="Hello", max_tokens=4, n=2,
                                temperature=0.8, seed=5)
    assert [kv["index"] for kv in full.model_extra["kv_stats_per_request"]] == [0, 1]


def test_live_page_draws_the_pool_and_requests_while_traffic_runs(server, tmp_path):
    ensure_chromium()
    stop = threading.Event()

    def traffic():
        c = client(server)
        while not stop.is_set():
            c.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=16,
                                 temperature=0, extra_body={"ignore_eos": True})

    threads = [threading.Thread(target=traffic, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        time.sleep(3.0)
        shot = Path(os.environ.get("KVEVICT_LIVE_SCREENSHOT") or tmp_path / "kv-live.png")
        html = render(server.base_url + "/kv", wait_ms=6000, screenshot=shot)
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    dom = Dom(html)
    assert polls(html) >= 2 and dom.by_id("status").text.startswith("live")
    assert dom.by_id("policy").text == "prulong"
    curves = dom.by_class("req-curve", "path")
    assert len(curves) >= 2, html[-2000:]
    assert {e.attrs["data-request"] for e in curves} == \
        {e.attrs["data-request"] for e in dom.by_class("req-full", "path")}
    assert dom.by_class("pool-area", "path") and shot.stat().st_size > 10_000


def test_grafana_dashboard_series_are_all_exported(server):
    client(server).completions.create(model=SERVED_NAME, prompt="Hi", max_tokens=2)
    text = httpx.get(server.base_url + "/metrics").text
    assert missing_from_exposition(text) == set()


def test_vllm_bench_serve_reads_our_responses(server, bundled_model_dir):
    """vLLM's own load generator streams completions with usage: kv_stats ride along."""
    out = subprocess.run(
        [str(VENV_BIN / "vllm"), "bench", "serve", "--backend", "vllm",
         "--base-url", server.base_url, "--model", SERVED_NAME,
         "--tokenizer", str(bundled_model_dir), "--dataset-name", "random",
         "--random-input-len", "64", "--random-output-len", "8", "--num-prompts", "4",
         "--seed", "0"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"Successful requests:\s+4", out.stdout), out.stdout[-3000:]
    assert re.search(r"Failed requests:\s+0", out.stdout) or "Failed" not in out.stdout
