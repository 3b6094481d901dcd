"""Tenants isolated in token eviction's prefix cache (issue 72): the boundary keys of token
eviction's cache (`integration/kv_cache/prefix_cache.py`) are hashes of vLLM's chained
block hashes, which vLLM seeds with the request's `cache_salt`. In every prefix-cache mode a
request under another salt, or none, reads 0 tokens of a salted request's blocks, and the
reverse; within one salt it hits; every answer is the same tokens (naive eviction is exact
cold or hit); and the hits kv_stats reports are the hits vLLM's own counter
(`vllm:prefix_cache_hits`) counted. Modes: naive token eviction, patched eviction under
`--kv-prefix-reuse across-questions`, a head mask with naive token eviction (the hybrid: its
sink + window groups keyed at the same boundaries), tensor parallel 2 and data parallel 2.
(Head masks alone: tests/test_reliability.py::test_cache_salt_isolates_every_kv_cache_group.)
"""

from __future__ import annotations

import time

import httpx
import pytest
from conftest import SERVED_NAME, start_server
from mechanism_soak import bundled_reference, short_soak
from test_policies_vllm import flags, source_prompts
from test_tensor_parallel import TP_ENV, TP_POLICIES

from loadtest.soak import metric_sum, metrics

pytestmark = pytest.mark.server

CHUNK = 256
PROMPT = 600  # canonical chunks [0, 256), [256, 512), [512, 600): a hit reads 512 tokens
HIT = 512
MODES = {
    "snapkv-naive": {"policy": "snapkv", "sparsity": 0.5, "eviction": "naive"},
    "snapkv-patched-across-questions": {"policy": "snapkv", "sparsity": 0.5,
                                        "eviction": "patched",
                                        "prefix_reuse": "across-questions"},
    "hybrid-prulong-0.5-snapkv-naive-0.5": {"policy": "prulong", "sparsity": 0.5, "sink": 16,
                                            "window": 64, "token_policy": "snapkv",
                                            "token_sparsity": 0.5, "eviction": "naive"},
}
# (salt, cached tokens): within a salt a hit; another salt or none reads nothing, and the
# reverse (a salt after the unsalted prompt is cached)
SEQUENCE = (("alpha", 0), ("alpha", HIT), ("beta", 0), (None, 0), (None, HIT), ("gamma", 0),
            ("beta", HIT))
HITS_METRIC = "vllm:prefix_cache_hits_total"


def send(base_url: str, prompt: list[int], salt: str | None) -> tuple[dict, list[int]]:
    """One greedy completion of the token-id prompt under `salt`: (kv_stats, tokens)."""
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": 4, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    if salt is not None:
        body["cache_salt"] = salt
    r = httpx.post(base_url + "/v1/completions", json=body, timeout=300, trust_env=False)
    assert r.status_code == 200, r.text
    out = r.json()
    return out["kv_stats"], out["choices"][0]["token_ids"]


def hits_counted(base_url: str) -> float:
    return metric_sum(metrics(base_url), HITS_METRIC) or 0.0


def assert_vllm_counted(base_url: str, before: float, cached: list[int]) -> None:
    """vLLM's hit counter moved by exactly what kv_stats reported (its stat logger records
    with the engine's next output: poll a little)."""
    deadline = time.monotonic() + 30
    while (counted := hits_counted(base_url) - before) != sum(cached):
        assert time.monotonic() < deadline, (counted, cached)
        time.sleep(0.5)


def check_sequence(base_url: str, prompt: list[int], sequence) -> list[int]:
    """Send the prompt under each salt of `sequence` in turn, checking each cached count and
    that every answer is the same tokens; returns the cached counts."""
    before = hits_counted(base_url)
    cached, answers = [], []
    for salt, expected in sequence:
        stats, tokens = send(base_url, prompt, salt)
        assert stats["cached_tokens"] == expected, (salt, expected, stats)
        cached.append(stats["cached_tokens"])
        answers.append(tokens)
    assert all(a == answers[0] for a in answers), answers
    assert_vllm_counted(base_url, before, cached)
    return cached


def mode_flags(mode: str) -> list[str]:
    return [*flags(MODES[mode], CHUNK), "--enable-prefix-caching"]


# (CI: naive snapkv and its soak below; the other modes: slow tier, CI's budget)
@pytest.mark.parametrize("mode", [m if m == "snapkv-naive" else
                                  pytest.param(m, marks=pytest.mark.slow) for m in MODES])
def test_salts_isolate_token_eviction_prefix_cache(mode, bundled_model_dir, tokenizer):
    """Every single-engine mode on the bundled model: SEQUENCE's cached counts exactly."""
    server = start_server(bundled_model_dir, mode_flags(mode))
    (prompt,) = source_prompts(tokenizer, (PROMPT,))
    check_sequence(server.base_url, prompt, SEQUENCE)


def test_short_soak_under_two_tenants(bundled_model_dir, tokenizer, hf_model):
    """Token eviction's prefix cache, short soak (`mechanism_soak.py`) on the server above: its
    traffic under two tenants' salts, then a prompt cached under one reads 0 under the other."""
    server = start_server(bundled_model_dir, mode_flags("snapkv-naive"), reuse=True)
    short_soak(server, bundled_reference(hf_model, bundled_model_dir, MODES["snapkv-naive"]),
               source_prompts(tokenizer, (300, 600)), tenants=True,
               xargs=[{"kv_sparsity": 0.3}, {"kv_obs_window": 16}, {"kv_teacher_forced": 4}])


TINY_CHUNK, TINY_PROMPT, TINY_HIT = 128, 340, 256  # tests/test_tensor_parallel.py's sizes


@pytest.mark.serial  # one rank per core: no other server may hold a core meanwhile
@pytest.mark.slow  # CI's budget (the DP 2 soak runs under salts, tests/test_data_parallel.py)
def test_salts_isolate_under_tensor_parallel(tiny_qwen3, tokenizer):
    """TP 2, naive snapkv: both ranks key the same boundaries; the same exact sequence."""
    server = start_server(tiny_qwen3(4), [*flags(TP_POLICIES["snapkv naive"], TINY_CHUNK),
                                          "--tensor-parallel-size", "2",
                                          "--enable-prefix-caching"], env=TP_ENV)
    (prompt,) = source_prompts(tokenizer, (TINY_PROMPT,))
    sequence = [(salt, TINY_HIT if cached else 0) for salt, cached in SEQUENCE]
    check_sequence(server.base_url, prompt, sequence)


@pytest.mark.serial
@pytest.mark.slow  # CI's budget (the DP 2 soak runs under salts, tests/test_data_parallel.py)
def test_salts_isolate_under_data_parallel(tiny_qwen3, tokenizer):
    """DP 2, naive snapkv: each replica keeps its own cache, so a repeat hits only where it
    meets a replica that served its salt before. A salt's first request, or the unsalted
    prompt's, reads 0 on whichever replica it meets; four requests of one salt reach a
    replica twice, which hits."""
    server = start_server(tiny_qwen3(4), [*flags(TP_POLICIES["snapkv naive"], TINY_CHUNK),
                                          "--data-parallel-size", "2",
                                          "--api-server-count", "1",
                                          "--enable-prefix-caching"], env=TP_ENV)
    (prompt,) = source_prompts(tokenizer, (TINY_PROMPT,))
    before = hits_counted(server.base_url)
    cached, answers = [], []
    plan = [("alpha", 4), ("beta", 1), ("gamma", 1), (None, 4), ("delta", 1)]
    for salt, times in plan:
        counts = []
        for i in range(times):
            stats, tokens = send(server.base_url, prompt, salt)
            assert stats["cached_tokens"] in ((0,) if i == 0 else (0, TINY_HIT)), (salt, stats)
            counts.append(stats["cached_tokens"])
            answers.append(tokens)
        assert times == 1 or TINY_HIT in counts, (salt, counts)
        cached += counts
    assert all(a == answers[0] for a in answers), answers
    assert_vllm_counted(server.base_url, before, cached)
