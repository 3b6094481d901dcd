"""kv_stats end to end on `vllm serve` (official openai client): every field of a ~700-token
request under `streaming`, its footprint recomputed here from the paper's formula for the chunk
boundaries vLLM reports, chat and streamed responses, /v1/kv_stats behind --api-key, the
Prometheus series, vllm_xargs refused with HTTP 400, and `full` holding exactly full attention's
bytes. Unit tests without a server: test_kv_stats_unit.py."""

from __future__ import annotations

import httpx
import openai
import pytest

from conftest import SERVED_NAME, pool_width, start_server

pytestmark = pytest.mark.server

API_KEY = "kvevict-test-key"
SINK, WINDOW, CHUNK = 16, 64, 256
PROMPT = "The quick brown fox jumps over the lazy dog. " * 70 + "What does the fox do?"
MAX_TOKENS = 8
# The bundled model (float32 in these servers): 30 layers, 3 KV heads of dim 64.
LAYERS, KV_HEADS, HEAD_DIM, DTYPE_BYTES, BLOCK = 30, 3, 64, 4, 128

FIELDS = ("request_id", "policy", "params", "prompt_tokens", "completion_tokens",
          "chunk_boundaries", "decode_steps", "footprint", "peak_kv", "footprint_chunk_held",
          "kv_bytes_peak",
          "kv_bytes_integral", "full_kv_bytes_peak", "full_kv_bytes_integral",
          "measured_footprint", "kv_bytes_saved", "blocks_freed", "ttft_s",
          "prefill_tokens_per_s", "decode_tokens_per_s", "server_peak_rss_bytes")


def tri(x: int) -> int:
    return x * (x + 1) // 2


def paper_streaming_footprint(n: int, m: int, bounds: list[int], sink: int,
                              window: int) -> tuple[float, float]:
    """The paper's footprint and peak KV with every head streaming (h = 1), written out here
    independently of vllm_kvevict.footprint: a chunk [a, b) costs T(b - a) + (b - a)(Lw + Sk)
    with Lw = min(W, a), Sk = min(s, a - Lw); a decode step at length a costs 1 + Lw + Sk."""
    def held(a: int) -> int:
        lw = min(window, a)
        return lw + min(sink, a - lw)

    entries, peaks, a = 0, [], 0
    for b in bounds:
        entries += tri(b - a) + (b - a) * held(a)
        peaks.append(held(a) + b - a)
        a = b
    for step in range(m):
        entries += 1 + held(n + step)
    if m:
        peaks.append(1 + held(n + m - 1))
    return entries / tri(n + m), max(peaks) / (n + m)


def client(server, key: str = API_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=key)


@pytest.fixture(scope="module")
def streaming_server(bundled_model_dir):
    return start_server(bundled_model_dir, [
        "--kv-policy", "streaming", "--kv-sink", str(SINK), "--kv-window", str(WINDOW),
        "--max-num-batched-tokens", str(CHUNK), "--api-key", API_KEY])


@pytest.fixture(scope="module")
def completion(streaming_server):
    return client(streaming_server).completions.create(
        model=SERVED_NAME, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"ignore_eos": True})


def test_completion_reports_every_field_and_the_papers_footprint(streaming_server, completion):
    kv = completion.model_extra["kv_stats"]
    missing = [f for f in FIELDS if f not in kv]
    assert not missing, f"kv_stats lacks {missing}: {kv}"
    assert completion.model_extra.get("kv_transfer_params") is None  # moved to top level

    n, generated = completion.usage.prompt_tokens, completion.usage.completion_tokens
    assert 600 < n < 768 and generated == MAX_TOKENS
    assert kv["request_id"].startswith(completion.id)
    assert kv["policy"] == "streaming"
    assert (kv["params"]["sink"], kv["params"]["window"]) == (SINK, WINDOW)
    assert (kv["prompt_tokens"], kv["completion_tokens"]) == (n, generated)
    # vLLM's chunked prefill with a 256-token budget ran this lone prompt as 256/256/rest.
    assert kv["chunk_boundaries"] == [CHUNK, 2 * CHUNK, n]
    assert kv["decode_steps"] == generated - 1

    footprint, peak = paper_streaming_footprint(n, kv["decode_steps"], kv["chunk_boundaries"],
                                                SINK, WINDOW)
    assert abs(kv["footprint"] - footprint) < 1e-6
    assert abs(kv["peak_kv"] - peak) < 1e-6

    # Real bytes: pool blocks of the streaming heads' groups (each block the plan's width in
    # head pages x K, V x 128 x 64 x 4), less than full attention's, which is
    # ceil(tokens / 128) blocks of all heads.
    width = pool_width(streaming_server)
    assert kv["kv_bytes_peak"] == kv["blocks_held_peak"] * width * 2 * BLOCK * HEAD_DIM * DTYPE_BYTES
    full_block = LAYERS * 2 * BLOCK * KV_HEADS * HEAD_DIM * DTYPE_BYTES
    assert 0 < kv["kv_bytes_peak"] < kv["full_kv_bytes_peak"]
    assert 0 < kv["kv_bytes_integral"] < kv["full_kv_bytes_integral"]
    tokens = n + generated - 1
    assert kv["full_kv_bytes_peak"] == -(-tokens // BLOCK) * full_block
    assert kv["measured_footprint"] == pytest.approx(
        kv["kv_bytes_integral"] / kv["full_kv_bytes_integral"], rel=1e-12)
    assert kv["kv_bytes_saved"] == kv["full_kv_bytes_peak"] - kv["kv_bytes_peak"]
    # blocks that left the window went back to the pool (unless the prompt was a cache hit)
    assert kv["blocks_freed"] > 0 or kv["cached_tokens"], kv

    assert 0 < kv["ttft_s"] < 120
    assert kv["prefill_tokens_per_s"] > 0 and kv["decode_tokens_per_s"] > 0
    assert kv["server_peak_rss_bytes"] > 100 << 20


def test_stats_endpoints_need_the_api_key(streaming_server, completion):
    base = streaming_server.base_url
    assert httpx.get(base + "/v1/kv_stats").status_code == 401
    assert httpx.get(base + f"/v1/kv_stats/{completion.id}").status_code == 401
    auth = {"Authorization": f"Bearer {API_KEY}"}
    one = httpx.get(base + f"/v1/kv_stats/{completion.id}", headers=auth)
    assert one.status_code == 200 and one.json() == completion.model_extra["kv_stats"]
    assert httpx.get(base + "/v1/kv_stats/cmpl-unknown", headers=auth).status_code == 404
    summary = httpx.get(base + "/v1/kv_stats", headers=auth).json()
    assert summary["enabled"] is True and summary["policy"] == "streaming"
    agg = summary["aggregates"]
    assert agg["requests"] >= 1 and agg["requests_per_policy"]["streaming"] >= 1
    assert 0 < agg["mean_footprint"] <= 1 and agg["kv_bytes_saved"] > 0
    assert summary["recent"][0]["request_id"]


def test_chat_and_streamed_responses_carry_kv_stats(streaming_server):
    c = client(streaming_server)
    chat = c.chat.completions.create(model=SERVED_NAME, max_tokens=4, temperature=0,
                                     messages=[{"role": "user", "content": "Name a color."}])
    kv = chat.model_extra["kv_stats"]
    assert kv["request_id"] == chat.id and kv["prompt_tokens"] == chat.usage.prompt_tokens

    for stream in (
        c.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=4, temperature=0,
                             stream=True),
        c.chat.completions.create(model=SERVED_NAME, max_tokens=4, temperature=0, stream=True,
                                  messages=[{"role": "user", "content": "Say hi."}]),
    ):
        chunks = list(stream)
        last = chunks[-1]
        assert last.choices == [] and "kv_stats" not in chunks[0].model_extra
        kv = last.model_extra["kv_stats"]
        assert kv["request_id"].startswith(last.id) and kv["chunk_boundaries"]
        assert kv["footprint"] is not None and kv["kv_bytes_peak"] > 0


def test_prometheus_series(streaming_server, completion):
    text = httpx.get(streaming_server.base_url + "/metrics").text
    for series in ('vllm_kvevict_footprint_bucket{le="1.0",policy="streaming"}',
                   'vllm_kvevict_footprint_count{policy="streaming"}',
                   'vllm_kvevict_kv_bytes_saved_total{policy="streaming"}',
                   'vllm_kvevict_blocks_freed_total{policy="streaming"}'):
        assert series in text, series


@pytest.mark.parametrize("xargs, needle", [
    ({"kv_sparsity": 0.5}, "token-eviction"),      # streaming's layout is fixed at start-up
    ({"kv_sparsty": 0.5}, "unknown"),
    ({"mask_path": "/etc/passwd"}, "file path"),
    ({"sink": 4}, "server setting"),
])
def test_bad_vllm_xargs_is_a_400_and_the_server_keeps_serving(streaming_server, xargs, needle):
    c = client(streaming_server)
    with pytest.raises(openai.BadRequestError) as err:
        c.completions.create(model=SERVED_NAME, prompt="Hello", max_tokens=2,
                             extra_body={"vllm_xargs": xargs})
    assert err.value.status_code == 400 and needle in str(err.value)
    assert "kv_sparsity" in str(err.value) and "kv_obs_window" in str(err.value)
    ok = c.completions.create(model=SERVED_NAME, prompt="Hello", max_tokens=2,
                              extra_body={"vllm_xargs": {"other_extension": 1}})
    assert ok.choices[0].text is not None and ok.model_extra["kv_stats"]


def test_full_policy_holds_exactly_full_attention_bytes(bundled_model_dir):
    server = start_server(bundled_model_dir, ["--kv-policy", "full",
                                              "--max-num-batched-tokens", str(CHUNK)])
    r = client(server, "unused").completions.create(
        model=SERVED_NAME, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"ignore_eos": True})
    kv = r.model_extra["kv_stats"]
    n = r.usage.prompt_tokens
    assert kv["policy"] == "full" and kv["chunk_boundaries"] == [CHUNK, 2 * CHUNK, n]
    assert kv["kv_bytes_peak"] == kv["full_kv_bytes_peak"] > 0
    assert kv["kv_bytes_integral"] == kv["full_kv_bytes_integral"] > 0
    assert kv["measured_footprint"] == 1.0 and kv["kv_bytes_saved"] == 0
    assert abs(kv["footprint"] - 1.0) < 1e-12 and abs(kv["peak_kv"] - 1.0) < 1e-12
    assert kv["blocks_freed"] == 0
