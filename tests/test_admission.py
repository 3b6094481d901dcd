"""Admission under memory pressure: a pool too small for every request's decode growth.

Stock vLLM admits a request when its prompt fits and later preempts (and recomputes) when decode
growth runs the pool dry; a plain recompute of an evicting request is not exact (new chunk
boundaries, generated tokens prefilled as a chunk). Two modes (`integration/core/admission.py`):
- reserve (default): an evicting request is admitted only when its whole growth fits next to
  the running requests': no preemption;
- vllm: stock admission, so vLLM preempts, and the plugin replays each preempted request with
  its first run's prompt chunks and one generated token per step.
Either way the output checked (the first request, or the first preempted one: a 200-token
reference decode is slow) is the reference oracle's at the chunk boundaries the server reports
(several prefills share the token budget, so the boundaries are not those of a lone run).
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from conftest import SERVED_NAME, start_server
from mechanism_soak import bundled_reference, short_soak
from test_policies_vllm import flags, reference, source_prompts

pytestmark = pytest.mark.server

PROMPT_LEN, MAX_TOKENS, NUM_REQUESTS = 500, 200, 6
CHECKED = 1  # requests compared with the reference (a 200-token plain PyTorch decode is slow)


def preemptions(base_url: str) -> float:
    for line in httpx.get(base_url + "/metrics").text.splitlines():
        if line.startswith("vllm:num_preemptions_total"):
            return float(line.split()[-1])
    raise AssertionError("vllm:num_preemptions_total missing from /metrics")


async def complete_all(base_url: str, prompts: list[list[int]]) -> list[dict]:
    async with httpx.AsyncClient(timeout=600) as client:
        async def one(ids):
            body = {"model": SERVED_NAME, "prompt": ids, "max_tokens": MAX_TOKENS,
                    "temperature": 0, "ignore_eos": True}
            r = await client.post(base_url + "/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()
        return await asyncio.gather(*(one(ids) for ids in prompts))


@pytest.mark.parametrize("policy, pool_mib", [
    # 64 MiB with the shipped 0.7 mask: vLLM would admit all 6 prompts (their prompt blocks
    # fit), their growth does not fit in every group
    # (slow tier: CI's budget; CI runs a head mask's forced preemption below)
    pytest.param({"policy": "prulong", "sparsity": 0.7, "sink": 16, "window": 64}, 64,
                 id="prulong", marks=pytest.mark.slow),
    # token eviction: 100 MiB = 17 blocks of all 30 layers x 3 KV heads (vLLM's minimum for
    # the 2048-token model length); a request needs 4 blocks at its largest
    # (slow tier: CI runs token eviction's forced preemption below)
    pytest.param({"policy": "snapkv", "sparsity": 0.7, "eviction": "patched"}, 100, id="snapkv",
                 marks=pytest.mark.slow),
])
def test_no_preemption_and_exact_outputs_under_pressure(bundled_model_dir, tokenizer, hf_model,
                                                        policy, pool_mib):
    server = start_server(bundled_model_dir, [*flags(policy, 256), "--max-model-len", "2048",
                                              "--kv-cache-memory-bytes", str(pool_mib << 20)])
    prompts = [[100 + (37 * i + 11 * j) % 20000 for j in range(PROMPT_LEN)]
               for i in range(NUM_REQUESTS)]
    before = preemptions(server.base_url)
    together = asyncio.run(complete_all(server.base_url, prompts))
    assert preemptions(server.base_url) == before
    assert all(c["kv_stats"]["preemptions"] == 0 for c in together)
    # they really competed for the pool: not all of them ran at once
    starts = sorted(c["kv_stats"]["queue_s"] for c in together)
    assert starts[-1] > 1.0, starts
    for ids, served in list(zip(prompts, together))[:CHECKED]:
        ends = served["kv_stats"]["chunk_boundaries"]
        ref = reference(hf_model, bundled_model_dir, policy, ids, ends, MAX_TOKENS)
        assert served["choices"][0]["text"] == tokenizer.decode(ref.token_ids), ends


SLOW = pytest.mark.slow  # the rest of the compatibility matrix's preemption row


def forced_flags(policy: dict, pool_mib: int, max_len: int, more=()) -> list[str]:
    return [*flags(policy, 256), "--kv-admission", "vllm", "--max-model-len", str(max_len),
            "--kv-cache-memory-bytes", str(pool_mib << 20), *more]


@pytest.mark.parametrize("policy, pool_mib, max_len", [
    # 11 blocks (vLLM's minimum for 1024 tokens is 8): several requests preempted, in
    # prefill and in decode
    # (slow tier, with decode-time eviction's: CI's budget; CI forces preemption under the
    # head mask below)
    pytest.param({"policy": "snapkv", "sparsity": 0.9, "eviction": "patched"}, 64, 1024,
                 id="snapkv", marks=SLOW),
    # decode-time eviction: a preempted request's recompute compresses at the same generated
    # lengths with the same decode queries
    pytest.param({"policy": "snapkv", "sparsity": 0.5, "eviction": "naive",
                  "decode_budget": 96, "decode_interval": 32, "obs_window": 16}, 64, 1024,
                 id="snapkv-decode", marks=SLOW),
    # stock vLLM's recompute (prefix caching on): 46 KiB of KV per token
    pytest.param({"policy": "full"}, 64, 1024, id="full", marks=SLOW),
    # a head mask (canonical chunks, prefix caching on): vLLM preempts and frees every
    # group's blocks, the recompute may hit the request's own prompt blocks
    pytest.param({"policy": "prulong", "sparsity": 0.7, "sink": 16, "window": 64}, 64, 2048,
                 id="prulong"),
    # ... and without prefix caching: a step's tokens before its last W are never stored, the
    # recompute replays the first run's steps
    pytest.param({"policy": "prulong", "sparsity": 0.7, "sink": 16, "window": 64}, 64, 2048,
                 id="prulong-nopc", marks=SLOW),
    # every head streaming: only the streaming companions' groups, sink + window + a step
    # each (15 groups of 6 head pages: 5.9 MB per block position; 48 MiB hold 8 of them)
    pytest.param({"policy": "streaming", "sink": 16, "window": 64}, 48, 1024, id="streaming",
                 marks=SLOW),
    pytest.param({"policy": "duo", "sparsity": 0.3, "sink": 16, "window": 64}, 48, 1024,
                 id="duo", marks=SLOW),
    pytest.param({"policy": "snapkv", "sparsity": 0.9, "eviction": "naive"}, 64, 1024,
                 id="snapkv-naive", marks=SLOW),
    pytest.param({"policy": "pyramidkv", "sparsity": 0.9, "eviction": "naive", "tiers": 3}, 64,
                 1024, id="pyramidkv-naive", marks=SLOW),
    pytest.param({"policy": "pyramidkv", "sparsity": 0.9, "eviction": "patched"}, 64, 1024,
                 id="pyramidkv-patched", marks=SLOW),
    # a head mask with token eviction on its full heads (--kv-token-policy)
    pytest.param({"policy": "prulong", "sparsity": 0.5, "sink": 16, "window": 64,
                  "token_policy": "snapkv", "token_sparsity": 0.9, "eviction": "patched"}, 48,
                 1024, id="prulong-snapkv", marks=SLOW),
])
def test_forced_preemption_replays_exactly(request, bundled_model_dir, tokenizer, hf_model,
                                           policy, pool_mib, max_len):
    """Stock admission in the same pools: vLLM preempts, and a preempted request's output is
    still the reference oracle's (its recompute follows its first run's chunks)."""
    nopc = ["--no-enable-prefix-caching"] if request.node.callspec.id.endswith("-nopc") else []
    server = start_server(bundled_model_dir, forced_flags(policy, pool_mib, max_len, nopc))
    # real text: a plain recompute (new chunk boundaries, generated tokens as one chunk)
    # changes these outputs; synthetic id runs are continued the same way whatever the KV
    prompts = source_prompts(tokenizer, [PROMPT_LEN] * NUM_REQUESTS)
    before = preemptions(server.base_url)
    together = asyncio.run(complete_all(server.base_url, prompts))
    assert preemptions(server.base_url) > before
    if policy["policy"] == "prulong":  # kv_stats names the mask served (the shipped default)
        shipped = f"prulong-s{policy['sparsity']}.json"
        assert {c["kv_stats"]["params"].get("mask") for c in together} == {shipped}
    preempted = [(ids, c) for ids, c in zip(prompts, together) if c["kv_stats"]["preemptions"]]
    assert preempted, [c["kv_stats"]["preemptions"] for c in together]
    for ids, served in preempted[:CHECKED]:  # (each a 200-token reference decode)
        ends = served["kv_stats"]["chunk_boundaries"]
        ref = reference(hf_model, bundled_model_dir, policy, ids, ends, MAX_TOKENS)
        assert served["choices"][0]["text"] == tokenizer.decode(ref.token_ids), ends


FORCED_SOAK = {"policy": "prulong", "sparsity": 0.7, "sink": 16, "window": 64}


def test_short_soak_under_forced_preemption(bundled_model_dir, tokenizer, hf_model):
    """Forced preemption's short soak (`mechanism_soak.py`) on the server of the CI case above
    (prulong 0.7 under vLLM's admission in 64 MiB, prefix caching on)."""
    server = start_server(bundled_model_dir, forced_flags(FORCED_SOAK, 64, 2048), reuse=True)
    short_soak(server, bundled_reference(hf_model, bundled_model_dir, FORCED_SOAK),
               source_prompts(tokenizer, (300, 600)), xargs=[{"kv_teacher_forced": 4}])
