"""Every policy served by `vllm serve` (bundled model, through the OpenAI API) against the
independent plain-PyTorch reference: greedy tokens identical, first-token log-prob close.

Chunk boundaries matter for every evicting policy, so prompts are sent one at a time (vLLM then
chunks them exactly as the reference does: fixed `--max-num-batched-tokens` chunks); the mixed
batch test uses a token budget that holds every prompt in one chunk, so its prefill rows share
steps with other requests' decode rows while their chunking stays the one they get alone.
"""

from __future__ import annotations

import concurrent.futures as cf
import glob
import sys
from pathlib import Path

import openai
import pytest

from conftest import SERVED_NAME, served_policy_builds, start_server
from vllm_kvevict.config import HEAD_MASK_POLICIES, KVPolicyConfig
from vllm_kvevict.footprint import eviction_boundaries
from vllm_kvevict.launch import policy_flags
from vllm_kvevict.masks import resolve_full_heads
from vllm_kvevict.policies import build_policy
from vllm_kvevict.reference import ReferenceRunner

pytestmark = pytest.mark.server

NEW_TOKENS = 12
LOGPROB_TOL = 2e-3  # fp32 kernels vs fp32 eager reference; observed differences are ~1e-5

CASES = {
    # name: (policy dict, chunk)
    "streaming": ({"policy": "streaming", "sink": 16, "window": 64}, 256),
    "prulong-0.7": ({"policy": "prulong", "sparsity": 0.7, "sink": 16, "window": 64}, 256),
    "duo-0.3": ({"policy": "duo", "sparsity": 0.3, "sink": 16, "window": 64}, 256),
    "snapkv-naive-0.5": ({"policy": "snapkv", "sparsity": 0.5, "eviction": "naive"}, 256),
    "snapkv-patched-0.5": ({"policy": "snapkv", "sparsity": 0.5, "eviction": "patched"}, 256),
    "pyramidkv-patched-0.7": ({"policy": "pyramidkv", "sparsity": 0.7, "eviction": "patched"},
                              256),
    # 3 tiers of 10 layers (the default is one KV-cache group per layer)
    "pyramidkv-naive-0.5-tiers3": ({"policy": "pyramidkv", "sparsity": 0.5, "eviction": "naive",
                                    "tiers": 3}, 256),
    # a head mask with token eviction on its full heads (--kv-token-policy)
    "hybrid-prulong-0.5-snapkv-patched-0.5": ({"policy": "prulong", "sparsity": 0.5, "sink": 16,
                                               "window": 64, "token_policy": "snapkv",
                                               "token_sparsity": 0.5, "eviction": "patched"},
                                              256),
    "snapkv-postfill-0.7": ({"policy": "snapkv", "sparsity": 0.7, "eviction": "naive"}, 4096),
    # decode-time eviction, compressing every 4 generated tokens to 64 per KV head (so the
    # compatibility matrix's short generations compress too; tests/test_decode_eviction.py)
    "snapkv-naive-0.5-decode": ({"policy": "snapkv", "sparsity": 0.5, "eviction": "naive",
                                 "decode_budget": 64, "decode_interval": 4}, 256),
}
PROMPT_LENGTHS = (700, 1600)


def flags(policy: dict, chunk: int) -> list[str]:
    return ["--max-num-batched-tokens", str(chunk), *policy_flags(policy)]


def source_prompts(tokenizer, lengths) -> list[list[int]]:
    """Real text (this Python's standard library sources), cut to exact token counts."""
    files = sorted(glob.glob(str(Path(sys.base_prefix) / "lib" / "python3.11" / "*.py")))[10:]
    prompts = []
    for i, n in enumerate(lengths):
        ids = tokenizer(Path(files[i]).read_text())["input_ids"]
        while len(ids) < n:
            ids = ids + ids
        prompts.append(ids[:n])
    return prompts


def reference(hf_model, bundled_model_dir, policy: dict, prompt, chunk, new_tokens=NEW_TOKENS):
    cfg = KVPolicyConfig.from_dict(policy)
    full_heads = None
    if cfg.policy in HEAD_MASK_POLICIES:
        full_heads, _ = resolve_full_heads(cfg, str(bundled_model_dir), 30, 3)
    runner = ReferenceRunner(hf_model, build_policy(cfg, 30, 3, full_heads=full_heads))
    return runner.generate(prompt, new_tokens, chunk)


def served(base_url: str, prompt, with_stats: bool = False):
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused")
    r = client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=NEW_TOKENS,
                                  temperature=0, logprobs=1)
    out = (r.choices[0].text, r.choices[0].logprobs.token_logprobs[0])
    return (*out, r.model_extra["kv_stats"]) if with_stats else out


# The other cases' baseline runs in test_compat.py (one server per policy column, shared with
# the compatibility matrix's per-request rows); post-fill eviction (one 4096-token chunk) here.
@pytest.mark.slow  # CI's budget (93 s on CI; naive snapkv's chunked eviction runs in CI)
@pytest.mark.parametrize("case", ["snapkv-postfill-0.7"])
def test_policy_matches_reference(case, bundled_model_dir, tokenizer, hf_model):
    policy, chunk = CASES[case]
    server = start_server(bundled_model_dir, flags(policy, chunk))
    for prompt in source_prompts(tokenizer, PROMPT_LENGTHS):
        text, logprob = served(server.base_url, prompt)
        ref = reference(hf_model, bundled_model_dir, policy, prompt, chunk)
        assert text == tokenizer.decode(ref.token_ids), f"{case}, {len(prompt)} tokens"
        assert abs(logprob - float(ref.first_token_logprobs.max())) < LOGPROB_TOL
    # the served policy (and its mask file) is built once in each process: API server
    # (start-up validation), engine core (scheduler, stats connector) and worker (backend)
    builds = served_policy_builds(server)
    assert len(builds) == 3 and set(builds.values()) == {1}, builds


# (pyramidkv only: snapkv runs the same code with one KV-cache group instead of 30, and the
# suite's time budget is better spent on the decoupled eviction chunk below)
@pytest.mark.parametrize("case", ["pyramidkv-patched-0.7"])
def test_chunked_mixed_batch_matches_reference_at_served_boundaries(case, bundled_model_dir,
                                                                     tokenizer, hf_model):
    """Four requests at once with a 256-token budget: vLLM splits the budget between them, so
    each request's chunks differ from a lone run. The reference, given the chunk boundaries the
    server reports in kv_stats, must still produce the same tokens. (pyramidkv: one KV-cache
    group per layer, so every layer's block row is truncated on its own.)"""
    policy, chunk = CASES[case]
    server = start_server(bundled_model_dir, flags(policy, chunk))
    prompts = source_prompts(tokenizer, (400, 700, 1000, 1300))
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: served(server.base_url, p, with_stats=True), prompts))
    irregular = 0
    for prompt, (text, _, stats) in zip(prompts, results):
        ends = stats["chunk_boundaries"]
        irregular += any(b - a != chunk for a, b in zip([0] + ends[:-2], ends[:-1]))
        ref = reference(hf_model, bundled_model_dir, policy, prompt, ends)
        assert text == tokenizer.decode(ref.token_ids), (len(prompt), ends)
    assert irregular, "the batch never split a chunk: this test checked nothing new"


# (snapkv naive in a mixed batch: test_eviction_chunk_over_several_steps_matches_reference;
# prulong in the slow tier: CI's budget, test_pool_storage batches it in CI)
@pytest.mark.parametrize("case", [pytest.param("prulong-0.7", marks=pytest.mark.slow),
                                  pytest.param(  # pyramidkv's batch: chunked test
                                      "pyramidkv-patched-0.7", marks=pytest.mark.slow)])
def test_mixed_batch_equals_each_alone(case, bundled_model_dir, tokenizer, hf_model):
    policy, _ = CASES[case]
    check_mixed_batch(start_server(bundled_model_dir, flags(policy, 8192)), policy,
                      bundled_model_dir, tokenizer, hf_model)


def check_mixed_batch(server, policy, bundled_model_dir, tokenizer, hf_model) -> None:
    """Four prompts at once give the tokens each gives alone, and those are the reference's
    (one chunk per prompt with the server's 8192-token budget)."""
    prompts = source_prompts(tokenizer, (300, 900, 1700, 2600))
    alone = [served(server.base_url, p)[0] for p in prompts]
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        together = [t for t, _ in pool.map(lambda p: served(server.base_url, p), prompts)]
    assert together == alone
    # and both are the reference's (one chunk per prompt with this token budget)
    for prompt, text in zip(prompts[:2], alone[:2]):
        ref = reference(hf_model, bundled_model_dir, policy, prompt, 8192)
        assert text == tokenizer.decode(ref.token_ids)


# Eviction chunk 512, vLLM prefilling at most 128 tokens per step: each chunk runs in several
# steps and is scored and compacted once, at its last step, from K/V read back out of the paged
# cache. Three prompts at once so the budget splits steps irregularly (naive scoring needs the
# chunk's last 64 queries in its last step: the scheduler's step_cap keeps them together).
DECOUPLED = {
    "snapkv-naive-0.7": {"policy": "snapkv", "sparsity": 0.7, "eviction": "naive",
                         "eviction_chunk": 512},
    "pyramidkv-patched-0.7": {"policy": "pyramidkv", "sparsity": 0.7, "eviction": "patched",
                              "eviction_chunk": 512},
    # a head mask with a token policy: its streaming heads' chunks are the same canonical ones
    "hybrid-prulong-0.5-snapkv-patched-0.5": {**CASES["hybrid-prulong-0.5-snapkv-patched-0.5"][0],
                                              "eviction_chunk": 512},
}


def served_top_logprobs(base_url: str, prompt, k: int = 20) -> tuple[str, dict[int, float]]:
    """Greedy text and the first generated position's top-k log-probs by token id."""
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused")
    r = client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=NEW_TOKENS,
                                  temperature=0, logprobs=k,
                                  extra_body={"return_tokens_as_token_ids": True})
    top = r.choices[0].logprobs.top_logprobs[0]
    return (r.choices[0].text, {int(t.split(":")[1]): lp for t, lp in top.items()},
            r.model_extra["kv_stats"])


@pytest.mark.slow  # CI's budget (111 s on this machine for snapkv alone)
@pytest.mark.parametrize("case", list(DECOUPLED))
def test_eviction_chunk_over_several_steps_matches_reference(case, bundled_model_dir, tokenizer,
                                                             hf_model):
    policy, budget = DECOUPLED[case], 128
    check_decoupled(start_server(bundled_model_dir, flags(policy, budget)), case, policy,
                    budget, bundled_model_dir, tokenizer, hf_model)


def check_decoupled(server, case, policy, budget, bundled_model_dir, tokenizer, hf_model):
    """Three prompts at once through `server`: each eviction chunk over several irregular
    steps, the tokens and top-20 log-probs the reference's at the same eviction chunks."""
    prompts = source_prompts(tokenizer, (700, 1600, 1100))
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: served_top_logprobs(server.base_url, p), prompts))
    irregular = 0
    # (a head mask's kv_stats give its canonical chunks, not vLLM's steps)
    canonical = KVPolicyConfig.from_dict(policy).uses_head_mask
    for prompt, (text, top, stats) in zip(prompts, results):
        n, steps = len(prompt), stats["chunk_boundaries"]
        chunks = eviction_boundaries(steps, n, 512)
        assert chunks == list(range(512, n, 512)) + [n], steps
        if canonical:  # (a chunk of 512 over steps of at most 128 tokens)
            assert steps == chunks, steps
            irregular += 1
        else:
            assert all(0 < b - a <= budget for a, b in zip([0] + steps[:-1], steps)), steps
            irregular += any((b - a) % budget for a, b in zip([0] + steps[:-1], steps)
                             if b < n)
        ref = reference(hf_model, bundled_model_dir, policy, prompt, chunks)
        assert text == tokenizer.decode(ref.token_ids), (case, n, steps)
        # the top-20 log-probs, not just the greedy one: they move with any change of the
        # kept set (the greedy token of a confident continuation often does not)
        for token, lp in top.items():
            assert abs(lp - float(ref.first_token_logprobs[token])) < LOGPROB_TOL, (case, n)
        # the footprint is the paper's at the eviction chunks; the engine held less than a
        # whole chunk at once, so the chunk-held figure lies between it and the one-step one
        held = stats["footprint_chunk_held"]
        assert stats["footprint"] < held, (stats["footprint"], held)
    assert irregular, "the batch never split a step irregularly: step_cap was not exercised"
