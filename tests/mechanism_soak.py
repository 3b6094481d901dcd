"""The short soak each served mechanism runs in CI (issue 87), on the server its file's reference
test started (`conftest.start_server(..., reuse=True)`: no second start).

One request of every kind `loadtest/soak.py` sends (plain and chat completions, stop strings,
streams, streams cancelled after 1-4 chunks and during prefill, n = 2, per-request overrides,
seeded sampling, long prompts, malformed bodies), more drawn by weight, and greedy samples of
real text sent twice among them. Then: no 5xx; every bad body a 4xx naming the field; kv_stats
on every completed response (a stream's in its last chunk); each request counted once; the pool
empty in every KV-cache group; the probe answering as before; the samples' tokens equal to the
reference's at their served chunks. Under tenants' salts (prefix caching), a prompt cached under
one salt reads 0 cached tokens under another's.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from typing import Callable

import httpx

from conftest import SERVED_NAME
from loadtest.soak import KINDS, SoakResult, run_soak

CI_REQUESTS = 16  # each of the 11 kinds once, 5 more by weight
CONCURRENCY = 8
TENANTS = ("tenant-a", "tenant-b")

# reference(prompt, chunk_ends, new_tokens) -> the reference's greedy token ids
Reference = Callable[[list[int], list[int], int], list[int]]


def greedy_sample(base_url: str, prompt: list[int], new_tokens: int, delay_s: float,
                  salt: str | None = None) -> dict:
    time.sleep(delay_s)  # (spread through the soak's first seconds)
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": new_tokens,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    if salt is not None:
        body["cache_salt"] = salt
    r = httpx.post(base_url + "/v1/completions", json=body, timeout=1800, trust_env=False)
    assert r.status_code == 200, r.text
    return {"prompt": prompt, **r.json()}


def served_chunk_ends(stats: dict, n: int) -> list[int]:
    """A token policy's eviction chunks E (`--kv-eviction-chunk`, pinned to the step budget
    under prefix caching: every multiple of E), else the chunk boundaries kv_stats gives
    (vLLM's steps; a head mask's canonical chunks)."""
    chunk = stats["params"].get("eviction_chunk")
    return list(range(chunk, n, chunk)) + [n] if chunk else stats["chunk_boundaries"]


def reference_mismatches(samples: list[dict], reference: Reference, new_tokens: int) -> list[str]:
    out, refs = [], {}
    for sample in samples:
        stats, prompt = sample["kv_stats"], sample["prompt"]
        ends = served_chunk_ends(stats, len(prompt))
        key = (tuple(prompt), tuple(ends))  # (a sample sent twice at the same chunks: once)
        if key not in refs:
            refs[key] = reference(prompt, ends, new_tokens)
        if sample["choices"][0]["token_ids"] != refs[key]:
            out.append(f"{len(prompt)} tokens (cached {stats.get('cached_tokens')}, "
                       f"boundaries {stats['chunk_boundaries']}): served != reference")
    return out


def short_soak(server, reference: Reference, prompts: list[list[int]], *, xargs: list[dict],
               long_tokens: int = 500, new_tokens: int = 8, tenants: bool = False,
               requests: int = CI_REQUESTS) -> SoakResult:
    """The soak on `server` with `prompts` as its greedy samples (each sent twice), and every
    check the module docstring names; `tenants`: the traffic under TENANTS' salts, then the
    salt check (the server must have prefix caching on)."""
    salts = TENANTS if tenants else ()
    with cf.ThreadPoolExecutor(2 * len(prompts)) as pool:
        # (after run_soak's probe and baseline: a sample done before them would go uncounted)
        futures = [pool.submit(greedy_sample, server.base_url, prompt, new_tokens, 4.0 + 2.0 * i,
                               salts[i % 2] if salts else None)
                   for i, prompt in enumerate(prompts + prompts)]
        result = run_soak(server.base_url, requests, CONCURRENCY, seed=1, xargs=xargs,
                          long_tokens=long_tokens, progress=False, side_requests=len(futures),
                          every_kind=True, salts=salts)
        samples = [f.result() for f in futures]
    assert result.failures == [], result
    assert set(result.by_kind) == set(KINDS), result.by_kind
    assert result.cancelled > 0 and result.bad > 0 and result.completed > 0, result
    assert reference_mismatches(samples, reference, new_tokens) == []
    if tenants:
        assert_salts_isolate(server.base_url, prompts[-1][::-1])
    return result


def assert_salts_isolate(base_url: str, prompt: list[int]) -> None:
    """A prompt no request sent before: cached within its tenant's salt, 0 under the other's."""
    def cached(salt: str) -> int:
        return greedy_sample(base_url, prompt, 2, 0.0, salt)["kv_stats"]["cached_tokens"]

    first, again, other = cached(TENANTS[0]), cached(TENANTS[0]), cached(TENANTS[1])
    assert (first, other) == (0, 0) and again > 0, (first, again, other)


def bundled_reference(hf_model, model_dir, policy: dict) -> Reference:
    """The bundled model's reference for `policy` (tests/test_policies_vllm.py's)."""
    from test_policies_vllm import reference

    return lambda prompt, ends, new_tokens: reference(hf_model, model_dir, policy, prompt, ends,
                                                      new_tokens).token_ids
