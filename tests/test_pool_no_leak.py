"""Real memory bookkeeping: after a burst of requests of mixed lengths and settings, a fifth of
them cancelled mid-stream, every KV block is back in vLLM's pool (usage returns to 0)."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest

from conftest import SERVED_NAME, start_server

pytestmark = pytest.mark.server


def pool_usage(base_url: str) -> float:
    for line in httpx.get(base_url + "/metrics").text.splitlines():
        if line.startswith("vllm:kv_cache_usage_perc"):
            return float(line.split()[-1])
    raise AssertionError("vllm:kv_cache_usage_perc missing from /metrics")


async def burst(base_url: str, num_requests: int, seed: int, overrides) -> dict:
    rng = random.Random(seed)
    counts = {"done": 0, "cancelled": 0, "failed": 0}
    sem = asyncio.Semaphore(8)

    async def one(client, i):
        n = rng.randint(60, 700)  # up to 3 chunks of 256
        body = {"model": SERVED_NAME, "prompt": [rng.randint(100, 20000) for _ in range(n)],
                "max_tokens": 24, "temperature": 0, "stream": True, "ignore_eos": True}
        xargs = rng.choice(overrides)
        if xargs:
            body["vllm_xargs"] = xargs
        cancel = i % 5 == 0  # 20 %
        async with sem:
            try:
                async with client.stream("POST", base_url + "/v1/completions", json=body,
                                         timeout=600) as r:
                    if r.status_code != 200:
                        counts["failed"] += 1
                        return
                    chunks = 0
                    async for _ in r.aiter_lines():
                        chunks += 1
                        if cancel and chunks >= 3:  # mid-stream: the client goes away
                            counts["cancelled"] += 1
                            return
                counts["done"] += 1
            except httpx.HTTPError:
                counts["failed"] += 1

    async with httpx.AsyncClient() as client:
        await asyncio.gather(*(one(client, i) for i in range(num_requests)))
    return counts


def wait_for_idle_pool(base_url: str, timeout: float = 60) -> float:
    deadline = time.monotonic() + timeout
    usage = pool_usage(base_url)
    while usage > 0 and time.monotonic() < deadline:
        time.sleep(0.5)
        usage = pool_usage(base_url)
    return usage


@pytest.mark.parametrize("flags, num_requests, overrides", [
    # (slow tier: pyramidkv below runs the same ledger in one group per layer, in CI)
    pytest.param(["--kv-policy", "snapkv", "--kv-sparsity", "0.7", "--kv-eviction", "patched",
                  "--max-num-batched-tokens", "256"], 40,
                 [{}, {"kv_sparsity": 0.3}, {"kv_sparsity": 0.9, "kv_obs_window": 16}],
                 marks=pytest.mark.slow),
    # streaming heads in the pool (their groups free blocks mid-request), prefix caching on
    # (cached blocks count as free), some requests with a teacher-forced tail (no cache reads)
    # (slow tier: the hybrid below runs the same streaming groups, with cancellations, in CI;
    # test_pool_storage.py checks this server's pool is empty after its batches)
    pytest.param(["--kv-policy", "prulong", "--kv-sparsity", "0.7", "--kv-sink", "16",
                  "--kv-window", "64", "--block-size", "32",
                  "--max-num-batched-tokens", "256"], 40, [{}, {"kv_teacher_forced": 8}],
                 marks=pytest.mark.slow),
    # a head mask with token eviction on its full heads, streaming heads in the pool: the
    # ledger frees full groups' tails and the streaming groups their gap (patched questions)
    # (slow tier: CI's budget; every mechanism's short soak in CI ends checking the pool empty
    # in every group, tests/mechanism_soak.py)
    pytest.param(["--kv-policy", "prulong", "--kv-sparsity", "0.5", "--kv-sink", "16",
                  "--kv-window", "64", "--kv-token-policy", "snapkv", "--kv-token-sparsity",
                  "0.7", "--kv-eviction", "patched", "--block-size", "32",
                  "--max-num-batched-tokens", "256"], 40, [{}, {"kv_teacher_forced": 8}],
                 marks=pytest.mark.slow),
    # one KV-cache group per layer: every group's blocks must come back
    # (slow tier: CI's budget; the decode-time eviction below runs one group per layer in CI)
    pytest.param(["--kv-policy", "pyramidkv", "--kv-sparsity", "0.7", "--kv-eviction",
                  "patched", "--max-num-batched-tokens", "256"], 40, [{}, {"kv_sparsity": 0.5}],
                 marks=pytest.mark.slow),
    # decode-time eviction (every group compressed during decode, some requests cancelled
    # after a compression, some with a teacher-forced tail split at compression points)
    pytest.param(["--kv-policy", "pyramidkv", "--kv-sparsity", "0.7", "--kv-eviction", "naive",
                  "--kv-decode-budget", "32", "--kv-decode-interval", "8", "--block-size", "32",
                  "--max-num-batched-tokens", "256"], 40,
                 [{}, {"kv_decode_budget": 16, "kv_decode_interval": 2},
                  {"kv_teacher_forced": 20}], id="pyramidkv-decode",
                 marks=pytest.mark.slow),  # (CI's budget: the hybrid above runs in CI)
])
def test_pool_is_whole_again_after_burst(bundled_model_dir, flags, num_requests, overrides):
    server = start_server(bundled_model_dir, flags)
    assert pool_usage(server.base_url) == 0
    counts = asyncio.run(burst(server.base_url, num_requests, seed=1, overrides=overrides))
    assert counts["failed"] == 0, counts
    assert counts["cancelled"] == num_requests // 5
    assert wait_for_idle_pool(server.base_url) == 0
    # and the server still answers
    r = httpx.post(server.base_url + "/v1/completions", timeout=120,
                   json={"model": SERVED_NAME, "prompt": "Hello", "max_tokens": 4})
    assert r.status_code == 200
