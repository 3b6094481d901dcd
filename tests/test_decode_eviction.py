"""Decode-time eviction (`--kv-decode-budget`, `--kv-decode-interval`): served tokens equal the
reference's, and the generated tokens' blocks go back to vLLM's pool during the request.

Three prompts at once with a 256-token budget: their prefills share steps with each other's
decode rows (irregular chunk boundaries, given to the reference as kv_stats reports them), and
every request compresses several times while others prefill or decode.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from conftest import SERVED_NAME, start_server
from mechanism_soak import bundled_reference, short_soak
from test_policies_vllm import flags, reference, source_prompts
from vllm_kvevict.config import KVPolicyConfig
from vllm_kvevict.ledger import LayerGroups, decode_group_budgets
from vllm_kvevict.policies import build_policy

pytestmark = pytest.mark.server

NEW_TOKENS, BLOCK = 100, 32
DECODE = {"decode_budget": 64, "decode_interval": 32, "obs_window": 16}
CASES = {
    # one KV-cache group
    "snapkv-naive-0.5": {"policy": "snapkv", "sparsity": 0.5, "eviction": "naive", **DECODE},
    # one group per layer, each with its own decode budget (the pyramid's)
    "pyramidkv-patched-0.7": {"policy": "pyramidkv", "sparsity": 0.7, "eviction": "patched",
                              **DECODE},
    # a head mask whose full heads evict tokens (--kv-token-policy): their decode queries per
    # layer (each layer holds its own number of full heads), streaming heads untouched
    "hybrid-prulong-0.5-snapkv-naive-0.5": {"policy": "prulong", "sparsity": 0.5, "sink": 16,
                                            "window": 64, "token_policy": "snapkv",
                                            "token_sparsity": 0.5, "eviction": "naive",
                                            **DECODE},
    # the FlexAttention path (reads the pool by physical position, writes through its own)
    "snapkv-naive-0.5-flex": {"policy": "snapkv", "sparsity": 0.5, "eviction": "naive",
                              "attention_backend": "flex", **DECODE},
}


def server_flags(policy: dict) -> list[str]:
    return [*flags(policy, 256), "--block-size", str(BLOCK)]


async def complete_all(base_url: str, prompts: list[list[int]], xargs: list[dict]) -> list[dict]:
    async with httpx.AsyncClient(timeout=600) as client:
        async def one(ids, extra):
            body = {"model": SERVED_NAME, "prompt": ids, "max_tokens": NEW_TOKENS,
                    "temperature": 0, "ignore_eos": True, "return_token_ids": True,
                    **({"vllm_xargs": extra} if extra else {})}
            r = await client.post(base_url + "/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()
        return await asyncio.gather(*(one(ids, x) for ids, x in zip(prompts, xargs)))


# (CI: one group; pyramidkv's tiers, a head mask's full heads and the flex path in the slow
# tier: CI's budget)
@pytest.mark.parametrize("case", [c if c == "snapkv-naive-0.5"
                                  else pytest.param(c, marks=pytest.mark.slow) for c in CASES])
def test_decode_eviction_matches_reference(case, bundled_model_dir, tokenizer, hf_model):
    policy = CASES[case]
    server = start_server(bundled_model_dir, server_flags(policy))
    prompts = source_prompts(tokenizer, (300, 700, 500, 400))
    # the fourth request sets its own budget and interval (vllm_xargs; a head mask's server
    # takes no per-request KV keys)
    own = {} if "token_policy" in policy else {"kv_decode_budget": 40, "kv_decode_interval": 24}
    xargs = [{}, {}, {}, own]
    results = asyncio.run(complete_all(server.base_url, prompts, xargs))
    timeline = httpx.get(server.base_url + "/v1/kv_stats/timeline").json()
    traces = {t["engine_request_id"]: t["points"] for t in timeline["requests"]}
    for prompt, extra, served in zip(prompts, xargs, results):
        own = {**policy, **{k.removeprefix("kv_"): v for k, v in extra.items()}}
        cfg = KVPolicyConfig.from_dict(own)
        stats = served["kv_stats"]
        ends = stats["chunk_boundaries"]
        ref = reference(hf_model, bundled_model_dir, own, prompt, ends, NEW_TOKENS)
        assert served["choices"][0]["token_ids"] == ref.token_ids, (case, len(prompt), ends)
        # 99 decode steps (the last token is not fed back): a compression every interval
        assert stats["decode_steps"] == NEW_TOKENS - 1
        assert stats["decode_compressions"] == 99 // cfg.decode_interval
        assert stats["params"]["decode_budget"] == cfg.decode_budget
        # the live view saw the request's bytes fall (its first compression frees most of
        # the prompt's kept tokens; it never holds as much again)
        held = [bytes_held for _, bytes_held, _ in traces[stats["engine_request_id"]]]
        assert max(held) > held[-1], held
        if cfg.is_hybrid:  # (its streaming heads' groups hold sink + window blocks besides)
            continue
        # the blocks held at the last step are exactly what the reference's cache holds, per
        # KV-cache group (a group's row is sized for its largest layer): the compressed
        # tokens' blocks went back to the pool
        budgets = decode_group_budgets(build_policy(cfg, 30, 3),
                                       LayerGroups.single(30) if cfg.policy == "snapkv"
                                       else LayerGroups(tuple(range(30))))
        lengths = ref.cache.lengths().max(dim=1).values.tolist()  # per layer
        per_group = [max(lengths)] if len(budgets) == 1 else lengths
        tail = 99 % cfg.decode_interval
        assert all(n <= b + tail for n, b in zip(per_group, budgets)), (per_group, budgets)
        assert stats["blocks_held_end"] == sum(-(-n // BLOCK) for n in per_group), stats
        assert stats["blocks_freed"] > 0


def test_short_soak(bundled_model_dir, tokenizer, hf_model):
    """Decode-time eviction's short soak (`mechanism_soak.py`) on the server above (snapkv
    naive 0.5, a 64-token decode budget every 32 tokens), per-request budgets among the
    overrides; its samples decode 40 tokens: a compression in each."""
    policy = CASES["snapkv-naive-0.5"]
    server = start_server(bundled_model_dir, server_flags(policy), reuse=True)
    short_soak(server, bundled_reference(hf_model, bundled_model_dir, policy),
               source_prompts(tokenizer, (300, 600)), new_tokens=40,
               xargs=[{"kv_sparsity": 0.3}, {"kv_decode_budget": 40, "kv_decode_interval": 24},
                      {"kv_teacher_forced": 4}])


@pytest.mark.slow  # CI's budget (140 s on this machine)
def test_a_bounded_policy_serves_a_longer_context_than_the_pool_holds_for_full(
        bundled_model_dir):
    """vLLM refuses to start when one request of --max-model-len would not fit: with a decode
    budget the policy's own worst case is what must fit (here 160 MiB: 8192 tokens of full
    attention need 0.35 GiB), and an 8000-token prompt is answered there."""
    server = start_server(bundled_model_dir, [
        *flags({"policy": "snapkv", "sparsity": 0.7, "decode_budget": 256}, 1024),
        "--max-model-len", "8192", "--kv-cache-memory-bytes", str(160 << 20)])
    ids = [100 + (7 * i) % 20000 for i in range(8000)]
    r = httpx.post(server.base_url + "/v1/completions", timeout=600,
                   json={"model": SERVED_NAME, "prompt": ids, "max_tokens": 150,
                         "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    stats = r.json()["kv_stats"]
    assert stats["completion_tokens"] == 150 and stats["decode_compressions"] == 1
    assert stats["kv_bytes_peak"] <= 160 << 20 < stats["full_kv_bytes_peak"]
