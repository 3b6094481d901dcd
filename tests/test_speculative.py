"""ngram speculative decoding served with every evicting policy: the served greedy tokens must
equal the reference oracle's one-token-at-a-time greedy decode (issue 23).

A verification step runs 1 + K queries of one request (the last sampled token and K drafts);
vLLM then keeps the accepted prefix and rolls the rest back. For a streaming head every one of
those queries must see exactly what it would see decoded alone (sink + its own last W tokens),
and the K/V of rejected drafts must not overwrite a token still inside the window. Both are
checked here end to end (servers, `-m server`) and on the step plan (no server).
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from compat_matrix import SLOW_SPEC, SPEC_IDS
from conftest import SERVED_NAME, start_server
from test_policies_vllm import LOGPROB_TOL, flags

from vllm_kvevict.config import KVPolicyConfig
from vllm_kvevict.features import SUPPORTED_SPECULATIVE_METHODS, speculative_error
from vllm_kvevict.integration.attention.step_plan import build_step_plan, lay_out_rows
from vllm_kvevict.masks import resolve_full_heads
from vllm_kvevict.policies import build_policy
from vllm_kvevict.reference import ReferenceRunner

K = 3
SPEC = ('{"method": "ngram", "num_speculative_tokens": %d, "prompt_lookup_max": 3, '
        '"prompt_lookup_min": 1}' % K)
NEW_TOKENS = 48
CHUNK = 256
HEAD_MASK = {"sink": 16, "window": 64}  # short: the generation runs far past the window
CASES = {
    # the streaming heads in vLLM's pool: drafts' K/V in its blocks, the window freed behind
    "prulong-0.7": {"policy": "prulong", "sparsity": 0.7, **HEAD_MASK},
    "snapkv-naive-0.5": {"policy": "snapkv", "sparsity": 0.5, "eviction": "naive"},
    "snapkv-patched-0.5": {"policy": "snapkv", "sparsity": 0.5, "eviction": "patched"},
    "pyramidkv-patched-0.7": {"policy": "pyramidkv", "sparsity": 0.7, "eviction": "patched"},
    # slow tier (tests/compat_matrix.py names them): the rest of the compatibility matrix
    # (duo and streaming run the head-mask path prulong runs in CI)
    "duo-0.3": {"policy": "duo", "sparsity": 0.3, **HEAD_MASK},
    "streaming": {"policy": "streaming", **HEAD_MASK},
    "full": {"policy": "full"},
    "pyramidkv-naive-0.5": {"policy": "pyramidkv", "sparsity": 0.5, "eviction": "naive"},
    # the full heads in 128-token blocks beside 32-token streaming blocks (slow tier)
    "prulong-0.7-full128": {"policy": "prulong", "sparsity": 0.7, **HEAD_MASK,
                            "full_block_size": 128},
}
SLOW_EXTRA = {"prulong-0.7-full128"}
BLOCK_SIZE = {"prulong-0.7-full128": ["--block-size", "32"]}
SLOW_SPEC_IDS = {SPEC_IDS[c] for c in SLOW_SPEC}


# -- prompts ---------------------------------------------------------------------------------
def code_copy_prompt(tokenizer) -> list[int]:
    """Issue 23's shape: copy 8 of 45 near-identical functions (882 tokens). ngram drafts
    often come from the wrong function: many drafts, many rejected."""
    listing = "".join(f"def f{i}(x):\n    return x * {i % 9 + 2} + {i % 11}\n\n"
                      for i in range(45))
    ask = "Copy these functions exactly: f3, f7, f12, f18, f23, f29, f34, f40."
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Here are some Python functions:\n\n" + listing + ask}],
        add_generation_prompt=True, tokenize=False)
    return tokenizer(text)["input_ids"]


def repetitive_prompt(tokenizer) -> list[int]:
    """A line repeated: the continuation repeats it and the drafts are mostly accepted."""
    return tokenizer("red green blue yellow. " * 100)["input_ids"]


# -- server helpers --------------------------------------------------------------------------
def served(base_url: str, prompt: list[int]) -> tuple[list[int], list[float]]:
    """Greedy token ids (EOS ignored) and each one's log-prob, as the server computed it."""
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused")
    r = client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=NEW_TOKENS,
                                  temperature=0, logprobs=1,
                                  extra_body={"ignore_eos": True,
                                              "return_tokens_as_token_ids": True})
    logprobs = r.choices[0].logprobs
    return [int(t.split(":")[1]) for t in logprobs.tokens], list(logprobs.token_logprobs)


def spec_counters(base_url: str) -> tuple[float, float]:
    """(draft tokens, accepted draft tokens) so far, from vLLM's Prometheus counters."""
    text = httpx.get(base_url + "/metrics", timeout=10).text

    def total(name):
        return sum(float(m.group(1)) for m in
                   re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))

    return (total("vllm:spec_decode_num_draft_tokens_total"),
            total("vllm:spec_decode_num_accepted_tokens_total"))


def counters_after(base_url: str, before: tuple[float, float]) -> tuple[float, float]:
    """The counters once they have moved past `before` (they are updated with the outputs;
    allow the API process a moment)."""
    for _ in range(20):
        now = spec_counters(base_url)
        if now[0] > before[0]:
            break
        time.sleep(0.5)
    return now[0] - before[0], now[1] - before[1]


def reference_decode(hf_model, bundled_model_dir, policy: dict, prompt: list[int]):
    """The oracle's greedy decode, one token per forward after the prompt's chunks (what
    ReferenceRunner.generate does), with the log-prob of each chosen token. One torch thread:
    on the shared 2-core machine two OpenMP pools (ours and a server's) slow each other ~10x."""
    cfg = KVPolicyConfig.from_dict(policy)
    full_heads = None
    if cfg.policy in ("duo", "prulong"):
        full_heads, _ = resolve_full_heads(cfg, str(bundled_model_dir), 30, 3)
    runner = ReferenceRunner(hf_model, build_policy(cfg, 30, 3, full_heads=full_heads))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        pre = runner.prefill(prompt, CHUNK)
        logits, tokens, logprobs = pre.logits[-1], [], []
        for i in range(NEW_TOKENS):
            token = int(torch.argmax(logits))
            tokens.append(token)
            logprobs.append(float(torch.log_softmax(logits, dim=-1)[token]))
            if i + 1 < NEW_TOKENS:
                logits = runner.decode_step(pre.cache, token, len(prompt) + i)
    finally:
        torch.set_num_threads(threads)
    return tokens, logprobs


@pytest.mark.server
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow)
                                  if c in SLOW_SPEC_IDS | SLOW_EXTRA else c for c in CASES])
def test_ngram_speculation_matches_one_token_decode(case, bundled_model_dir, tokenizer,
                                                    hf_model):
    policy = CASES[case]
    server = start_server(bundled_model_dir,
                          flags(policy, CHUNK) + ["--speculative-config", SPEC]
                          + BLOCK_SIZE.get(case, []))
    prompts = {"code-copy": code_copy_prompt(tokenizer),
               "repetitive": repetitive_prompt(tokenizer)}
    drafted = {}
    for name, prompt in prompts.items():
        before = spec_counters(server.base_url)
        ids, logprobs = served(server.base_url, prompt)
        drafted[name] = counters_after(server.base_url, before)
        ref_ids, ref_logprobs = reference_decode(hf_model, bundled_model_dir, policy, prompt)
        where = f"{case}, {name} ({len(prompt)} tokens), drafts/accepted {drafted[name]}"
        assert ids == ref_ids, (f"{where}:\nserved    {tokenizer.decode(ids)!r}\n"
                                f"reference {tokenizer.decode(ref_ids)!r}")
        # every verified position's log-prob, not only the greedy choice (a query that sees a
        # wrong key set moves it long before it flips a confident token)
        worst = max(range(NEW_TOKENS), key=lambda i: abs(logprobs[i] - ref_logprobs[i]))
        assert abs(logprobs[worst] - ref_logprobs[worst]) < LOGPROB_TOL, (
            f"{where}: token {worst}: served log-prob {logprobs[worst]:.6f}, reference "
            f"{ref_logprobs[worst]:.6f}")
    # not vacuous: drafts were verified, some rejected (code copy), some accepted (repetition)
    drafts, accepted = drafted["code-copy"]
    assert 0 < drafts and accepted < drafts, drafted
    drafts, accepted = drafted["repetitive"]
    assert 0 < accepted <= drafts, drafted


# -- start-up refusal --------------------------------------------------------------------------
def test_speculative_methods_refused_or_served():
    prulong = KVPolicyConfig(policy="prulong")
    assert SUPPORTED_SPECULATIVE_METHODS == ("ngram",)
    for policy in ("prulong", "duo", "streaming", "snapkv", "pyramidkv"):
        assert speculative_error(KVPolicyConfig(policy=policy), None) is None
        assert speculative_error(KVPolicyConfig(policy=policy), "ngram") is None
    assert speculative_error(prulong, "draft_model") == (
        "--speculative-config method 'draft_model' is not supported with --kv-policy prulong; "
        "supported: ngram")
    for method in ("eagle", "eagle3", "mtp", "medusa", "suffix", "custom_class", "ngram_gpu"):
        assert "not supported with --kv-policy snapkv" in speculative_error(
            KVPolicyConfig(policy="snapkv"), method)
        # full too: a drafter's layers would run through the plugin untested
        assert "not supported with --kv-policy full" in speculative_error(KVPolicyConfig(),
                                                                          method)


@pytest.mark.served_release
def test_vllm_serve_refuses_draft_model_before_loading(bundled_model_dir):
    """The bundled model drafting for itself: its layers would run through our attention
    backend with the target's head mask, so the server stops with one line."""
    vllm = Path(sys.executable).parent / "vllm"
    spec = '{"method": "draft_model", "model": "%s", "num_speculative_tokens": 3}' % (
        bundled_model_dir)
    proc = subprocess.run([str(vllm), "serve", str(bundled_model_dir), "--kv-policy", "prulong",
                           "--dtype", "float32", "--speculative-config", spec],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last == ("vllm-kvevict: error: --speculative-config method 'draft_model' is not "
                    "supported with --kv-policy prulong; supported: ngram"), proc.stderr[-3000:]
    assert "Loading weights" not in proc.stderr + proc.stdout


# -- the step plan (no server) -------------------------------------------------------------------
def seen_by_each_query(plan, laid: torch.Tensor) -> list[set]:
    """Per query (batch order): the laid-out K values its kernel row lets it attend to (vLLM's
    causal rule: query i of a row of seq_len n and q_len m sees laid tokens [0, n - m + i])."""
    out, start = [], 0
    for r in range(plan.num_reqs):
        n = int(plan.seq_lens[r])
        m = int(plan.query_start_loc[r + 1] - plan.query_start_loc[r])
        row = laid[start:start + n].flatten().tolist()
        out += [set(row[: n - m + i + 1]) for i in range(m)]
        start += n
    return out


def write_and_lay_out(pool: dict, plan, rows: list[int], keys: torch.Tensor) -> torch.Tensor:
    """What `paged_layout.lay_out_from_pool` does, on a dict (batch row, position) -> K: write
    the step's tokens at their positions (rejected drafts of an earlier step included, as vLLM's
    slot mapping does), then lay out each kernel row's visible past read back from it."""
    for (r, p), k in zip(rows, keys.flatten().tolist()):
        pool[(r, p)] = k
    past = torch.tensor([pool[(int(r), int(p))] for r, p in zip(plan.prefix_row, plan.prefix_pos)])
    return lay_out_rows(plan, past.view(-1, 1, 1), keys[plan.chunk_src])


def test_decode_step_of_four_queries_gives_each_its_own_window():
    sink, window = 2, 4
    # request at 20 computed tokens, prompt of 10: a verification step of 1 + 3 queries
    plan = build_step_plan([20], [4], sink, window, block_size=8, prompt_lens=[10])
    assert plan.num_reqs == 4 and plan.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert plan.seq_lens.tolist() == [7, 7, 7, 7]  # sink + W + itself, for every query
    pool = {(0, p): float(p) for p in range(20)}
    keys = torch.arange(20, 24, dtype=torch.float32).view(4, 1, 1)
    laid = write_and_lay_out(pool, plan, [(0, p) for p in range(20, 24)], keys)
    assert seen_by_each_query(plan, laid) == [
        {0, 1, 16, 17, 18, 19, 20}, {0, 1, 17, 18, 19, 20, 21}, {0, 1, 18, 19, 20, 21, 22},
        {0, 1, 19, 20, 21, 22, 23}]
    # the same step as a prefill chunk (positions < the prompt's end): one row, chunk semantics
    chunk = build_step_plan([20], [4], sink, window, block_size=8, prompt_lens=[30])
    assert chunk.num_reqs == 1 and chunk.seq_lens.tolist() == [2 + 4 + 4]


def test_speculative_steps_see_what_one_token_decode_sees():
    """Three requests, random prefill chunks, then verification steps of 1 + k <= 1 + K queries
    with random acceptance: every query sees exactly the keys the reference oracle's visibility
    rule gives it (prefill: its chunk's; decode: its own window), each in its accepted version."""
    import random

    from vllm_kvevict.reference import visibility

    rng = random.Random(0)
    sink, window, spec_k, bs = 3, 7, 3, 8
    pool: dict = {}
    prompt_lens = [25, 9, 40]
    done = [0, 0, 0]
    valid: list[dict[int, float]] = [{}, {}, {}]  # accepted K value of every position
    version = 0
    for _ in range(60):
        q_lens, values = [], []
        for r in range(3):
            n, a = prompt_lens[r], done[r]
            c = min(rng.choice([1, 4, 11]), n - a) if a < n else 1 + rng.randint(0, spec_k)
            q_lens.append(c)
            version += 1
            values.append([float(p * 1000 + version) for p in range(a, a + c)])
        plan = build_step_plan(done, q_lens, sink, window, bs, prompt_lens)
        # a step reads back only positions before its row's first query: the rejected drafts
        # of the step before sit at positions this step rewrites first
        assert all(int(p) < done[int(r)] for r, p in zip(plan.prefix_row, plan.prefix_pos))
        keys = torch.tensor([v for row in values for v in row]).view(-1, 1, 1)
        rows = [(r, done[r] + i) for r in range(3) for i in range(q_lens[r])]
        laid = write_and_lay_out(pool, plan, rows, keys)
        seen = iter(seen_by_each_query(plan, laid))
        for r in range(3):
            n, a, c = prompt_lens[r], done[r], q_lens[r]
            known = {**valid[r], **{a + i: values[r][i] for i in range(c)}}
            positions = torch.tensor(sorted(known))
            for i in range(c):
                q = a + i
                start = a if q < n else q  # the reference: a decode step is the chunk [q, q+1)
                mask = visibility(torch.tensor([q]), positions.view(1, -1), start,
                                  torch.tensor([True]), sink, window)[0, 0]
                assert next(seen) == {known[int(p)] for p in positions[mask]}, (r, a, c, i)
        for r in range(3):  # vLLM accepts the sampled token and a random number of drafts
            n, a, c = prompt_lens[r], done[r], q_lens[r]
            accepted = c if a < n else 1 + rng.randint(0, c - 1)
            valid[r].update({a + i: values[r][i] for i in range(accepted)})
            done[r] = a + accepted
