"""kv_stats without a server: per-request byte accounting, vllm_xargs validation, the store's
aggregates and lookups, response shaping (JSON lift, SSE chunk) and the ASGI middleware, and the
Prometheus series. The served end-to-end checks are in test_kv_stats.py."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from server import responses
from server import store as stats_store
from vllm_kvevict.integration.entrypoints.api_server import ServerContext
from vllm_kvevict.overrides import check_vllm_xargs, effective_config
from vllm_kvevict.stats import ByteLayout, RequestRecord

BS = 128
GROUP_BPB = 1000       # bytes per held block
FULL_BPB = 30_000      # stock full attention, bytes per block


def record(prompt_len=700) -> RequestRecord:
    layout = ByteLayout(block_size=BS, group_bytes_per_block=(GROUP_BPB,),
                        full_bytes_per_block=FULL_BPB)
    return RequestRecord(request_id="r", prompt_len=prompt_len, arrival_time=100.0,
                         layout=layout)


def blocks(n: int, start: int = 1) -> set[int]:
    return set(range(start, start + n))


def test_record_chunks_bytes_and_timing():
    rec = record()
    # 700-token prompt in chunks of 256 (blocks of 128 held after each allocation), 3 decodes.
    steps = [(0, 256), (256, 256), (512, 188), (700, 1), (701, 1), (702, 1)]
    ends = []
    for i, (computed, n) in enumerate(steps):
        held = blocks(-(-(computed + n) // BS))
        ends.append(rec.on_step(computed, n, [held], now=101.0 + i))
        if ends[-1]:
            rec.on_first_token(104.0)
    assert ends == [False, False, True, False, False, False]
    assert rec.boundaries == [256, 512, 700]

    exp_bytes = [(-(-(c + n) // BS)) * GROUP_BPB for c, n in steps]
    exp_full = [(-(-(c + n) // BS)) * FULL_BPB for c, n in steps]
    stats = rec.finish(completion_tokens=4, now=107.0, policy_name="streaming", params={},
                       footprint_of=None)
    assert stats["kv_bytes_peak"] == max(exp_bytes)
    assert stats["kv_bytes_integral"] == sum(b * n for b, (_, n) in zip(exp_bytes, steps))
    assert stats["full_kv_bytes_peak"] == max(exp_full)
    assert stats["full_kv_bytes_integral"] == sum(b * n for b, (_, n) in zip(exp_full, steps))
    assert stats["measured_footprint"] == pytest.approx(
        stats["kv_bytes_integral"] / stats["full_kv_bytes_integral"])
    assert stats["kv_bytes_saved"] == max(exp_full) - max(exp_bytes)
    assert stats["decode_steps"] == 3 and stats["tokens_processed"] == 703
    assert stats["blocks_freed"] == 0 and stats["blocks_held_end"] == 6
    assert stats["full_blocks_end"] == 6
    assert stats["kv_bytes_end"] == exp_bytes[-1] and stats["full_kv_bytes_end"] == exp_full[-1]
    assert stats["ttft_s"] == pytest.approx(4.0)
    assert stats["queue_s"] == pytest.approx(1.0)
    assert stats["prefill_tokens_per_s"] == pytest.approx(700 / 3.0)
    assert stats["decode_tokens_per_s"] == pytest.approx(3 / 3.0)
    assert stats["e2e_s"] == pytest.approx(7.0)
    assert stats["footprint"] is None  # no policy given
    json.dumps(stats)


def test_record_counts_the_pool_plans_padding_apart():
    """Two groups whose blocks reserve 800 bytes, the second's layers filling 600 of them (the
    pool plan's padding): kv_bytes_* count the reservation, *_in_heads the heads' pages."""
    layout = ByteLayout(block_size=BS, group_bytes_per_block=(800, 800),
                        full_bytes_per_block=1_300, group_head_bytes_per_block=(800, 600))
    rec = RequestRecord(request_id="r", prompt_len=200, arrival_time=None, layout=layout)
    rec.on_step(0, 100, [blocks(1), blocks(1, 10)], now=1.0)
    rec.on_step(100, 100, [blocks(2), blocks(2, 10)], now=2.0)
    stats = rec.finish(completion_tokens=1, now=3.0, policy_name="prulong", params={},
                       footprint_of=None)
    assert stats["kv_bytes_peak"] == 3_200 > stats["full_kv_bytes_peak"] == 2_600
    assert stats["kv_bytes_peak_in_heads"] == 2_800
    assert stats["measured_footprint"] == pytest.approx((1_600 + 3_200) / (1_300 + 2_600))
    assert stats["measured_footprint_in_heads"] == pytest.approx((1_400 + 2_800) / 3_900)
    # a layout without the heads' bytes (one group, no padding): the same as the reservation
    plain = record().finish(completion_tokens=0, now=1.0, policy_name="full", params={},
                            footprint_of=None)
    assert plain["kv_bytes_peak_in_heads"] == plain["kv_bytes_peak"]


def test_record_counts_evicted_blocks_by_id_but_not_preemption():
    rec = record(prompt_len=600)
    rec.on_step(0, 256, [blocks(2)], now=1.0)            # blocks 1, 2
    rec.on_step(256, 256, [{1, 3, 4}], now=2.0)          # 2 evicted, 3, 4 new
    assert rec.blocks_freed == 1
    rec.on_step(512, 88, [{1, 3, 0 + 5}], now=3.0)       # 4 evicted (swapped for 5)
    assert rec.blocks_freed == 2
    rec.on_step(0, 256, [blocks(2, start=10)], now=4.0, preemptions=1)  # recompute: not eviction
    assert rec.blocks_freed == 2 and rec.preemptions == 1
    assert rec.boundaries == [256, 512, 600]


def test_record_counts_blocks_freed_and_reused_in_the_same_step():
    # vLLM 0.32 hands freed blocks out again first (LIFO): the request gives back 4-8 after its
    # first chunk and its second chunk's allocation gets 8, 7, 6 ... back.
    rec = record(prompt_len=512)
    rec.on_step(0, 256, [blocks(8)], now=1.0, new_ids=[list(range(1, 9))])
    rec.on_step(256, 256, [blocks(11)], now=2.0, new_ids=[[8, 7, 6, 5, 4, 9, 10, 11]])
    assert rec.blocks_freed == 5 and rec.blocks_held == 11


def test_record_canonical_chunks_whatever_the_steps():
    """Pool storage: the prompt is chunked at multiples of E (256) whatever steps vLLM runs;
    a prefix-cache hit is not a boundary; a preempted request's recompute adds nothing."""
    rec = record(prompt_len=700)
    rec.canonical_chunk = 256
    for computed, step in ((0, 200), (200, 56), (256, 300), (556, 144), (700, 1)):
        rec.on_step(computed, step, [blocks(1)], now=1.0)
    # (a first step shorter than E leaves no boundary: the second is no prefix-cache hit)
    assert rec.boundaries == [256, 512, 700] and rec.cached_tokens == 0
    for computed, step in ((0, 256), (256, 256), (512, 188)):  # preempted: recomputed
        rec.on_step(computed, step, [blocks(1)], now=2.0, preemptions=1)
    assert rec.boundaries == [256, 512, 700]
    hit = record(prompt_len=700)
    hit.canonical_chunk = 256
    hit.on_step(384, 128, [blocks(1)], now=1.0)  # served [0, 384) from the prefix cache
    hit.on_step(512, 188, [blocks(1)], now=1.0)
    assert hit.boundaries == [256, 512, 700] and hit.cached_tokens == 384


def test_record_prefix_cache_hit_is_a_first_chunk():
    rec = record(prompt_len=300)
    rec.on_step(256, 44, [blocks(3)], now=1.0)
    assert rec.boundaries == [256, 300] and rec.cached_tokens == 256


def test_footprint_is_reported_for_the_scheduled_chunks():
    from vllm_kvevict.config import KVPolicyConfig
    from vllm_kvevict.footprint import kv_footprint
    from vllm_kvevict.policies import build_policy
    from vllm_kvevict.stats import footprint_function

    policy = build_policy(KVPolicyConfig(policy="streaming", sink=4, window=8), 2, 2)
    rec = record(prompt_len=40)
    for computed, n in [(0, 16), (16, 16), (32, 8), (40, 1)]:
        rec.on_step(computed, n, [blocks(1)], now=1.0)
    stats = rec.finish(2, 2.0, "streaming", {}, footprint_function(policy))
    expected = kv_footprint(policy, 40, [16, 32, 40], 1)
    assert stats["footprint"] == expected.footprint and stats["peak_kv"] == expected.peak_kv
    held = kv_footprint(policy, 40, [16, 32, 40], 1, chunk_held=True)
    assert stats["footprint_chunk_held"] == held.footprint > expected.footprint


# -- vllm_xargs ---------------------------------------------------------------------------------

@pytest.mark.parametrize("xargs", [
    {"kv_sparsity": 0.5}, {"kv_sparsity": 0}, {"kv_sparsity": 1}, {"kv_obs_window": 32},
    {"kv_sparsity": 0.2, "kv_obs_window": 1}, {"session_id": "abc", "my_ext": [1, 2]},
    {"kv_transfer_params": {"x": 1}, "kv_cache_report_mode": "full"}, None, "not-a-dict",
])
def test_vllm_xargs_accepted_for_token_eviction(xargs):
    assert check_vllm_xargs(xargs, "snapkv", 8192) is None


@pytest.mark.parametrize("xargs, needle", [
    ({"kv_sparsity": 1.5}, "invalid"), ({"kv_sparsity": -0.1}, "invalid"),
    ({"kv_sparsity": "0.5"}, "invalid"), ({"kv_sparsity": True}, "invalid"),
    ({"kv_sparsity": float("nan")}, "invalid"), ({"kv_obs_window": 0}, "invalid"),
    ({"kv_obs_window": 64.0}, "invalid"), ({"kv_obs_window": "64"}, "invalid"),
    ({"kv_obs_window": 9000}, "invalid"), ({"kv_sparsty": 0.5}, "unknown"),
    ({"mask_path": "/etc/passwd"}, "file path"), ({"kv_mask": "x.json"}, "file path"),
    ({"sink": 4}, "server setting"), ({"kv_policy": "full"}, "server setting"),
])
def test_vllm_xargs_refused(xargs, needle):
    message = check_vllm_xargs(xargs, "snapkv", 8192)
    assert message is not None and needle in message
    assert "kv_sparsity" in message and "kv_obs_window" in message  # lists the valid keys


def test_vllm_xargs_overrides_need_a_token_eviction_policy():
    for policy in ("full", "streaming", "duo", "prulong"):
        message = check_vllm_xargs({"kv_sparsity": 0.5}, policy)
        assert message is not None and policy in message and "snapkv" in message
    assert check_vllm_xargs({"kv_obs_window": 16}, "pyramidkv") is None


def test_effective_config_applies_valid_overrides_only():
    from vllm_kvevict.config import KVPolicyConfig

    cfg = KVPolicyConfig(policy="snapkv", sparsity=0.7)
    eff, used = effective_config(cfg, {"kv_sparsity": 0.25, "kv_obs_window": 16, "x": 1})
    assert (eff.sparsity, eff.obs_window, used) == (0.25, 16, {"kv_sparsity": 0.25,
                                                                "kv_obs_window": 16})
    eff, used = effective_config(cfg, {"kv_sparsity": 7})  # invalid: ignored engine-side
    assert eff is cfg and used == {}
    eff, used = effective_config(KVPolicyConfig(policy="streaming"), {"kv_sparsity": 0.2})
    assert used == {}


# -- store and aggregates -----------------------------------------------------------------------

def stats(engine_id, external, policy="streaming", footprint=0.5, measured=0.25, peak=100,
          full=400, freed=0, integral=10, full_integral=40):
    return {"request_id": external, "engine_request_id": engine_id, "policy": policy,
            "footprint": footprint, "measured_footprint": measured, "kv_bytes_peak": peak,
            "full_kv_bytes_peak": full, "kv_bytes_saved": full - peak, "blocks_freed": freed,
            "kv_bytes_integral": integral, "full_kv_bytes_integral": full_integral,
            "ttft_s": 0.5}


def test_store_aggregates_and_lookups():
    store = stats_store.KVStatsStore(capacity=3)
    store.record(stats("cmpl-a-0-x1", "cmpl-a-0", footprint=0.2, measured=0.1), "cmpl-a-0")
    store.record(stats("cmpl-a-1-x2", "cmpl-a-1", footprint=0.4, measured=0.3), "cmpl-a-1")
    store.record(stats("chatcmpl-b-x3", "chatcmpl-b", policy="full", footprint=1.0,
                       measured=1.0, peak=400, freed=0, integral=40), "chatcmpl-b")
    store.record(stats("snap-x4", "snap", policy="snapkv", footprint=0.3, measured=0.35,
                       peak=150, freed=5), "snap")

    agg = store.aggregates()
    assert agg["requests"] == 4
    assert agg["requests_per_policy"] == {"streaming": 2, "full": 1, "snapkv": 1}
    assert agg["mean_footprint"] == pytest.approx((0.2 + 0.4 + 1.0 + 0.3) / 4)
    assert agg["kv_bytes_saved"] == 300 + 300 + 0 + 250
    assert agg["blocks_freed"] == 5
    assert agg["measured_footprint_pooled"] == pytest.approx((10 + 10 + 40 + 10) / 160)
    assert agg["per_policy"]["streaming"]["mean_measured_footprint"] == pytest.approx(0.2)
    assert agg["per_policy"]["full"]["kv_bytes_saved"] == 0

    # capacity 3: the oldest entry is gone from lookups but stays in the aggregates
    assert store.get("cmpl-a-0-x1") is None
    assert [s["engine_request_id"] for s in store.for_response("cmpl-a")] == ["cmpl-a-1-x2"]
    assert store.get("chatcmpl-b")["policy"] == "full"
    assert store.get("snap-x4")["blocks_freed"] == 5
    assert [s["engine_request_id"] for s in store.recent(10)] == [
        "snap-x4", "chatcmpl-b-x3", "cmpl-a-1-x2"]
    assert store.get("nope") is None


def test_store_response_id_forms():
    store = stats_store.KVStatsStore()
    for i in range(3):
        store.record(stats(f"cmpl-z-{i}-e", f"cmpl-z-{i}"), f"cmpl-z-{i}")
    store.record(stats("chatcmpl-y_0-e", "chatcmpl-y_0"), "chatcmpl-y_0")
    store.record(stats("chatcmpl-y_1-e", "chatcmpl-y_1"), "chatcmpl-y_1")
    assert len(store.for_response("cmpl-z")) == 3
    assert len(store.for_response("chatcmpl-y")) == 2
    assert store.get("cmpl-z")["engine_request_id"] == "cmpl-z-0-e"
    assert store.get("cmpl-z-2")["engine_request_id"] == "cmpl-z-2-e"


# -- response shaping ---------------------------------------------------------------------------

def test_lift_moves_kv_stats_to_top_level():
    body = {"id": "cmpl-1", "choices": [{}], "kv_transfer_params": {"kv_stats": {"a": 1}}}
    out = responses.lift_kv_stats(dict(body), [])
    assert out["kv_stats"] == {"a": 1} and out["kv_transfer_params"] is None
    body = {"id": "cmpl-1", "choices": [{}],
            "kv_transfer_params": {"kv_stats": {"a": 1}, "other": 2}}
    out = responses.lift_kv_stats(dict(body), [{"b": 2}, {"c": 3}])
    assert out["kv_stats"] == {"b": 2} and out["kv_transfer_params"] == {"other": 2}
    assert out["kv_stats_per_request"] == [{"b": 2}, {"c": 3}]
    assert responses.lift_kv_stats({"id": "x", "choices": []}, [])["kv_stats"] is None


def test_sse_rewriter_inserts_stats_chunk_before_done():
    events = [b'data: {"id":"cmpl-9","object":"text_completion","created":5,"model":"m",'
              b'"choices":[{"text":"a"}]}\n\n',
              b'data: {"id":"cmpl-9","choices":[{"text":"b"}]}\n\n', b"data: [DONE]\n\n"]
    raw = b"".join(events)
    seen = []
    rewriter = responses.SSERewriter(lambda rid: seen.append(rid) or [{"footprint": 0.5}])
    # split the stream at awkward places: events must come out whole and in order
    out = b"".join(rewriter.feed(raw[i:i + 7], final=i + 7 >= len(raw))
                   for i in range(0, len(raw), 7))
    parts = [p for p in out.split(b"\n\n") if p]
    assert parts[0] + b"\n\n" == events[0] and parts[1] + b"\n\n" == events[1]
    extra = json.loads(parts[2][len(b"data: "):])
    assert extra == {"id": "cmpl-9", "object": "text_completion", "created": 5, "model": "m",
                     "choices": [], "kv_stats": {"footprint": 0.5}}
    assert parts[3] == b"data: [DONE]" and seen == ["cmpl-9"]


def test_sse_rewriter_adds_nothing_to_a_stream_vllm_sent_no_chunk():
    """A request vLLM refuses while it drains (SIGTERM) streams `data: [DONE]` alone: no chunk
    of ours follows it (one had `id`, `object` and `model` null)."""
    rewriter = responses.SSERewriter(lambda rid: [{"footprint": 0.5}])
    assert rewriter.feed(b"data: [DONE]\n\n", final=True) == b"data: [DONE]\n\n"


def test_sse_rewriter_puts_every_requests_stats_in_the_usage_chunk():
    """With stream_options.include_usage, kv_stats ride in vLLM's final usage chunk (where
    OpenAI clients read usage), all of them for n > 1; no extra chunk follows."""
    usage = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    events = [b'data: {"id":"cmpl-9","object":"text_completion","created":5,"model":"m",'
              b'"choices":[{"index":0,"text":"a"}]}\n\n',
              b'data: {"id":"cmpl-9","object":"text_completion","created":5,"model":"m",'
              b'"choices":[],"usage":' + json.dumps(usage).encode() + b'}\n\n',
              b"data: [DONE]\n\n"]
    two = [{"index": 0, "footprint": 0.5}, {"index": 1, "footprint": 0.6}]
    rewriter = responses.SSERewriter(lambda rid: two if rid == "cmpl-9" else [])
    out = rewriter.feed(b"".join(events), final=True)
    parts = [p for p in out.split(b"\n\n") if p]
    assert len(parts) == 3 and parts[2] == b"data: [DONE]"
    last = json.loads(parts[1][len(b"data: "):])
    assert last["usage"] == usage and last["choices"] == []
    assert last["kv_stats"] == two[0] and last["kv_stats_per_request"] == two


# -- the middleware, on a fake inner app ---------------------------------------------------------

def _asgi_call(app, method, path, body=b"", headers=()):
    messages = []
    sent = False

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(3600)

    async def send(message):
        messages.append(message)

    scope = {"type": "http", "method": method, "path": path, "root_path": "",
             "headers": list(headers), "app": _FakeApp()}
    asyncio.run(app(scope, receive, send))
    status = messages[0]["status"]
    data = b"".join(m.get("body", b"") for m in messages[1:])
    return status, dict(messages[0]["headers"]), data


class _FakeApp:
    pass


@pytest.fixture(autouse=True)
def _served_context():
    """What the API-server adapter hands server/ at install time."""
    state = stats_store.ServerStats.get()
    state.context = ServerContext(policy="snapkv", max_model_len=8192, stats_enabled=True,
                                  stats_disabled_reason="")
    yield
    state.context = None


def _inner(kind):
    async def app(scope, receive, send):
        request = await receive()
        body = json.loads(request["body"])
        if kind == "json":
            content = json.dumps({"id": "cmpl-m", "choices": [{"text": "x"}],
                                  "echo_xargs": body.get("vllm_xargs"),
                                  "kv_transfer_params": {"kv_stats": {"footprint": 0.9}}})
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(content)).encode())]})
            await send({"type": "http.response.body", "body": content.encode()})
        else:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream")]})
            for part in (b'data: {"id":"cmpl-s","object":"text_completion","created":1,'
                         b'"model":"m","choices":[{"text":"x"}]}\n\n', b"data: [DONE]\n\n"):
                await send({"type": "http.response.body", "body": part, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
    return app


def test_middleware_refuses_bad_xargs_and_passes_good_ones_unchanged():
    mw = responses.KVStatsMiddleware(_inner("json"))
    status, _, data = _asgi_call(mw, "POST", "/v1/completions",
                                 json.dumps({"prompt": "x", "vllm_xargs": {"kv_sparsity": 2}}
                                            ).encode())
    error = json.loads(data)["error"]
    assert status == 400 and error["code"] == 400 and "kv_sparsity" in error["message"]
    good = {"kv_sparsity": 0.25, "kv_obs_window": 16, "other": "x"}
    status, headers, data = _asgi_call(
        mw, "POST", "/v1/chat/completions", json.dumps({"vllm_xargs": good}).encode())
    payload = json.loads(data)
    assert status == 200 and payload["echo_xargs"] == good
    assert payload["kv_stats"] == {"footprint": 0.9} and payload["kv_transfer_params"] is None
    assert int(headers[b"content-length"]) == len(data)


@pytest.mark.parametrize("messages, kind", [(None, "null"), (3, "int"), ("hi", "str"),
                                             ({"role": "user"}, "dict")])
def test_middleware_names_messages_that_are_not_a_list(messages, kind):
    """vLLM 0.32 answers these with "'NoneType' object is not iterable" and the like."""
    mw = responses.KVStatsMiddleware(_inner("json"))
    status, _, data = _asgi_call(mw, "POST", "/v1/chat/completions",
                                 json.dumps({"model": "m", "messages": messages}).encode())
    error = json.loads(data)["error"]
    assert status == 400 and error["param"] == "messages" and f"got {kind}" in error["message"]
    status, _, _ = _asgi_call(mw, "POST", "/v1/chat/completions",
                              json.dumps({"model": "m", "messages": []}).encode())
    assert status == 200  # a list: vLLM's to judge


def test_middleware_adds_stats_chunk_to_streams():
    state = stats_store.ServerStats.get()
    state.store.record({"request_id": "cmpl-s-0", "engine_request_id": "cmpl-s-0-e",
                        "policy": "snapkv", "footprint": 0.4}, "cmpl-s-0")
    mw = responses.KVStatsMiddleware(_inner("sse"))
    status, _, data = _asgi_call(mw, "POST", "/v1/completions", b'{"stream": true}')
    parts = [p for p in data.split(b"\n\n") if p]
    assert status == 200 and parts[-1] == b"data: [DONE]"
    last = json.loads(parts[-2][len(b"data: "):])
    assert last["choices"] == [] and last["kv_stats"]["footprint"] == 0.4


def test_middleware_ignores_other_routes():
    async def other(scope, receive, send):
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b'{"ok": 1}'})

    mw = responses.KVStatsMiddleware(other)
    assert _asgi_call(mw, "POST", "/v1/embeddings", b'{"vllm_xargs": {"kv_x": 1}}')[2] == \
        b'{"ok": 1}'
    assert _asgi_call(mw, "GET", "/v1/models")[0] == 200


# -- Prometheus ---------------------------------------------------------------------------------

def test_metrics_series():
    from prometheus_client import CollectorRegistry, generate_latest

    from server.metrics import KVEvictMetrics

    registry = CollectorRegistry()
    metrics = KVEvictMetrics(registry)
    metrics.observe({"policy": "snapkv", "footprint": 0.3, "measured_footprint": 0.4,
                     "kv_bytes_saved": 1000, "blocks_freed": 7, "finish_reason": "length"})
    metrics.observe({"policy": "snapkv", "footprint": 0.5, "kv_bytes_saved": -50,
                     "blocks_freed": 0, "finish_reason": "abort"})
    metrics.observe_pool("snapkv", {"blocks_used": [12, 3], "num_blocks": 100,
                                    "vllm_usage": 15 / 99})
    metrics.observe_pool("snapkv", {"blocks_used": [5, 1], "num_blocks": 80}, engine=1)
    text = generate_latest(registry).decode()
    assert 'vllm_kvevict_footprint_count{policy="snapkv"} 2.0' in text
    assert 'vllm_kvevict_footprint_sum{policy="snapkv"} 0.8' in text
    assert 'vllm_kvevict_kv_bytes_saved_total{policy="snapkv"} 1000.0' in text
    assert 'vllm_kvevict_blocks_freed_total{policy="snapkv"} 7.0' in text
    assert 'vllm_kvevict_requests_total{finish_reason="length",policy="snapkv"} 1.0' in text
    assert 'vllm_kvevict_requests_total{finish_reason="abort",policy="snapkv"} 1.0' in text
    # the engine core's index (data parallel), as vLLM labels its own series
    assert 'vllm_kvevict_pool_blocks_used{engine="0",group="1",policy="snapkv"} 3.0' in text
    assert 'vllm_kvevict_pool_blocks{engine="0",policy="snapkv"} 100.0' in text
    assert 'vllm_kvevict_pool_blocks_used{engine="1",group="1",policy="snapkv"} 1.0' in text
    assert 'vllm_kvevict_pool_blocks{engine="1",policy="snapkv"} 80.0' in text
    usage = re.search(r'vllm_kvevict_pool_usage_vllm\{engine="0",policy="snapkv"\} (\S+)', text)
    assert round(float(usage.group(1)) * 99) == 15


def test_engine_request_ids():
    """vLLM's engine ids: `<API id>-<8 hex>`, and `<i>_` before it for the n samples of one
    prompt (tests/test_vllm_contract.py pins both)."""
    from server.store import external_of, sibling_index

    assert external_of("cmpl-ab12-0-1a2b3c4d") == "cmpl-ab12-0"
    assert external_of("1_chatcmpl-77-deadbeef") == "chatcmpl-77"
    assert (sibling_index("1_chatcmpl-77-deadbeef"), sibling_index("cmpl-ab12-0-1a2b3c4d")) \
        == (1, 0)


def test_aborted_and_stop_string_requests_are_recorded_once_with_their_reason():
    """A stop string ends a request in the API server (finish "stop"), the engine sees an
    abort and sends the stats a step later with its scheduler stats; a client cancel is only
    the engine's abort. Both land in the store once, with the API server's reason winning."""
    from server import store as st

    st.ServerStats._instance = None
    state = st.ServerStats.get()
    try:
        st.record_output_finished("cmpl-1-0-aaaaaaaa", "cmpl-1-0", "stop", "\n\n")
        assert state.owes_stats("cmpl-1") and not state.owes_stats("cmpl-2")
        snap = {"t": 10.0, "blocks_used": [4], "num_blocks": 50, "group_names": ["g"],
                "bytes_per_block": [100], "block_size": 16,
                "requests": {"cmpl-2-0-bbbbbbbb": [400, 800]}}
        late = [{"engine_request_id": "cmpl-1-0-aaaaaaaa", "policy": "full",
                 "finish_reason": "abort", "kv_bytes_peak": 1},
                {"engine_request_id": "cmpl-2-0-bbbbbbbb", "policy": "full",
                 "finish_reason": "abort", "kv_bytes_peak": 2}]
        st.record_engine_stats({"snapshots": [snap], "finished": late}, 1, 0, 0.08)
        st.record_engine_stats({"finished": late[:1]}, 0, 0, 0.0)  # a duplicate: ignored
        assert not state.owes_stats("cmpl-1")
        one, two = state.store.get("cmpl-1-0"), state.store.get("cmpl-2-0")
        assert (one["finish_reason"], one["stop_reason"]) == ("stop", "\n\n")
        assert two["finish_reason"] == "abort" and two["request_id"] == "cmpl-2-0"
        agg = state.store.aggregates()
        assert agg["requests"] == 2
        assert agg["requests_per_finish_reason"] == {"stop": 1, "abort": 1}
        view = state.timeline.view(0.0)
        assert view["pool"]["num_blocks"] == 50 and view["samples"][0]["running"] == 1
        (trace,) = view["requests"]
        assert trace["request_id"] == "cmpl-2-0" and trace["points"] == [[10.0, 400, 800]]
        assert trace["finished"] and trace["finish_reason"] == "abort"
        assert state.timeline.view(10.0)["samples"] == []
        assert "engines" not in state.timeline_view(0.0)  # one engine core
    finally:
        st.ServerStats._instance = None


def test_data_parallel_engines_keep_their_own_timeline():
    """With data parallel each engine core's pool snapshots land in its own timeline (the
    stat logger passes vLLM's engine index); a finished request closes its trace in the
    timeline of the replica that served it (kv_stats carry `data_parallel_rank`)."""
    from server import store as st

    st.ServerStats._instance = None
    state = st.ServerStats.get()
    try:
        def snap(t, used, blocks, live):
            return {"t": t, "blocks_used": [used], "num_blocks": blocks, "group_names": ["g"],
                    "bytes_per_block": [100], "block_size": 16, "requests": live}

        st.record_engine_stats({"snapshots": [snap(1.0, 4, 50, {"cmpl-a-0-aaaaaaaa": [4, 8]})]},
                               1, 0, 0.1, engine=0)
        st.record_engine_stats({"snapshots": [snap(1.5, 7, 60, {"cmpl-b-0-bbbbbbbb": [7, 9]})]},
                               1, 0, 0.2, engine=1)
        view = state.timeline_view(0.0)
        assert view["pool"]["num_blocks"] == 50  # engine 0's at the top (the live page)
        assert sorted(view["engines"]) == ["0", "1"]
        one = view["engines"]["1"]
        assert one["pool"]["num_blocks"] == 60 and one["samples"][0]["blocks_used"] == [7]
        assert [r["request_id"] for r in one["requests"]] == ["cmpl-b-0"]
        st.record_engine_output("cmpl-b-0-bbbbbbbb", "cmpl-b-0", {"kv_stats": {
            "engine_request_id": "cmpl-b-0-bbbbbbbb", "policy": "full",
            "finish_reason": "length", "data_parallel_rank": 1}})
        (trace,) = state.timeline_view(0.0)["engines"]["1"]["requests"]
        assert trace["finished"] and trace["finish_reason"] == "length"
        assert not state.timeline_view(0.0)["engines"]["0"]["requests"][0]["finished"]
    finally:
        st.ServerStats._instance = None


def test_several_api_servers_share_what_each_records(tmp_path):
    """Two API servers on one log (`server/shared.py`): A ends a request by a stop string and
    its stats reach B with an engine step; another request's output reaches A while its copy
    reaches B. Both servers then hold every request once, A's stop reason, the same aggregates
    and timeline; the Prometheus series count each request once, in the process that wrote it."""
    from server import store as st

    class Observed:
        def __init__(self):
            self.requests, self.pools = [], 0

        def observe(self, stats):
            self.requests.append(stats["engine_request_id"])

        def observe_pool(self, *args):
            self.pools += 1

    def server():
        state = st.ServerStats()
        state.use_shared(str(tmp_path))
        state._metrics = Observed()
        return state

    a, b = server(), server()

    def on(state):
        st.ServerStats._instance = state

    try:
        on(a)
        st.record_output_finished("cmpl-1-0-aaaaaaaa", "cmpl-1-0", "stop", "\n")
        st.record_engine_output("cmpl-3-0-cccccccc", "cmpl-3-0", {"kv_stats": {
            "engine_request_id": "cmpl-3-0-cccccccc", "policy": "full",
            "finish_reason": "length"}})
        on(b)
        snap = {"t": 5.0, "blocks_used": [3], "num_blocks": 40, "group_names": ["g"],
                "bytes_per_block": [100], "block_size": 16, "requests": {}}
        copies = [{"engine_request_id": e, "policy": "full", "finish_reason": "abort"}
                  for e in ("cmpl-1-0-aaaaaaaa", "cmpl-2-0-bbbbbbbb", "cmpl-3-0-cccccccc")]
        st.record_engine_stats({"snapshots": [snap], "finished": copies}, 2, 1, 0.1)
        on(a)
        assert a.owes_stats("cmpl-1")  # nothing read from the log yet
        a.sync()
        assert not a.owes_stats("cmpl-1")
        for state in (a, b):
            one = state.store.get("cmpl-1")
            assert (one["finish_reason"], one["stop_reason"]) == ("stop", "\n")
            assert state.store.get("cmpl-3")["finish_reason"] == "length"  # the output's
            assert state.store.aggregates()["requests_per_finish_reason"] == {
                "stop": 1, "abort": 1, "length": 1}
            assert state.timeline.view(0.0)["samples"][0]["running"] == 2
        assert a._metrics.requests == ["cmpl-3-0-cccccccc"]
        assert b._metrics.requests == ["cmpl-1-0-aaaaaaaa", "cmpl-2-0-bbbbbbbb"]
        assert (a._metrics.pools, b._metrics.pools) == (0, 1)  # gauges: the receiver's
    finally:
        st.ServerStats._instance = None


# -- teacher-forced tail (vllm_xargs kv_teacher_forced) ------------------------------------------

@pytest.mark.parametrize("policy", ["full", "streaming", "duo", "prulong", "snapkv", "pyramidkv"])
def test_teacher_forced_is_a_request_key_of_every_policy(policy):
    assert check_vllm_xargs({"kv_teacher_forced": 8}, policy, 8192) is None
    assert check_vllm_xargs({"kv_teacher_forced": 0}, policy, 8192) is None
    for bad in (-1, 1.5, "8", True, 8192):
        message = check_vllm_xargs({"kv_teacher_forced": bad}, policy, 8192)
        assert message is not None and "kv_teacher_forced" in message and "invalid" in message


def test_policy_prompt_len_leaves_one_prompt_token():
    from vllm_kvevict.overrides import policy_prompt_len, teacher_forced

    assert policy_prompt_len(320, {"kv_teacher_forced": 10}) == 310
    assert policy_prompt_len(320, None) == policy_prompt_len(320, {}) == 320
    assert policy_prompt_len(5, {"kv_teacher_forced": 9}) == 1  # at least one prompt token
    assert teacher_forced({"kv_teacher_forced": -3}) == 0  # invalid: ignored engine side


def test_prefill_steps_stop_at_the_policy_prompt_end():
    from vllm_kvevict.config import KVPolicyConfig
    from vllm_kvevict.ledger import cap_step_in_eviction_chunk
    from vllm_kvevict.policies import build_policy

    policy = build_policy(KVPolicyConfig(policy="snapkv", sparsity=0.5), 30, 3)
    assert cap_step_in_eviction_chunk(policy, 310, 256, 64) == 54  # [256, 310), then the tail
    assert cap_step_in_eviction_chunk(policy, 310, 310, 10) == 10  # the tail: decode tokens
    assert cap_step_in_eviction_chunk(policy, 320, 256, 64) == 64
