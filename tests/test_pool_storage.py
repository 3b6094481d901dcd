"""Streaming heads in vLLM's own block pool (`integration/kv_cache/sink_window.py`) against the independent reference oracle, on the bundled model.

One server, 32-token blocks so the sink + window manager frees many blocks mid-prompt: prompts
alone and four at once (vLLM splits the token budget between them, so its steps are irregular,
while the policy's chunks stay canonical: multiples of the budget), then prefixes of the first
two served from vLLM's prefix cache; greedy tokens equal the reference's at those chunks, the
first position's top-20 log-probs agree; the streaming
groups hold at most sink + window (+ one block) per request at the end, and vLLM's pool is
empty afterwards. Hit lengths follow vLLM's `--prefix-cache-retention-interval`: with its
default (0) a prefix hits at the longest canonical chunk boundary, or inside the prompt's last
chunk (stored whole); with `None` (dense) at any block, as stock vLLM's full attention.
"""

from __future__ import annotations

import concurrent.futures as cf
import re

import httpx
import pytest
from conftest import start_server
from test_policies_vllm import (LOGPROB_TOL, NEW_TOKENS, flags, reference, served_top_logprobs,
                                source_prompts)

pytestmark = pytest.mark.server

BLOCK = 32
CASES = {
    "prulong-0.7": {"policy": "prulong", "sparsity": 0.7, "sink": 16, "window": 64},
    # the canonical chunk below the step budget (--kv-eviction-chunk 256, budget 320); a sink
    # of whole blocks: decode runs vLLM's kernel in place over the pool (`window_rows`)
    "prulong-0.7-e256": {"policy": "prulong", "sparsity": 0.7, "sink": 32, "window": 64,
                         "eviction_chunk": 256},
    # vLLM's --prefix-cache-retention-interval None: every position stored, hits at any block
    "prulong-0.7-dense": {"policy": "prulong", "sparsity": 0.7, "sink": 16, "window": 64,
                          "retention": None},
    # every head streaming: no layer keeps a full-head cache, each shares its companion's
    "streaming": {"policy": "streaming", "sink": 48, "window": 80},
    "duo-0.3": {"policy": "duo", "sparsity": 0.3, "sink": 16, "window": 64},
}


def _usage(base_url: str) -> float:
    text = httpx.get(base_url + "/metrics", timeout=30).text
    return float(re.search(r"^vllm:kv_cache_usage_perc\{[^}]*\} (\S+)$", text, re.M).group(1))


# (CI: prulong decoding in place; the read-back decode (sink 16 in 32-token blocks), streaming
# and duo in the slow tier: CI's budget; test_compat's prulong column reads back in CI)
@pytest.mark.parametrize("case", [c if c == "prulong-0.7-e256"
                                  else pytest.param(c, marks=pytest.mark.slow) for c in CASES])
def test_pool_storage_matches_reference(case, bundled_model_dir, tokenizer, hf_model):
    policy, chunk = dict(CASES[case]), 256
    dense = "retention" in policy and policy.pop("retention") is None
    retention = ["--prefix-cache-retention-interval", "None"] if dense else []
    budget = chunk + 64 if "eviction_chunk" in policy else chunk
    server = start_server(bundled_model_dir, [*flags(policy, budget), "--block-size", str(BLOCK),
                                              *retention])
    log = server.log_path.read_text(errors="replace")
    assert "KV-cache groups in the pool" in log
    prompts = source_prompts(tokenizer, (700, 1600, 400, 700, 1000, 1300))
    alone, batch = prompts[:2], prompts[2:]  # (other texts: no prefix shared between them)
    results = [served_top_logprobs(server.base_url, p) for p in alone]
    with cf.ThreadPoolExecutor(len(batch)) as pool:
        results += list(pool.map(lambda p: served_top_logprobs(server.base_url, p), batch))
    # prefixes of the prompts sent alone: served from vLLM's prefix cache, then the rest
    hits = [alone[0][:400], alone[1][:900]]
    results += [served_top_logprobs(server.base_url, p) for p in hits]
    irregular = 0
    sink_blocks = -(-policy["sink"] // BLOCK)
    for prompt, (text, top, stats) in zip(alone + batch + hits, results):
        # canonical chunks: the prompt is chunked at multiples of the step budget whatever
        # steps vLLM ran (in the batch more, and irregular ones: each request's share)
        ends = list(range(chunk, len(prompt), chunk)) + [len(prompt)]
        assert stats["chunk_boundaries"] == ends, stats["chunk_boundaries"]
        irregular += stats["engine_steps"] > len(ends) + NEW_TOKENS - 1
        ref = reference(hf_model, bundled_model_dir, policy, prompt, ends)
        assert text == tokenizer.decode(ref.token_ids), (case, len(prompt), ends)
        for token, lp in top.items():
            assert abs(lp - float(ref.first_token_logprobs[token])) < LOGPROB_TOL, (case, token)
        # the window's blocks went back mid-request (a cache hit starts with its gap empty)
        assert stats["blocks_freed"] > 0 or stats["cached_tokens"], stats
        assert stats["kv_bytes_peak"] < stats["full_kv_bytes_peak"]
        # at the end: full groups hold the sequence, streaming groups sink + window (+ 1)
        total = len(prompt) + NEW_TOKENS - 1
        groups = stats_groups(log)
        bound = (groups["full"] * -(-total // BLOCK)
                 + groups["streaming"] * (sink_blocks + -(-(policy["window"] + 1) // BLOCK) + 1))
        assert stats["blocks_held_end"] <= bound, (stats["blocks_held_end"], bound)
    assert irregular, "the batch never split a chunk: the concurrent case checked nothing new"
    # and so a prompt's output does not depend on what it was batched with; sent again it
    # is served from vLLM's prefix cache (every block but the last), with the same tokens
    again = served_top_logprobs(server.base_url, batch[2])
    assert again[0] == results[len(alone) + 2][0]
    assert again[2]["cached_tokens"] == (len(batch[2]) - 1) // BLOCK * BLOCK
    # dense: hits as long as stock vLLM's (block-aligned, below the prompt's last token);
    # vLLM's default retention: the longest of the prefix's chunk boundary and the blocks of
    # the longer prompt's last chunk (stored whole)
    for prompt, source, (_, _, stats) in zip(hits, alone, results[-len(hits):]):
        h = (len(prompt) - 1) // BLOCK * BLOCK
        if not dense and h < (len(source) - 1) // chunk * chunk:
            h = h // chunk * chunk
        assert stats["cached_tokens"] == h, (dense, stats)
    assert _usage(server.base_url) == 0.0  # every group's blocks back in vLLM's pool
    # the README's 37-token chat: with the ring store prulong 0.7 held 2.05x full attention's
    # bytes (a preallocated sink + window for each of 63 streaming heads); in the pool it
    # holds blocks as full attention does
    r = httpx.post(server.base_url + "/v1/chat/completions", timeout=120, json={
        "model": "smollm2", "max_tokens": 32, "temperature": 0,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]}).json()
    kv = r["kv_stats"]
    assert kv["prompt_tokens"] == 37
    assert kv["kv_bytes_peak"] <= kv["full_kv_bytes_peak"], kv


def stats_groups(log: str) -> dict[str, int]:
    m = re.search(r"KV-cache groups in the pool: (\d+) of full heads, (\d+) of streaming", log)
    return {"full": int(m.group(1)), "streaming": int(m.group(2))}


@pytest.mark.slow  # CI's budget (93 s on this machine)
def test_pool_storage_without_prefix_caching_holds_the_windows_only(bundled_model_dir, tokenizer,
                                                                   hf_model):
    """`--no-enable-prefix-caching`: each step is its own chunk (as with the ring store) and a
    step's tokens that leave the window before the step ends are never stored (vLLM's null
    block). Alone and batched, greedy tokens equal the reference at the steps kv_stats
    reports; at its peak a request holds its full heads' blocks and, per streaming group, the
    sink and the windows before and after a step, never the step's whole chunk; the pool is
    empty afterwards."""
    policy, chunk = CASES["prulong-0.7"], 256
    server = start_server(bundled_model_dir, [*flags(policy, chunk), "--block-size", str(BLOCK),
                                              "--no-enable-prefix-caching"])
    groups = stats_groups(server.log_path.read_text(errors="replace"))
    prompts = source_prompts(tokenizer, (900, 500, 700, 1100))
    results = [served_top_logprobs(server.base_url, prompts[0])]
    with cf.ThreadPoolExecutor(3) as pool:
        results += list(pool.map(lambda p: served_top_logprobs(server.base_url, p), prompts[1:]))
    window_blocks = -(-policy["window"] // BLOCK) + 1
    per_stream = -(-policy["sink"] // BLOCK) + 2 * window_blocks
    irregular = 0
    for prompt, (text, top, stats) in zip(prompts, results):
        ends = stats["chunk_boundaries"]
        assert ends[-1] == len(prompt) and stats["cached_tokens"] == 0
        irregular += any(b - a != chunk for a, b in zip([0] + ends[:-2], ends[:-1]))
        ref = reference(hf_model, bundled_model_dir, policy, prompt, ends)
        assert text == tokenizer.decode(ref.token_ids), (len(prompt), ends)
        for token, lp in top.items():
            assert abs(lp - float(ref.first_token_logprobs[token])) < LOGPROB_TOL, token
        # storing a 256-token step whole would hold 2 + 11 blocks per streaming group
        full_blocks = -(-(len(prompt) + NEW_TOKENS - 1) // BLOCK)
        bound = groups["full"] * full_blocks + groups["streaming"] * per_stream
        assert stats["blocks_held_peak"] <= bound, (stats["blocks_held_peak"], bound)
        assert stats["blocks_freed"] > 0
    assert irregular, "no request ran irregular steps: the batch checked nothing new"
    assert _usage(server.base_url) == 0.0


@pytest.mark.slow  # CI's budget (86 s on CI)
def test_full_heads_in_larger_blocks_match_reference(bundled_model_dir, tokenizer, hf_model):
    """`--kv-full-block-size 128` beside `--block-size 32`: the full heads' groups hold
    128-token blocks (a full head counts 4 head pages in the group plan), the streaming heads
    keep 32-token blocks and decode in place (sink 32). Alone and batched, greedy tokens equal
    the reference's; a re-sent prompt hits vLLM's prefix cache at a multiple of 128 (the
    scheduler's block, the groups' least common multiple); the pool is empty afterwards."""
    policy, chunk = {**CASES["prulong-0.7-e256"], "full_block_size": 128}, 256
    server = start_server(bundled_model_dir, [*flags(policy, chunk + 64), "--block-size",
                                              str(BLOCK)])
    log = server.log_path.read_text(errors="replace")
    sizes = re.search(r"kv cache group sizes \(([\d, ]+)\)", log).group(1)
    groups = stats_groups(log)
    assert [int(s) for s in sizes.split(",")] == [128] * groups["full"] + [BLOCK] * groups[
        "streaming"], sizes
    pages = re.search(r"head pages per group: full \[([\d, ]+)\]", log).group(1)
    assert all(int(p) % 4 == 0 for p in pages.split(",")), pages  # 4 head pages per full head
    prompts = source_prompts(tokenizer, (1100, 600, 900, 700))
    results = [served_top_logprobs(server.base_url, prompts[0])]
    with cf.ThreadPoolExecutor(3) as pool:
        results += list(pool.map(lambda p: served_top_logprobs(server.base_url, p), prompts[1:]))
    for prompt, (text, top, stats) in zip(prompts, results):
        ends = list(range(chunk, len(prompt), chunk)) + [len(prompt)]
        assert stats["chunk_boundaries"] == ends, stats["chunk_boundaries"]
        ref = reference(hf_model, bundled_model_dir, policy, prompt, ends)
        assert text == tokenizer.decode(ref.token_ids), (len(prompt), ends)
        for token, lp in top.items():
            assert abs(lp - float(ref.first_token_logprobs[token])) < LOGPROB_TOL, token
        assert stats["kv_bytes_peak"] < stats["full_kv_bytes_peak"]
    again = served_top_logprobs(server.base_url, prompts[2])
    assert again[0] == results[2][0]
    assert again[2]["cached_tokens"] == (len(prompts[2]) - 1) // 128 * 128, again[2]
    assert _usage(server.base_url) == 0.0
