"""Tests of the load generator against a tiny OpenAI-like server run in-process.

The fake server streams `max_tokens` chunks with small sleeps, puts a kv_stats object in the
final (usage) chunk, answers 400 to prompts longer than PROMPT_LIMIT tokens, 500 to model
"boom", fails mid-stream for model "streamerr", never answers model "hang", and serves a fake
Prometheus /metrics page.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from loadtest import compare, crosscheck, run as run_cli
from loadtest.client import find_kv_stats
from loadtest.loopback import RemoteURLError, check_base_url, is_loopback_host
from loadtest.metrics import aggregate_kv_stats, latency_stats_ms, numeric_leaves
from loadtest.monitors import parse_vllm_metrics, tree_rss_bytes
from loadtest.report import build_result, comparison_markdown, format_table
from loadtest.runner import LoadSettings, poisson_arrivals, run
from vllm_kvevict.launch import VLLM, build_server_command, parse_policy
from loadtest.workloads import Prompt, build_prompts, exact_length_ids, make_shapes

PROMPT_LIMIT = 64
TOKEN_DELAY_S = 0.002


# ---------------------------------------------------------------- fake OpenAI-like server

def metrics_text(step: int) -> str:
    return f"""# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",model_name="fake"}} {min(1.0, 0.1 * step)}
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="fake"}} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="fake"}} 1.0
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{{engine="0",model_name="fake"}} {3.0 + step}
# HELP vllm:request_inference_time_seconds Histogram of time spent in RUNNING phase for request.
# TYPE vllm:request_inference_time_seconds histogram
vllm:request_inference_time_seconds_sum{{engine="0",model_name="fake"}} {1.5 * time.perf_counter()}
"""


def make_app() -> FastAPI:
    app = FastAPI()
    scrapes = {"n": 0}
    seen: list[list[int]] = []  # prompts answered so far, for a prefix-cache-like count

    @app.get("/health")
    async def health():
        return PlainTextResponse("")

    @app.get("/metrics")
    async def metrics():
        scrapes["n"] += 1
        return PlainTextResponse(metrics_text(scrapes["n"]))

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        prompt, n = body["prompt"], body["max_tokens"]
        if body["model"] == "boom":
            return JSONResponse({"error": "internal"}, status_code=500)
        if len(prompt) > PROMPT_LIMIT:
            return JSONResponse({"object": "error", "type": "BadRequestError", "code": 400,
                                 "message": f"prompt of {len(prompt)} tokens is longer than "
                                            f"the maximum context length {PROMPT_LIMIT}"},
                                status_code=400)

        # cached tokens as vLLM counts them: the longest prefix shared with an earlier
        # prompt, in whole 16-token blocks, never the whole prompt
        shared = max((next((i for i, (a, b) in enumerate(zip(prompt, old)) if a != b),
                           min(len(prompt), len(old))) for old in seen), default=0)
        cached = min(shared, len(prompt) - 1) // 16 * 16
        seen.append(list(prompt))

        async def stream():
            if body["model"] == "hang":
                await asyncio.sleep(60)
            for i in range(n):
                await asyncio.sleep(TOKEN_DELAY_S)
                choice = {"index": 0, "text": f" t{i}"}
                if body.get("return_token_ids") and body["model"] != "noids":
                    choice["token_ids"] = [1000 + i]
                yield "data: " + json.dumps({"choices": [choice]}) + "\n\n"
                if body["model"] == "streamerr":
                    yield "data: " + json.dumps({"error": {"message": "engine died",
                                                           "code": 500}}) + "\n\n"
                    return
            kv_stats = {"footprint": len(prompt) / PROMPT_LIMIT, "kv_bytes_peak": 100 * len(prompt),
                        "kv_bytes_saved": 10, "policy": "fake", "exact": True,
                        "layers": {"0": 1, "1": 3}}
            final = {"choices": [], "usage": {"prompt_tokens": len(prompt),
                                              "completion_tokens": n,
                                              "prompt_tokens_details": {"cached_tokens": cached}}}
            if body["model"] == "transfer":
                final["kv_transfer_params"] = {"kv_stats": kv_stats}
            else:
                final["kv_stats"] = kv_stats
            yield "data: " + json.dumps(final) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


class FakeServer:
    """uvicorn on 127.0.0.1, on a socket bound to port 0 (no free-port race), in a thread."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(
            make_app(), log_level="warning", lifespan="off", timeout_graceful_shutdown=1))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "FakeServer":
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "fake server did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(5)


def serve_forever(port: int) -> None:
    """Entry point of the fake server as a separate process (for the compare test)."""
    uvicorn.run(make_app(), host="127.0.0.1", port=port, log_level="warning", lifespan="off")


@pytest.fixture(scope="module")
def server():
    with FakeServer() as s:
        yield s


class WordTokenizer:
    """Word-level stub: any object with encode/decode can drive the prompt generator."""

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}
        self.words: list[str] = []

    def encode(self, text: str) -> list[int]:
        ids = []
        for word in text.split():
            if word not in self.vocab:
                self.vocab[word] = len(self.words)
                self.words.append(word)
            ids.append(self.vocab[word])
        return ids

    def decode(self, ids) -> str:
        return " ".join(self.words[i] for i in ids)


def prompts_of(lengths: list[int], output_len: int = 5) -> list[Prompt]:
    return [Prompt(i, "rag", list(range(n)), output_len, "") for i, n in enumerate(lengths)]


def settings(server, **kw) -> LoadSettings:
    kw.setdefault("max_duration_s", 20.0)
    return LoadSettings(base_url=server.base_url, model=kw.pop("model", "fake"),
                        progress=False, **kw)


# ---------------------------------------------------------------- prompt generation

def test_prompts_have_exact_lengths_and_are_seeded():
    shapes = make_shapes("rag", input_len=37, output_len=3)
    a = build_prompts(WordTokenizer(), shapes, 4, seed=7)
    b = build_prompts(WordTokenizer(), shapes, 4, seed=7)
    c = build_prompts(WordTokenizer(), shapes, 4, seed=8)
    assert [len(p.token_ids) for p in a] == [37] * 4
    assert all(p.output_len == 3 and p.kind == "rag" for p in a)
    assert [p.text for p in a] == [p.text for p in b]
    assert [p.text for p in a] != [p.text for p in c]
    assert len({p.text for p in a}) == 4  # distinct prompts: no prefix-cache hits between them


def test_mix_workload_draws_both_kinds():
    shapes = make_shapes("mix", input_len=50, output_len=20)
    assert [(s.kind, s.input_len, s.output_len) for s in shapes] == \
        [("rag", 50, 64), ("cot", 128, 20)]
    prompts = build_prompts(WordTokenizer(), shapes, 40, seed=0)
    kinds = {p.kind for p in prompts}
    assert kinds == {"rag", "cot"}
    for p in prompts:
        assert len(p.token_ids) == (50 if p.kind == "rag" else 128)
    with pytest.raises(ValueError):
        make_shapes("chat")


def _tiny_bpe_dir(tmp_path: Path) -> Path:
    """A real transformers tokenizer directory, trained here (no download): byte-level BPE,
    whose decode/encode does not round-trip token-exactly, unlike the word stub."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from loadtest.workloads import WORDS

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([" ".join(WORDS[i:] + WORDS[:i]) for i in range(0, 200, 7)], trainer)
    path = tmp_path / "tokenizer"
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", unk_token="<unk>") \
        .save_pretrained(path)
    return path


def test_exact_lengths_with_autotokenizer(tmp_path):
    tokenizer = run_cli.load_tokenizer(str(_tiny_bpe_dir(tmp_path)))
    rng = np.random.default_rng(0)
    for n in (1, 2, 17, 300, 1001):
        ids = exact_length_ids(tokenizer, n, rng)
        assert len(ids) == n
        assert tokenizer.bos_token_id not in ids
        assert isinstance(tokenizer.decode(ids), str)


def _local_model_tokenizer() -> str | None:
    """A real model tokenizer on this machine: $LOADTEST_TOKENIZER, the project's bundled model
    if already converted (never converted here: too slow for this file), or the HF cache."""
    env = os.environ.get("LOADTEST_TOKENIZER")
    if env and Path(env).exists():
        return env
    try:
        from vllm_kvevict.model import bundled_model_dir
    except ImportError:
        pass
    else:
        if (bundled_model_dir() / "tokenizer.json").is_file():
            return str(bundled_model_dir())
    hub = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")) / "hub"
    for path in sorted(hub.glob("models--*/snapshots/*/tokenizer.json")):
        return str(path.parent)
    return None


@pytest.mark.skipif(_local_model_tokenizer() is None,
                    reason="no model tokenizer available locally (set LOADTEST_TOKENIZER)")
def test_exact_lengths_with_local_model_tokenizer():
    tokenizer = run_cli.load_tokenizer(_local_model_tokenizer())
    prompts = build_prompts(tokenizer, make_shapes("mix", 7000, 30), 6, seed=1)
    assert {p.kind for p in prompts} == {"rag", "cot"}
    for p in prompts:
        assert len(p.token_ids) == (7000 if p.kind == "rag" else 128)
        assert max(p.token_ids) < len(tokenizer)
        assert tokenizer.bos_token_id not in p.token_ids


# ---------------------------------------------------------------- metrics

def test_percentiles_match_numpy():
    values_s = [0.001 * v for v in [5, 1, 9, 3, 7, 2, 8, 100, 4, 6]]
    stats = latency_stats_ms(values_s)
    ref = np.array([5, 1, 9, 3, 7, 2, 8, 100, 4, 6], dtype=float)
    for p in (50, 90, 99):
        assert stats[f"p{p}"] == pytest.approx(np.percentile(ref, p))
    assert stats["mean"] == pytest.approx(ref.mean())
    one_to_100 = latency_stats_ms([0.001 * v for v in range(1, 101)])
    assert one_to_100["p50"] == pytest.approx(50.5)
    assert one_to_100["p90"] == pytest.approx(90.1)
    assert one_to_100["p99"] == pytest.approx(99.01)
    assert latency_stats_ms([None]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def test_kv_stats_aggregation_averages_every_numeric_leaf():
    stats = [{"footprint": 0.5, "kv_bytes_peak": 100, "policy": "x", "ok": True,
              "layers": [1, 3]},
             {"footprint": 0.25, "kv_bytes_peak": 300, "kv_bytes_saved": 7},
             None]
    agg = aggregate_kv_stats(stats)
    assert agg["requests"] == 2
    assert agg["mean"] == {"footprint": 0.375, "kv_bytes_peak": 200.0, "kv_bytes_saved": 7.0,
                           "layers.0": 1.0, "layers.1": 3.0}
    assert agg["count"]["kv_bytes_saved"] == 1
    assert numeric_leaves({"a": {"b": 2}, "c": "s", "d": False}) == {"a.b": 2.0}
    assert find_kv_stats({"kv_transfer_params": {"kv_stats": {"x": 1}}}) == {"x": 1}
    assert find_kv_stats({"kv_stats": {"y": 2}}) == {"y": 2}
    assert find_kv_stats({"choices": []}) is None


def test_parse_vllm_metrics():
    row = parse_vllm_metrics(metrics_text(3))
    assert row == {"kv_cache_usage": pytest.approx(0.3), "running": 2.0, "waiting": 1.0,
                   "preemptions": 6.0, "inference_seconds": pytest.approx(row["inference_seconds"])}
    assert row["inference_seconds"] > 0  # (the fake's summed request times: 1.5 x its clock)
    assert parse_vllm_metrics("other_metric 1\n") == {}


def test_tree_rss_of_own_process():
    assert tree_rss_bytes(os.getpid()) > 10 * 2**20


# ---------------------------------------------------------------- loopback

def test_loopback_only_by_default():
    for url in ("http://127.0.0.1:8000", "http://localhost:8000/", "http://127.1.2.3:1",
                "http://[::1]:8000", "http://LOCALHOST:8000/v1"):
        assert check_base_url(url).startswith("http")
    assert check_base_url("http://localhost:8000/v1/") == "http://localhost:8000"
    for url in ("http://10.0.0.5:8000", "http://example.com:8000", "http://128.0.0.1",
                "http://localhost.example.com", "http://0.0.0.0:8000"):
        with pytest.raises(RemoteURLError):
            check_base_url(url)
    assert check_base_url("http://10.0.0.5:8000", allow_remote=True) == "http://10.0.0.5:8000"
    assert is_loopback_host("::ffff:127.0.0.1")
    with pytest.raises(ValueError):
        check_base_url("127.0.0.1:8000")


def test_cli_refuses_remote_url(capsys):
    with pytest.raises(SystemExit) as exc:
        run_cli.main(["--base-url", "http://192.168.1.10:8000", "--model", "m",
                      "--tokenizer", "/nonexistent"])
    assert exc.value.code == 2
    assert "--allow-remote" in capsys.readouterr().err


# ---------------------------------------------------------------- runs against the fake server

def test_ok_and_rejected_counting(server):
    prompts = prompts_of([10, PROMPT_LIMIT + 1, 20, 5000, 30], output_len=6)
    data = run(prompts, settings(server, concurrency=2))
    by_index = {r.index: r for r in data.results}
    assert [by_index[i].outcome for i in range(5)] == ["ok", "rejected", "ok", "rejected", "ok"]
    assert by_index[1].http_status == 400 and by_index[1].error_type == "HTTP 400"
    assert "maximum context length" in by_index[1].error
    ok = by_index[0]
    assert ok.output_tokens == 6 and ok.input_tokens == 10
    assert 0 < ok.ttft_s <= ok.e2e_s
    assert ok.tpot_s == pytest.approx((ok.e2e_s - ok.ttft_s) / 5)
    assert len(ok.itl_s) == 5
    assert ok.kv_stats["kv_bytes_peak"] == 1000
    result = build_result({"workload": "rag", "concurrency": 2}, data)
    assert result["requests"] == {"total": 5, "sent": 5, "ok": 3, "rejected": 2, "failed": 0,
                                  "cancelled": 0, "not_sent": 0}
    assert result["tokens"] == {"input": 60, "output": 18}
    assert result["errors"] == {"HTTP 400": 2}
    assert result["kv_stats"]["mean"]["kv_bytes_peak"] == pytest.approx(2000)
    assert result["kv_stats"]["mean"]["layers.1"] == 3


def test_server_errors_and_connection_errors_are_failures(server):
    data = run(prompts_of([4, 4]), settings(server, model="boom", scrape_metrics=False))
    assert {(r.outcome, r.http_status) for r in data.results} == {("failed", 500)}
    data = run(prompts_of([4]), settings(server, model="streamerr", scrape_metrics=False))
    assert data.results[0].outcome == "failed"
    assert data.results[0].error_type == "stream error 500"
    assert data.results[0].error == "engine died"
    with socket.socket() as s:  # a port that nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    data = run(prompts_of([4]), LoadSettings(base_url=dead, model="m", progress=False,
                                             max_duration_s=5))
    assert data.results[0].outcome == "failed"
    assert data.results[0].error_type == "ConnectError"
    assert data.metrics["scrapes"] == 0 and data.metrics["scrape_errors"] >= 2


def test_kv_stats_inside_kv_transfer_params(server):
    data = run(prompts_of([8, 16]), settings(server, model="transfer", scrape_metrics=False))
    assert [r.kv_stats["kv_bytes_peak"] for r in data.results] == [800, 1600]


def test_num_requests_bounds_the_run(server):
    prompts = prompts_of([8] * 7, output_len=3)
    data = run(prompts, settings(server, concurrency=3))
    assert len(data.results) == 7
    assert sorted(r.index for r in data.results) == list(range(7))  # each prompt sent once
    assert all(r.ok for r in data.results)


def test_max_duration_bounds_the_run(server):
    start = time.monotonic()
    data = run(prompts_of([8] * 50), settings(server, model="hang", concurrency=4,
                                              max_duration_s=0.5))
    took = time.monotonic() - start
    assert took < 3.0
    assert data.duration_s == pytest.approx(0.5, abs=0.5)
    assert len(data.results) == 4  # the first wave; nothing new starts after the deadline
    assert {r.outcome for r in data.results} == {"cancelled"}
    result = build_result({}, data)
    assert result["requests"]["cancelled"] == 4 and result["requests"]["not_sent"] == 46


def test_request_timeout_is_a_failure_not_a_cancellation(server):
    data = run(prompts_of([8] * 2), settings(server, model="hang", concurrency=2,
                                             request_timeout_s=0.3, max_duration_s=10))
    assert data.duration_s < 2.0
    assert {(r.outcome, r.error_type) for r in data.results} == {("failed", "RequestTimeout")}


def test_max_duration_bounds_a_slow_stream(server):
    # 2000 tokens at >= 2 ms each take >= 4 s; the 0.4 s bound must cut them off.
    data = run(prompts_of([8] * 3, output_len=2000), settings(server, concurrency=3,
                                                               max_duration_s=0.4))
    assert data.duration_s < 2.0
    assert all(r.outcome == "cancelled" and r.ttft_s is not None for r in data.results)


def test_poisson_arrivals(server):
    offsets = poisson_arrivals(200, rate=50.0, seed=3)
    assert offsets[0] == 0 and np.all(np.diff(offsets) >= 0)
    assert np.diff(offsets).mean() == pytest.approx(1 / 50, rel=0.25)
    assert np.array_equal(offsets, poisson_arrivals(200, rate=50.0, seed=3))
    data = run(prompts_of([8] * 10, output_len=3), settings(server, concurrency=None,
                                                            rate=100.0))
    assert len(data.results) == 10 and all(r.ok for r in data.results)
    starts = sorted(r.start_s for r in data.results)
    assert starts[-1] > 0  # spread out, not all at once
    with pytest.raises(ValueError):
        LoadSettings(base_url="http://127.0.0.1:1", model="m", concurrency=2, rate=1.0)


def test_metrics_and_memory_sampling(server):
    data = run(prompts_of([8] * 4, output_len=250),
               settings(server, concurrency=2, server_pid=os.getpid()))
    assert data.duration_s > 1.0
    m = data.metrics
    assert m["scrapes"] >= 3  # before, every second during, after
    assert m["preemptions"] == m["scrapes"] - 1  # fake counter grows by one per scrape
    # the fake's summed request times grow 1.5 s a second: 1.5 requests at once
    assert m["running_time_mean"] == pytest.approx(1.5, rel=0.1)
    assert 0 < m["kv_cache_usage_peak"] <= 1
    assert data.memory["peak_rss_bytes"] > 0 and len(data.memory["timeline"]) >= 3


# ---------------------------------------------------------------- CLI and JSON output

RUN_KEYS = {"schema", "config", "started_at", "duration_s", "requests", "tokens", "throughput",
            "latency_ms", "kv_stats", "errors", "server", "per_request"}


def test_cli_writes_json_result(server, tmp_path, capsys):
    out = tmp_path / "results.json"
    code = run_cli.main([
        "--base-url", server.base_url, "--model", "fake",
        "--tokenizer", str(_tiny_bpe_dir(tmp_path)), "--workload", "rag",
        "--input-len", "40", "--output-len", "4", "--concurrency", "2", "--num-requests", "5",
        "--max-duration", "20", "--seed", "0", "--server-pid", str(os.getpid()),
        "--no-progress", "--out", str(out)])
    assert code == 0
    stdout = capsys.readouterr().out
    assert "throughput" in stdout and "TTFT" in stdout and "kv_stats" in stdout
    result = json.loads(out.read_text())
    assert set(result) == RUN_KEYS
    assert result["schema"] == "loadtest.run/1"
    assert result["config"]["workload"] == "rag" and result["config"]["concurrency"] == 2
    assert result["config"]["shapes"] == [{"kind": "rag", "input_len": 40, "output_len": 4,
                                           "weight": 1.0}]
    assert result["requests"]["ok"] == 5
    assert result["tokens"] == {"input": 200, "output": 20}
    assert set(result["throughput"]) == {"requests_per_s", "input_tokens_per_s",
                                         "output_tokens_per_s", "total_tokens_per_s"}
    thr = result["throughput"]
    assert thr["total_tokens_per_s"] == pytest.approx(
        thr["input_tokens_per_s"] + thr["output_tokens_per_s"])
    assert thr["requests_per_s"] == pytest.approx(5 / result["duration_s"])
    for name in ("ttft", "tpot", "e2e", "itl"):
        assert set(result["latency_ms"][name]) == {"mean", "p50", "p90", "p99"}
        assert result["latency_ms"][name]["p50"] > 0
    assert set(result["server"]) == {"peak_rss_bytes", "kv_cache_usage_peak",
                                     "kv_cache_usage_mean", "preemptions",
                                     "metrics_timeline", "rss_timeline"}
    assert result["server"]["peak_rss_bytes"] > 0
    assert {"t", "kv_cache_usage", "preemptions", "running", "waiting"} <= \
        set(result["server"]["metrics_timeline"][0])
    assert result["kv_stats"]["requests"] == 5
    assert result["kv_stats"]["mean"]["footprint"] == pytest.approx(40 / PROMPT_LIMIT)
    assert len(result["per_request"]) == 5
    assert set(result["per_request"][0]) == {
        "index", "kind", "outcome", "http_status", "error_type", "error", "input_tokens",
        "output_tokens", "start_s", "ttft_ms", "tpot_ms", "e2e_ms", "kv_stats"}
    assert format_table(result)


# ---------------------------------------------------------------- cross-check

BENCH_OUTPUT = """
============ Serving Benchmark Result ============
Successful requests:                     16
Benchmark duration (s):                  12.34
Total input tokens:                      112000
Total generated tokens:                  1024
Request throughput (req/s):              1.30
Output token throughput (tok/s):         82.98
Peak output token throughput (tok/s):    150.00
Peak concurrent requests:                4.00
Total Token throughput (tok/s):          9159.00
---------------Time to First Token----------------
Mean TTFT (ms):                          500.12
==================================================
"""


def test_cross_check_parsing_and_tolerance():
    bench = crosscheck.parse_bench_output(BENCH_OUTPUT)
    assert bench["requests_per_s"] == 1.30
    assert bench["output_tokens_per_s"] == 82.98  # not the "Peak output" line
    assert bench["total_tokens_per_s"] == 9159.0
    assert bench["input_tokens_per_s"] == pytest.approx(9159.0 - 82.98)
    ours = {"requests_per_s": 1.25, "input_tokens_per_s": 9000.0,
            "output_tokens_per_s": 80.0, "total_tokens_per_s": 9080.0}
    check = crosscheck.compare_throughput(ours, bench, tolerance=0.10)
    assert check["within_tolerance"]
    ours["output_tokens_per_s"] = 60.0
    assert not crosscheck.compare_throughput(ours, bench)["within_tolerance"]
    with pytest.raises(ValueError):
        crosscheck.parse_bench_output("nothing here")
    argv = crosscheck.bench_serve_command(
        base_url="http://127.0.0.1:8000", model="m", tokenizer="/t", input_len=7000,
        output_len=64, num_prompts=16, concurrency=4)
    # (the vllm beside this interpreter: CI runs without an activated venv)
    assert argv[:3] == [VLLM, "bench", "serve"] and Path(VLLM).name == "vllm"
    assert argv[argv.index("--max-concurrency") + 1] == "4"
    assert argv[argv.index("--random-input-len") + 1] == "7000"


# ---------------------------------------------------------------- comparison

def test_policy_parsing_and_server_command():
    specs = [parse_policy(p) for p in ("full", "prulong:0.7", "pyramidkv:0.7:patched")]
    assert [s.label for s in specs] == ["full", "prulong:0.7", "pyramidkv:0.7:patched"]
    assert specs[2].slug == "pyramidkv-0.7-patched"
    for bad in ("", "snapkv:x", "snapkv:1.5", "snapkv:0.7:lazy", "a:0.1:patched:x"):
        with pytest.raises(ValueError):
            parse_policy(bad)
    argv = build_server_command("/models/m", specs[2], kv_cache_bytes=10**9,
                                max_batched_tokens=2048, port=8123)
    assert argv == [VLLM, "serve", "/models/m", "--kv-policy", "pyramidkv",
                    "--kv-sparsity", "0.7", "--kv-eviction", "patched",
                    "--kv-cache-memory-bytes", "1000000000", "--max-num-batched-tokens", "2048",
                    "--enforce-eager", "--host", "127.0.0.1", "--port", "8123"]
    assert "--kv-sparsity" not in build_server_command(
        "m", specs[0], kv_cache_bytes=1, max_batched_tokens=1)
    tiered = parse_policy("pyramidkv:0.7:patched:t6")
    assert tiered.tiers == 6 and tiered.slug == "pyramidkv-0.7-patched-t6"
    argv = build_server_command("m", tiered, kv_cache_bytes=1, max_batched_tokens=1)
    assert argv[argv.index("--kv-tiers") + 1] == "6"
    for bad in ("pyramidkv:0.7:patched:6", "pyramidkv:0.7:patched:t0",
                "snapkv:0.7:naive:d0", "snapkv:0.7:naive:d64e0", "snapkv:0.7:naive:e64"):
        with pytest.raises(ValueError):
            parse_policy(bad)
    decode = parse_policy("snapkv:0.7:naive:d512e64")
    assert decode.slug == "snapkv-0.7-naive-d512e64" and decode.decode_interval == 64
    argv = build_server_command("m", decode, kv_cache_bytes=1, max_batched_tokens=1)
    assert argv[argv.index("--kv-decode-budget") + 1] == "512"
    assert argv[argv.index("--kv-decode-interval") + 1] == "64"
    assert "--kv-decode-interval" not in build_server_command(
        "m", parse_policy("snapkv:0.7:naive:d512"), kv_cache_bytes=1, max_batched_tokens=1)
    assert compare.parse_levels("1,4, 8,16") == [1, 4, 8, 16]


def test_compare_starts_runs_and_stops_servers(tmp_path):
    """End to end with the fake server as a subprocess standing in for `vllm serve`."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tests_dir = str(Path(__file__).parent)
    repo_dir = str(Path(__file__).parent.parent)
    started = []

    def fake_command(model, spec, **kw):
        assert kw["port"] == port and kw["kv_cache_bytes"] == 12345
        started.append(spec.label)
        code = (f"import sys; sys.path[:0] = [{tests_dir!r}, {repo_dir!r}]; "
                f"import test_loadtest; test_loadtest.serve_forever({kw['port']})")
        return [sys.executable, "-c", code]

    probes = {}
    runs, failures = compare.run_comparison(
        policies=[parse_policy("full"), parse_policy("snapkv:0.7:patched")], levels=[1, 2],
        model="fake", tokenizer=WordTokenizer(), shapes=make_shapes("rag", 12, 3),
        num_requests=3, seed=0, out_dir=tmp_path, kv_cache_bytes=12345,
        max_batched_tokens=64, port=port, max_duration_s=20, progress=False,
        health_timeout_s=20, stop_timeout_s=5, command_fn=fake_command,
        requests_per_level=[2, 3], overlong_tokens=PROMPT_LIMIT + 1, probes=probes)
    assert failures == {}
    assert started == ["full", "snapkv:0.7:patched"]
    assert set(runs) == {"full", "snapkv:0.7:patched"}
    for per in runs.values():
        assert set(per) == {1, 2}
        assert per[1]["requests"]["ok"] == 2 and per[2]["requests"]["ok"] == 3
        for result in per.values():
            assert result["server"]["peak_rss_bytes"] > 0
            assert result["server"]["metrics_timeline"]
    # A prompt longer than the context is a clean 4xx, counted as rejected, never as failed.
    assert set(probes) == {"full", "snapkv:0.7:patched"}
    for probe in probes.values():
        assert probe["requests"]["rejected"] == 1 and probe["requests"]["failed"] == 0
        assert probe["errors"] == {"HTTP 400": 1}
    # --report-only rebuilds the same runs from the files written
    loaded, loaded_probes = compare.load_runs(
        tmp_path, [parse_policy("full"), parse_policy("snapkv:0.7:patched")], [1, 2, 3])
    assert {p: set(per) for p, per in loaded.items()} == {p: {1, 2} for p in runs}
    assert loaded["full"][2]["requests"] == runs["full"][2]["requests"]
    assert set(loaded_probes) == set(probes)
    assert "12-token prompt" not in " ".join(compare.probe_notes(loaded_probes))
    assert f"{PROMPT_LIMIT + 1}-token prompt" in compare.probe_notes(loaded_probes)[0]
    # Level i uses seed + i: a level never repeats the previous level's prompts.
    assert runs["full"][1]["config"]["seed"] == 0 and runs["full"][2]["config"]["seed"] == 1
    from vllm_kvevict.launch import port_in_use
    assert not port_in_use("127.0.0.1", port)  # the last server was stopped
    paths = compare.write_outputs(runs, failures, tmp_path, ["- note"])
    for name in ("summary.md", "summary.json", "throughput.png", "latency_p99.png",
                 "kv_usage.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert {p.name for p in paths} >= {"summary.md", "throughput.png"}
    assert (tmp_path / "full_c1.json").exists() and (tmp_path / "server_full.log").exists()
    md = (tmp_path / "summary.md").read_text()
    assert "| concurrency | full | snapkv:0.7:patched |" in md
    assert "kv_bytes_peak" in md


def test_comparison_markdown_marks_missing_levels():
    base = {"requests": {"ok": 1, "rejected": 0, "failed": 0, "cancelled": 0},
            "throughput": {"requests_per_s": 1.0, "output_tokens_per_s": 2.0,
                           "total_tokens_per_s": 3.0},
            "latency_ms": {k: {"p50": 1.0, "p99": 2.0} for k in ("ttft", "tpot", "e2e")},
            "server": {"peak_rss_bytes": None, "kv_cache_usage_peak": 0.5, "preemptions": 0},
            "kv_stats": {"mean": {}}}
    md = comparison_markdown({"full": {1: base, 4: base}, "prulong:0.7": {1: base}}, "T")
    assert "| 4 | 3.0 | - |" in md


# ---------------------------------------------------------------- multi-turn chat

def test_chat_turns_append_the_history_and_report_cache_hits(server, tmp_path):
    """Each turn sends the previous prompt + its answer ids + a new user text; the per-turn
    table reads cached tokens from the usage details; a run's summary and plot are written."""
    from loadtest.chat import ChatShape, plot_turns, run_chat, summary_markdown

    shape = ChatShape(conversations=3, turns=3, system_len=24, user_len=8, output_len=5)
    run = asyncio.run(run_chat(WordTokenizer(), shape, base_url=server.base_url, model="fake",
                               concurrency=2, max_duration_s=20.0))
    turns = run["turns"]
    assert [(x["conversation"], x["turn"]) for x in turns] == [(c, t) for c in range(3)
                                                                for t in (1, 2, 3)]
    assert all(x["outcome"] == "ok" and x["answer_ids"] == [1000, 1001, 1002, 1003, 1004]
               for x in turns)
    for c in range(3):
        lengths = [x["prompt_tokens"] for x in turns if x["conversation"] == c]
        assert lengths == [32, 32 + 5 + 8, 32 + 2 * (5 + 8)]  # the fake's limit is 64
    # turn 2 shares its whole previous prompt and answer: 37 tokens -> 32 in 16-token blocks
    assert all(x["cached_tokens"] == 32 for x in turns if x["turn"] == 2)
    rows = {r["turn"]: r for r in run["per_turn"]}
    assert rows[2]["hit_rate"] == pytest.approx(32 / 45)
    assert run["server"]["running_peak"] == 2.0  # the fake's gauge
    text = summary_markdown({"fake": run, "again": run}, "cmd")
    assert "| fake | 9/9 |" in text and "| 1.00 |" in text and "**again** per turn" in text
    plot_turns({"fake": run}, tmp_path / "turns.png")
    assert (tmp_path / "turns.png").stat().st_size > 10_000


def test_chat_turn_without_answer_ids_fails_and_ends_its_conversation(server):
    from loadtest.chat import ChatShape, run_chat

    shape = ChatShape(conversations=2, turns=3, system_len=24, user_len=8, output_len=5)
    run = asyncio.run(run_chat(WordTokenizer(), shape, base_url=server.base_url, model="noids",
                               concurrency=1, max_duration_s=20.0, scrape_metrics=False))
    assert [(x["conversation"], x["turn"], x["outcome"]) for x in run["turns"]] == [
        (0, 1, "failed"), (1, 1, "failed")]
    assert "return_token_ids" in run["turns"][0]["error"]


def test_chat_policy_labels():
    from loadtest.chat import server_argv

    argv, env = server_argv("M", "stock/nopc", kv_cache_bytes=1, chunk=64, port=1,
                            max_model_len=512)
    assert "--kv-policy" not in argv and "--no-enable-prefix-caching" in argv
    assert env == {"VLLM_PLUGINS": "no-such-plugin"}
    argv, env = server_argv("M", "prulong:0.7", kv_cache_bytes=1, chunk=64, port=1,
                            max_model_len=512)
    assert argv[argv.index("--kv-policy") + 1] == "prulong" and env == {}
    assert "--enable-prompt-tokens-details" in argv
    assert "--no-enable-prefix-caching" not in argv
    argv, _ = server_argv("M", "snapkv:0.7:naive/pc", kv_cache_bytes=1, chunk=64, port=1,
                          max_model_len=512)
    assert "--enable-prefix-caching" in argv and "--no-enable-prefix-caching" not in argv
    with pytest.raises(ValueError, match="nopc"):
        server_argv("M", "full/cache", kv_cache_bytes=1, chunk=64, port=1, max_model_len=512)
    with pytest.raises(ValueError, match="nopc"):
        server_argv("M", "full/pc/nopc", kv_cache_bytes=1, chunk=64, port=1, max_model_len=512)
    argv, _ = server_argv("M", "snapkv:0.7/reuse/c128", kv_cache_bytes=1, chunk=64, port=1,
                          max_model_len=512)
    assert argv[-5:] == ["--enable-prefix-caching", "--kv-prefix-reuse", "across-questions",
                         "--kv-eviction-chunk", "128"]


def test_soak_checks_and_table(tmp_path):
    """loadtest/soak.py: each failed check is named, and the table has a row per record."""
    import json
    from dataclasses import asdict

    from loadtest.soak import SoakResult, check, report

    good = SoakResult(requests=10, completed=6, engine_requests_completed=7, cancelled=2, bad=2,
                      bad_answered_4xx=2, recorded_delta=8,
                      finish_reasons_delta={"length": 6, "abort": 2}, pool_usage_after=0.0,
                      blocks_used_after=[0, 0], preemptions=3.0, probe_same=True,
                      healthy_after=True, duration_s=1.5)
    assert check(good) == []
    bad = SoakResult(**{**asdict(good), "recorded_delta": 10, "blocks_used_after": [0, 2],
                        "without_kv_stats": ["stop:cmpl-1"], "server_errors": ["HTTP 500"],
                        "probe_same": False})
    failures = " | ".join(check(bad))
    for needle in ("5xx", "without kv_stats", "recorded 10 requests, expected 7..9",
                   "pool not empty", "probe", "finish reasons"):
        assert needle in failures, (needle, failures)
    (tmp_path / "x.json").write_text(json.dumps({"mechanism": "x", **asdict(good)}))
    table = report(tmp_path)
    assert table.count("\n") == 3 and "| x | 10 | 6 (7) | 2 | 2 -> 2 | 0 | 0 | 8 (abort 2, " \
        "length 6) | 3 | usage 0, 0 in every group | True | True | 1.5 |" in table, table


def test_a_decode_pair_round_judges_the_policy_against_that_rounds_stock_fit():
    """loadtest.decode_pairs: a round's limit is stock's c0 + k x the policy's held bytes,
    both fitted on that round's stock runs (short and long context); a policy that holds
    stock's bytes is at 1.00 of a limit of 1.00, one that holds none at c0 / stock."""
    from types import SimpleNamespace

    from loadtest.decode_pairs import STOCK_BLOCK, round_ratios
    from loadtest.limits import full_bytes

    args = SimpleNamespace(short_input_len=128, input_len=7000, batch_input_len=4000,
                           output_len=256, batch=8)
    per_tok = 46080
    long1 = full_bytes(7256, STOCK_BLOCK, per_tok)
    longB = 8 * full_bytes(4256, STOCK_BLOCK, per_tok)
    short1 = full_bytes(384, STOCK_BLOCK, per_tok)
    shortB = 8 * short1
    # stock: 20 ms + 10 ms per GB at batch 1, 40 ms + 70 ms per GB at batch 8
    s = {"short_b1_tpot_s": 0.020 + 1e-11 * short1, "b1_tpot_s": 0.020 + 1e-11 * long1,
         "short_batch_step_s": 0.040 + 7e-11 * shortB, "batch_step_s": 0.040 + 7e-11 * longB}
    same = {"b1_tpot_s": s["b1_tpot_s"], "b1_kv_bytes_end": long1,
            "batch_step_s": s["batch_step_s"], "batch_kv_bytes_end": longB}
    r = round_ratios(s, same, args, per_tok, STOCK_BLOCK)
    for key in ("b1", "batch"):
        assert r[key]["limit_x_stock"] == pytest.approx(1.0)
        assert r[key]["measured_over_limit"] == pytest.approx(1.0)
    half = {"b1_tpot_s": 0.020 + 1e-11 * long1 / 2 * 1.1, "b1_kv_bytes_end": long1 / 2,
            "batch_step_s": 0.040, "batch_kv_bytes_end": 0}
    r = round_ratios(s, half, args, per_tok, STOCK_BLOCK)
    assert r["batch"]["limit_x_stock"] == pytest.approx(0.040 / s["batch_step_s"])
    assert r["batch"]["measured_over_limit"] == pytest.approx(1.0)
    assert r["b1"]["measured_over_limit"] == pytest.approx(
        (0.020 + 1e-11 * long1 / 2 * 1.1) / (0.020 + 1e-11 * long1 / 2))


def test_capacity_report_names_each_policys_crossover(tmp_path):
    """loadtest.capacity's report: the crossover is the largest pool at which the policy
    serves more output tokens/s than stock (none when it never does); table and PNG written."""
    from loadtest import capacity

    def row(policy, pool, tok_s, kv=None):
        lat = {"p50": 1000.0 * pool, "p99": 2000.0 * pool}
        return {"policy": policy, "pool_requests": pool, "requests": 8, "ok": 8,
                "input_len": 4000, "output_len": 64, "out_tok_s": tok_s, "e2e_ms": lat,
                "ttft_ms": lat, "running_peak": pool, "running_mean": pool / 2,
                "preemptions": 0, "kv_bytes_vs_full": kv}
    rows = [row("stock", 1, 10), row("stock", 2, 20), row("stock", 8, 40),
            row("prulong:0.7", 1, 25, 0.4), row("prulong:0.7", 2, 30, 0.4),
            row("prulong:0.7", 8, 38, 0.4), row("full", 1, 9, 1.0), row("full", 2, 19, 1.0)]
    assert capacity.crossover(rows, "prulong:0.7") == 2
    assert capacity.crossover(rows, "full") is None
    text = capacity.report(rows, tmp_path, 4000)
    assert "| prulong:0.7 | 2 |" in text and "| full | never, in the measured range |" in text
    rows.append(row("full", 8, 41))  # within the noise band: not a win
    assert capacity.crossover(rows, "full") is None
    rows[-1] = row("full", 8, 43)  # beats stock at the largest pool only
    assert "| full | 8 (the largest measured: it pays at every pool) |" in capacity.report(
        rows, tmp_path, 4000)
    rows.pop()
    text = capacity.report(rows, tmp_path, 4000)
    assert "| prulong:0.7 | 1 | 8/8 | 1 / 0.5 | 25.0 | 2.50 |" in text
    assert (tmp_path / "table-4000.md").read_text() == text
    assert (tmp_path / "capacity-4000.png").stat().st_size > 0
    assert capacity.full_request_bytes(4064, 10) == 4096 * 10


def test_capacity_data_parallel_points_are_their_own_curve(tmp_path):
    """DP 2 points: each engine gets half the pool (plus its own null block); they are a curve
    of their own against stock at DP 2, and the report sets DP 2 beside DP 1 at each pool."""
    from loadtest import capacity

    def row(policy, pool, tok_s, dp):
        lat = {"p50": 1000.0, "p99": 2000.0 * dp}
        return {"policy": policy, "pool_requests": pool, "requests": 8, "ok": 8, "dp": dp,
                "input_len": 4000, "output_len": 64, "out_tok_s": tok_s, "e2e_ms": lat,
                "ttft_ms": lat, "running_peak": 4, "running_mean": 2.0 * dp,
                "preemptions": 0, "kv_bytes_vs_full": None}
    assert capacity.engine_pool_bytes(2, 4064, 10, 2) == 4096 * 10 + 128 * 10
    assert capacity.engine_pool_bytes(2, 4064, 10, 1) == 2 * 4096 * 10 + 128 * 10
    rows = [row("stock", 2, 10, 1), row("prulong:0.7", 2, 10.2, 1),
            row("stock", 2, 12, 2), row("prulong:0.7", 2, 15, 2)]
    assert capacity.series(rows[3]) == "prulong:0.7 DP2"
    # at DP 1 within the noise band; at DP 2 a win against DP 2's stock (not DP 1's)
    assert capacity.crossover(rows, "prulong:0.7") is None
    assert capacity.crossover(rows, "prulong:0.7 DP2") == 2
    text = capacity.report(rows, tmp_path, 4000)
    assert "| prulong:0.7 DP2 | 2 | 8/8 | 4 / 4.0 | 15.0 | 1.25 |" in text
    assert "| prulong:0.7 | 2 | 1 / 1 -> 2 / 1 | 10.2 -> 15.0 | 1.47 | 2.0 -> 4.0 | 2.0 -> 4.0 |" \
        in text
    assert "| stock DP2 |" not in text.split("crossover")[1]
    # two API servers at DP 2: a curve of its own, set beside one API server at DP 2
    rows += [{**row("stock", 2, 11, 2), "api_servers": 2},
             {**row("prulong:0.7", 2, 16, 2), "api_servers": 2}]
    assert capacity.series(rows[-1]) == "prulong:0.7 DP2 2 API"
    text = capacity.report(rows, tmp_path, 4000)
    assert "| prulong:0.7 DP2 2 API | 2 | 8/8 | 4 / 4.0 | 16.0 | 1.45 |" in text
    assert "| prulong:0.7 | 2 | 2 / 1 -> 2 / 2 | 15.0 -> 16.0 | 1.07 |" in text
