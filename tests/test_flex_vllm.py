"""`--kv-attention-backend flex` served by `vllm serve` (bundled model) against the reference:
greedy tokens identical, first-token log-prob close (the CPU path's tolerance), for `full`, the
head-mask policies and token eviction (naive, patched, tiers, decoupled eviction chunks); a
mixed batch equal to its requests alone; and the start-up refusal of what the flex path does
not serve yet. (Tensor parallel through flex: tests/test_tensor_parallel.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import start_server
from mechanism_soak import bundled_reference, short_soak
from test_policies_vllm import CASES as POLICY_CASES

from vllm_kvevict.integration.attention import inductor_cache
from test_policies_vllm import (DECOUPLED, LOGPROB_TOL, check_decoupled, check_mixed_batch, flags,
                                reference, served, served_top_logprobs, source_prompts)

FLEX = {"attention_backend": "flex"}
# the CPU path's cases, `full` and the naive hybrid; not post-fill (not run here)
CASES = {"full": ({"policy": "full"}, 256),
         **{name: case for name, case in POLICY_CASES.items() if "postfill" not in name},
         "hybrid-prulong-0.5-snapkv-naive-0.5": (
             {**POLICY_CASES["hybrid-prulong-0.5-snapkv-patched-0.5"][0], "eviction": "naive"},
             256)}
PROMPT_LENGTHS = (1100,)  # five 256-token chunks (one prompt: CI's budget)


@pytest.mark.server
@pytest.mark.parametrize("case", [  # CI: a head mask (and its soak below); the rest in the
    "prulong-0.7",  # slow tier (and docs/results/flex's policy matrix)
    *(pytest.param(c, marks=pytest.mark.slow) for c in (
        "pyramidkv-patched-0.7", "full", "streaming", "duo-0.3", "snapkv-naive-0.5", "snapkv-patched-0.5",
        "pyramidkv-naive-0.5-tiers3", "hybrid-prulong-0.5-snapkv-naive-0.5",
        "hybrid-prulong-0.5-snapkv-patched-0.5"))])
def test_flex_matches_reference(case, bundled_model_dir, tokenizer, hf_model):
    policy, chunk = CASES[case]
    started = time.time()
    server = start_server(bundled_model_dir, flags({**policy, **FLEX}, chunk))
    log = server.log_path.read_text(errors="replace")
    assert "attention_backend=flex" in log
    for prompt in source_prompts(tokenizer, PROMPT_LENGTHS):
        text, logprob = served(server.base_url, prompt)
        ref = reference(hf_model, bundled_model_dir, policy, prompt, chunk)
        assert text == tokenizer.decode(ref.token_ids), f"{case}, {len(prompt)} tokens"
        assert abs(logprob - float(ref.first_token_logprobs.max())) < LOGPROB_TOL
    # the worker compiled in the keyed Inductor cache, marking it only while it compiled
    # (`inductor_cache.py`): served, no mark is left to make the next server set it aside
    marks = inductor_cache.directory_for(os.environ) / inductor_cache.MARKS
    assert marks.is_dir() and marks.stat().st_mtime >= started, marks
    pids = {str(p.pid) for p in psutil.Process(server.pid).children(recursive=True)}
    assert not [m for m in marks.glob("*") if m.name in pids], list(marks.glob("*"))


@pytest.mark.server
def test_short_soak(bundled_model_dir, tokenizer, hf_model):
    """The flex path's short soak (`mechanism_soak.py`) on the prulong 0.7 server above."""
    policy, chunk = CASES["prulong-0.7"]
    server = start_server(bundled_model_dir, flags({**policy, **FLEX}, chunk), reuse=True)
    short_soak(server, bundled_reference(hf_model, bundled_model_dir, policy),
               source_prompts(tokenizer, (300, 600)), xargs=[{"kv_teacher_forced": 4}],
               requests=12, long_tokens=400)  # (one of each kind, and one more: flex is slow here)


@pytest.mark.server
@pytest.mark.slow  # 340 s on a slow CI machine; the CPU path's mixed batch runs in CI
def test_flex_mixed_batch_equals_each_alone(bundled_model_dir, tokenizer, hf_model):
    """Prefill rows beside other requests' decode rows in one step: each token's chunk start
    travels in the metadata (a per-request one would give decodes their row's prefill start)."""
    policy, _ = CASES["prulong-0.7"]
    check_mixed_batch(start_server(bundled_model_dir, flags({**policy, **FLEX}, 8192)), policy,
                      bundled_model_dir, tokenizer, hf_model)


@pytest.mark.server
@pytest.mark.slow
@pytest.mark.parametrize("case", list(DECOUPLED))
def test_flex_eviction_chunk_over_several_steps(case, bundled_model_dir, tokenizer, hf_model):
    """`--kv-eviction-chunk 512` over 128-token steps, three requests at once: a chunk's
    earlier steps are read back out of the flex cache to be scored and compacted."""
    policy, budget = DECOUPLED[case], 128
    check_decoupled(start_server(bundled_model_dir, flags({**policy, **FLEX}, budget)), case,
                    policy, budget, bundled_model_dir, tokenizer, hf_model)


# Prefix caching with a head mask: streaming heads in their sink + window groups, and the
# chunks are canonical (multiples of the step budget, or of --kv-eviction-chunk), per token,
# so a cached block holds what a cold run computes and a hit at any block boundary is exact.
PREFIX_CASES = {  # name: (policy, step budget)
    "prulong-0.7": ({"policy": "prulong", "sparsity": 0.7, "sink": 16, "window": 64}, 256),
    "prulong-0.7-e256": ({"policy": "prulong", "sparsity": 0.7, "sink": 16, "window": 64,
                          "eviction_chunk": 256}, 320),
}
BLOCK = 32


@pytest.mark.server
@pytest.mark.slow  # 351 s on a slow CI machine (the CPU path's prefix-cache hits run in CI)
@pytest.mark.parametrize("case", ["prulong-0.7", "prulong-0.7-e256"])
def test_flex_prefix_cache_hits_match_reference(case, bundled_model_dir, tokenizer, hf_model):
    policy, budget = PREFIX_CASES[case]
    chunk = policy.get("eviction_chunk", budget)
    server = start_server(bundled_model_dir, [*flags({**policy, **FLEX}, budget),
                                              "--block-size", str(BLOCK)])
    prompts = source_prompts(tokenizer, (700, 1600, 1000))
    results = [served_top_logprobs(server.base_url, p) for p in prompts]
    # prefixes of the first two, and the third again: served from vLLM's prefix cache, hits
    # inside a chunk (384 of [256, 512)), at its end, and of a whole prompt but its last block
    hits = [prompts[0][:400], prompts[1][:900], prompts[2]]
    results += [served_top_logprobs(server.base_url, p) for p in hits]
    for i, (prompt, (text, top, stats)) in enumerate(zip(prompts + hits, results)):
        ends = list(range(chunk, len(prompt), chunk)) + [len(prompt)]
        assert stats["chunk_boundaries"] == ends, stats["chunk_boundaries"]
        cached = (len(prompt) - 1) // BLOCK * BLOCK if i >= len(prompts) else 0
        assert stats["cached_tokens"] == cached, (case, len(prompt), stats["cached_tokens"])
        ref = reference(hf_model, bundled_model_dir, policy, prompt, ends)
        assert text == tokenizer.decode(ref.token_ids), (case, len(prompt), ends)
        for token, lp in top.items():
            assert abs(lp - float(ref.first_token_logprobs[token])) < LOGPROB_TOL, (case, token)
    assert results[-1][0] == results[2][0]


@pytest.mark.parametrize("chunk", [None, 32], ids=["step-chunk", "canonical-32"])
def test_streaming_question_rows_see_what_the_cpu_path_lays_out(chunk):
    """Patched scoring's question rows on a hybrid's streaming heads (flex path): question i of
    a row whose step runs positions [a, a + c) sees the sink, the window before the chunk's
    start (a, or a // E * E with canonical chunks), the step and questions 0..i; checked
    against attention over a dense cache by logical position, with that mask written out."""
    from vllm_kvevict.flex.block_mask import paged_queries
    from vllm_kvevict.integration.attention.flex_token import streaming_questions
    from vllm_kvevict.integration.attention.token_step import EvictionJob, TokenStepPlan

    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(0)
    sink, window, bs, hs, kv_heads, per_kv, k = 4, 16, 16, 8, 2, 3, 5
    computed, q_lens = [57, 100], [1, 40]  # a decode row, then a prefill step with a question
    end = computed[1] + q_lens[1]
    pages = torch.randperm(40, generator=g)[: -(-end // bs)].int()
    table = torch.zeros(2, 20, dtype=torch.int32)
    table[0, :4] = torch.tensor([36, 37, 38, 39])
    table[1, : len(pages)] = pages
    dense = torch.randn(end, kv_heads, 2 * hs, generator=g)  # row 1's K|V by position
    slots = torch.zeros(40 * bs, kv_heads, 2 * hs)
    positions = torch.arange(end)
    slots[table[1, positions // bs].long() * bs + positions % bs] = dense
    n, off = sum(q_lens), 48  # the questions sit after the padded token axis
    query = torch.randn(off + k, kv_heads * per_kv, hs, generator=g)
    key, value = torch.randn(2, off + k, kv_heads, hs, generator=g)
    job = EvictionJob(req_id="r", row=1, computed=computed[1], start=1, end=n, is_final=False,
                      phys_before=[0], keep=[], question=list(range(k)), question_start=n)
    plan = TokenStepPlan(num_reqs=2, query_start_loc=torch.tensor([0, 1, n]),
                         block_table=table[None], seq_lens=torch.tensor([[58, end]]),
                         slots=torch.zeros(1, n + k), jobs=[job], block_size=bs, num_tokens=n,
                         question_ids=torch.zeros(k, dtype=torch.long), question_offset=off)
    queries = paged_queries(computed, q_lens, table, bs, 40, [58, 1000], chunk)
    got = streaming_questions(plan, queries, query, key, value, slots, hs ** -0.5, sink, window)
    start = computed[1] // chunk * chunk if chunk else computed[1]
    seen = (positions < sink) | (positions >= start - window)
    past_k = dense[seen, :, :hs].repeat_interleave(per_kv, 1)
    past_v = dense[seen, :, hs:].repeat_interleave(per_kv, 1)
    q_k = key[off:].repeat_interleave(per_kv, 1)
    q_v = value[off:].repeat_interleave(per_kv, 1)
    for i in range(k):
        keys, vals = torch.cat([past_k, q_k[: i + 1]]), torch.cat([past_v, q_v[: i + 1]])
        weights = torch.softmax(torch.einsum("hd,khd->hk", query[off + i], keys) * hs ** -0.5,
                                dim=-1)
        want = torch.einsum("hk,khd->hd", weights, vals)
        assert torch.allclose(got[i], want, atol=1e-5), (chunk, i)
    assert int(seen.sum()) == sink + window + q_lens[1] + (computed[1] - start)


# -- what is refused (one line at start-up, naming the flag and what is supported) ------------

class _Stand:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def _vllm_config(cache_dtype="auto", tp=1, pp=1, spec=None):
    return _Stand(cache_config=_Stand(cache_dtype=cache_dtype),
                  parallel_config=_Stand(tensor_parallel_size=tp, pipeline_parallel_size=pp),
                  speculative_config=spec)


@pytest.mark.parametrize("policy,vllm_kwargs,named", [
    ({"policy": "full"}, {"cache_dtype": "fp8"}, "--kv-cache-dtype fp8"),
    ({"policy": "duo"}, {"pp": 2}, "--pipeline-parallel-size 2"),
    ({"policy": "duo"}, {"spec": object()}, "speculative decoding"),
], ids=["fp8", "pp", "spec"])
def test_flex_refusals_name_the_flag(policy, vllm_kwargs, named):
    from vllm_kvevict.config import KVPolicyConfig
    from vllm_kvevict.flex.support import flex_error

    cfg = KVPolicyConfig.from_dict({**policy, **FLEX})
    error = flex_error(cfg, _vllm_config(**vllm_kwargs))
    assert error and error.startswith("--kv-attention-backend flex does not serve")
    assert named in error and "supported:" in error and "\n" not in error
    # the CPU path is not concerned
    assert flex_error(KVPolicyConfig.from_dict(policy), _vllm_config(**vllm_kwargs)) is None


@pytest.mark.parametrize("policy", [{"policy": p} for p in (
    "full", "streaming", "duo", "prulong", "snapkv", "pyramidkv")] + [
    {"policy": "snapkv", "eviction_chunk": 512}, {"policy": "pyramidkv", "eviction": "naive"},
    {"policy": "streaming", "eviction_chunk": 512},
    {"policy": "prulong", "token_policy": "snapkv"},
    {"policy": "duo", "token_policy": "pyramidkv", "eviction": "naive"}])
def test_flex_serves(policy):
    from vllm_kvevict.config import KVPolicyConfig
    from vllm_kvevict.flex.support import flex_error

    assert flex_error(KVPolicyConfig.from_dict({**policy, **FLEX}), _vllm_config()) is None


def test_flex_patched_caps_the_per_request_window():
    """Patched eviction on the flex path sizes its mask tables by the served observation
    window: a request asking for a larger one is refused (HTTP 400 in the API server) and
    ignored by the engine, never fatal; the CPU path takes up to max_model_len."""
    from vllm_kvevict.config import KVPolicyConfig
    from vllm_kvevict.overrides import check_vllm_xargs, effective_config

    flex = KVPolicyConfig.from_dict({"policy": "snapkv", "obs_window": 32, **FLEX})
    assert flex.max_obs_window == 32
    error = check_vllm_xargs({"kv_obs_window": 33}, "snapkv", 8192, flex.max_obs_window)
    assert "kv_obs_window" in error and "[1, 32]" in error and "--kv-obs-window" in error
    assert check_vllm_xargs({"kv_obs_window": 32}, "snapkv", 8192, flex.max_obs_window) is None
    assert effective_config(flex, {"kv_obs_window": 64})[0].obs_window == 32
    assert effective_config(flex, {"kv_obs_window": 16})[0].obs_window == 16
    for cfg in (KVPolicyConfig.from_dict({"policy": "snapkv", "obs_window": 32}),
                KVPolicyConfig.from_dict({"policy": "snapkv", "eviction": "naive", **FLEX})):
        assert cfg.max_obs_window is None
        assert effective_config(cfg, {"kv_obs_window": 64})[0].obs_window == 64


def test_importing_the_flex_module_leaves_torchs_compiler_config_alone():
    """Only the worker that serves the flex path raises torch's recompile limit
    (`use_head_pages_backend`); importing the module changes nothing of torch's config."""
    code = ("import torch, vllm.v1.attention.backends.flex_attention\n"
            "before = torch._dynamo.config.recompile_limit\n"
            "import vllm_kvevict.integration.attention.flex_attention as f\n"
            "assert torch._dynamo.config.recompile_limit == before, before\n"
            "f.allow_flex_recompiles()\n"
            "assert torch._dynamo.config.recompile_limit == max(before, f.FLEX_RECOMPILE_LIMIT)\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_unknown_attention_backend_is_refused():
    from vllm_kvevict.config import KVPolicyConfig, KVPolicyError
    from vllm_kvevict.flags import flag_message

    with pytest.raises(KVPolicyError) as exc:
        KVPolicyConfig.from_dict({"attention_backend": "xformers"})
    assert flag_message(exc.value).startswith("--kv-attention-backend 'xformers' is unknown")


@pytest.mark.server
def test_vllm_serve_refuses_fp8_on_flex(bundled_model_dir):
    """The real CLI: exit 2 with one line before any model loads."""
    vllm = Path(sys.executable).parent / "vllm"
    proc = subprocess.run([str(vllm), "serve", str(bundled_model_dir), "--port", "8799",
                           "--kv-policy", "prulong", "--kv-cache-dtype", "fp8",
                           "--kv-attention-backend", "flex"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [l for l in proc.stderr.splitlines() if l.startswith("vllm-kvevict: error:")]
    refusal = "--kv-attention-backend flex does not serve --kv-cache-dtype fp8"
    assert len(lines) == 1 and refusal in lines[0], proc.stderr[-2000:]
