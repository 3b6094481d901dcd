"""`python -m loadtest.pareto` (issue 88): the logic against a fake OpenAI server (streamed
completions with kv_stats, vLLM's gauges), the report's flags and frontier, resumability, and
one tiny point served by the real `vllm serve` (CI)."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
from fastapi import Request  # (module level: FastAPI resolves the handler's annotation here)

from loadtest import pareto
from loadtest.client import RequestResult
from vllm_kvevict.launch import free_port


def result(tokens: int, ttft: float = 0.1, e2e: float = 0.5, held: int = 50,
           full: int = 100, heads: int | None = None) -> RequestResult:
    return RequestResult(index=0, kind="pareto", outcome="ok", output_tokens=tokens,
                         input_tokens=100,
                         ttft_s=ttft, e2e_s=e2e,
                         kv_stats={"kv_bytes_peak": held, "full_kv_bytes_peak": full,
                                   "kv_bytes_peak_in_heads": held if heads is None else heads})


ITEMS = [pareto.Item((1, 2, 3), 8, ("blue",)), pareto.Item((4, 5), 8, ("green",))]


def test_a_point_counts_accuracy_throughput_length_and_the_bytes_evicted():
    rows = pareto.summarize("prulong:0.7", 0.5, 1 << 20, ITEMS,
                            [result(5, held=30, heads=25), result(3, held=20, heads=15)],
                            ["the sky is blue", "red"], {"running_peak": 2, "running_mean": 1.5,
                                                        "preemptions": 1}, wall=2.0)
    assert rows["accuracy"] == 0.5 and rows["scores"] == [1.0, 0.0]
    assert rows["accuracy_ci"] == (0.0, 1.0)
    assert rows["out_tok_s"] == 4.0 and rows["mean_output_tokens"] == 4.0
    assert rows["tok_s"] == 104.0  # (200 prompt + 8 output tokens in 2 s)
    assert rows["tpot_ms"]["p50"] == pytest.approx(150)  # (0.4 s over 4 and over 2 tokens)
    assert rows["kv_bytes_vs_full"] == 0.25 and not pareto.evicted_nothing(rows)
    assert rows["kv_heads_vs_full"] == 0.2 and pareto.eviction_ran(rows)
    assert rows["preemptions"] == 1 and rows["failed"] == []


def test_a_policy_that_saved_no_byte_is_flagged_and_stock_is_the_baseline():
    def row(point, tok_s, acc, held=0.5, pool=0.25, heads=None):
        return {"point": point, "pool_fraction": pool, "out_tok_s": tok_s, "accuracy": acc,
                "tok_s": 50.0 if point == "stock" else 60.0,
                "accuracy_ci": None, "mean_output_tokens": 10.0, "running_peak": 2,
                "running_mean": 1.0, "ttft_ms": {"p50": 1, "p99": 2},
                "tpot_ms": {"p50": 1, "p99": 2}, "preemptions": 0, "kv_bytes_vs_full": held,
                "kv_heads_vs_full": held if heads is None else heads, "failed": []}
    rows = [row("stock", 10.0, 0.9, held=1.0), row("prulong:0.7", 14.0, 0.85),
            row("snapkv:0.7:patched", 12.0, 0.8), row("duo:0.7", 13.0, 0.9, held=1.0),
            row("streaming:0.5", 9.0, 0.5, held=1.02, heads=0.9)]
    assert pareto.evicted_nothing(rows[3]) and not pareto.evicted_nothing(rows[0])
    assert [r["point"] for r in pareto.frontier(rows)] == ["duo:0.7", "prulong:0.7"]
    text = pareto.table(rows)
    assert "| stock | 0.900 | +0.000 | 10.0 | 1.00x | 50 (1.00x) |" in text
    assert "| prulong:0.7 | 0.850 | -0.050 | 14.0 | 1.40x | 60 (1.20x) |" in text
    assert text.split("| duo:0.7 |")[1].splitlines()[0].endswith(
        "| 1.00 (1.00) | no: **no bytes saved** |")
    # eviction ran (the heads held less) but the pool's page rounding gave nothing back
    assert not pareto.evicted_nothing(rows[0]) and pareto.eviction_ran(rows[4])
    assert text.split("| streaming:0.5 |")[1].splitlines()[0].endswith(
        "| 1.02 (0.90) | yes, but **no bytes saved** (page rounding) |")


def test_pool_sizes_are_fractions_of_the_bursts_full_attention_kv():
    items = [pareto.Item(tuple(range(200)), 56), pareto.Item(tuple(range(100)), 28)]
    per_token = 1000
    assert pareto.burst_full_bytes(items, per_token) == (2 + 1) * 128 * per_token
    assert pareto.pool_bytes(1.0, items, per_token) == (3 + 1) * 128 * per_token
    # never below one request's worst case (vLLM would refuse to start)
    assert pareto.pool_bytes(0.1, items, per_token) == (2 + 1) * 128 * per_token


# -- a fake OpenAI server: streamed completions with kv_stats, vLLM's gauges ---------------------

def fake_server() -> tuple[str, threading.Thread, object]:
    import uvicorn
    from fastapi import FastAPI
    from fastapi.responses import PlainTextResponse, StreamingResponse

    app = FastAPI()
    running = {"n": 0}

    @app.post("/v1/completions")
    async def complete(request: Request):
        body = await request.json()
        assert body["stream"] and body["return_token_ids"] and "ignore_eos" not in body

        async def events():
            running["n"] += 1
            for tid in (42, 43):
                await asyncio.sleep(0.05)
                yield "data: " + json.dumps({"choices": [{"text": "x", "token_ids": [tid]}]}) + "\n\n"
            running["n"] -= 1
            yield "data: " + json.dumps({"choices": [], "usage": {
                "prompt_tokens": len(body["prompt"]), "completion_tokens": 2},
                "kv_stats": {"kv_bytes_peak": 30, "full_kv_bytes_peak": 100,
                             "kv_bytes_peak_in_heads": 30}}) + "\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(f'vllm:num_requests_running{{model_name="m"}} {running["n"]}\n'
                                 'vllm:num_preemptions_total{model_name="m"} 0\n')

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}", thread, server


class FakeTokenizer:
    def encode(self, text):
        return [ord(c) % 200 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "blue" if ids == [42, 43] else ""


def test_the_command_measures_each_point_once_and_resumes(tmp_path, monkeypatch):
    """Against the fake server: every point measured once; a rerun measures nothing; a new
    point only that one. Each point's accuracy from the answers, its bytes from kv_stats."""
    base, _, server = fake_server()
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p, "answers": ["blue"]})
                                 for p in ("what colour is the sky?", "and the sea?")) + "\n")
    measured = []

    def fake_measure(point, fraction, items, args, tok, per_token):
        measured.append((point, fraction))
        results, gauges, wall = asyncio.run(pareto.burst(base, items))
        texts = [tok.decode(r.token_ids) for r in results]
        return pareto.summarize(point, fraction, 1, items, results, texts, gauges, wall)

    monkeypatch.setattr(pareto, "measure", fake_measure)
    monkeypatch.setattr(pareto, "model_bytes", lambda model: (0, 1000))
    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained",
                        lambda *a, **k: FakeTokenizer())
    argv = ["--model", str(tmp_path), "--prompts", str(prompts), "--out-dir", str(tmp_path / "o"),
            "--points", "stock", "prulong:0.7", "--pools", "0.5"]
    try:
        assert pareto.main(argv) == 0
        assert measured == [("stock", 0.5), ("prulong:0.7", 0.5)]
        assert pareto.main(argv) == 0 and len(measured) == 2  # resumed: nothing again
        assert pareto.main([*argv[:-4], "stock", "prulong:0.7", "--pools", "0.5", "1"]) == 0
        assert measured[2:] == [("stock", 1.0), ("prulong:0.7", 1.0)]
    finally:
        server.should_exit = True
    rows = json.loads((tmp_path / "o" / "points.json").read_text())
    assert len(rows) == 4 and all(r["accuracy"] == 1.0 and r["ok"] == 2 for r in rows)
    assert all(r["kv_bytes_vs_full"] == 0.3 and r["mean_output_tokens"] == 2 for r in rows)
    text = (tmp_path / "o" / "table.md").read_text()
    assert text.startswith("# Pareto") and "Commit: " in text
    assert text.count("| prulong:0.7 | 1.000 [1.00, 1.00] | +0.000 |") == 2
    assert (tmp_path / "o" / "pareto.png").stat().st_size > 0


def test_bad_points_and_pools_are_refused_naming_the_flag(tmp_path):
    with pytest.raises(SystemExit, match="--pools"):
        pareto.parse(["--pools", "0"])
    with pytest.raises(SystemExit, match="--mask 'duo=/no/such.json'"):
        pareto.parse(["--mask", "duo=/no/such.json"])
    with pytest.raises(SystemExit, match="--points 'snapkv:x'"):
        pareto.main(["--points", "snapkv:x", "--out-dir", str(tmp_path)])


@pytest.mark.server
def test_one_tiny_point_served_by_vllm(tmp_path, bundled_model_dir):
    """One real point (prulong 0.7, the pool at half the burst's full-attention KV): served,
    scored, and its kv_stats show the bytes a head mask saves."""
    prompts = tmp_path / "prompts.jsonl"
    # ~1,000 tokens: past a streaming head's sink + window, so its pages go back to the pool
    notes = " ".join(["The river runs past the old stone mill."] * 100)
    prompts.write_text("\n".join(json.dumps({"prompt": f"{notes} The password is {w}. What is "
                                                       f"the password?", "answers": [w],
                                             "max_tokens": 8})
                                 for w in ("apple", "cedar")) + "\n")
    out = tmp_path / "out"
    assert pareto.main(["--points", "prulong:0.7", "--pools", "0.5", "--prompts", str(prompts),
                        "--chunk", "256", "--port", str(free_port()), "--out-dir", str(out)]) == 0
    [row] = json.loads((out / "points.json").read_text())
    assert row["ok"] == 2 and row["failed"] == [] and row["accuracy"] is not None
    assert 0 < row["kv_bytes_vs_full"] < 1 and not pareto.evicted_nothing(row)
    assert pareto.eviction_ran(row) and row["kv_heads_vs_full"] <= row["kv_bytes_vs_full"]
    assert row["running_peak"] is not None and row["mean_output_tokens"] > 0
