"""Data parallel: `vllm serve --data-parallel-size 2` (two API servers, vLLM's default count),
one engine core per replica (vLLM's CPU data parallel on this 2-core machine, one core each),
each with its own policy state. Served greedy tokens equal the reference's (at the chunk
boundaries each replica reports); each response's kv_stats come from the replica that served it
(`data_parallel_rank`); the live view's timeline and the vllm_kvevict_* pool gauges are per
engine (`engines`, label `engine`). Both API servers answer lookups, aggregates and the
timeline the same, and count each request once in the vllm_kvevict_* series
(`server/shared.py`)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from compat_matrix import DP_CI, DP_IDS, V2_DP, V2_DP_CI
from conftest import SERVED_NAME, start_server
from test_model_families_vllm import NEW_TOKENS, random_mask, reference
from test_policies_vllm import flags, source_prompts
from test_tensor_parallel import TP_POLICIES
from vllm_kvevict.config import HEAD_MASK_POLICIES

DP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # one core per replica
CHUNK = 128
PROMPT_LENGTHS = (300, 340, 260, 380)
CASES = [pytest.param(column, "cpu", False, id=test_id,
                      marks=[] if column in DP_CI else [pytest.mark.slow])
         for column, test_id in DP_IDS.items()]
# the FlexAttention path: a head mask and patched token eviction (slow tier)
CASES += [pytest.param(column, "flex", False, id=f"{DP_IDS[column]}-flex",
                       marks=pytest.mark.slow)
          for column in ("prulong 0.7", "snapkv patched")]
# vLLM's V2 model runner in both replicas (triton_interpreter.server_env)
CASES += [pytest.param(column, backend, True, id=f"{DP_IDS[column]}-{backend}-v2",
                       marks=[] if (column, backend) in V2_DP_CI else [pytest.mark.slow])
          for column, backend in V2_DP]


@pytest.mark.server
@pytest.mark.serial  # one replica per core: no other server may hold a core meanwhile
@pytest.mark.served_release
@pytest.mark.parametrize("column, backend, v2", CASES)
def test_dp2_serves_the_reference_tokens_per_replica(column, backend, v2, tiny_qwen3, tokenizer,
                                                      one_torch_thread):
    from transformers import AutoModelForCausalLM

    from triton_interpreter import runners_in, server_env

    model_dir = tiny_qwen3(4)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    policy = dict(TP_POLICIES[column])  # the tensor-parallel tests' policies
    if backend == "flex":
        policy["attention_backend"] = "flex"
    name = policy["policy"]
    if policy["policy"] in HEAD_MASK_POLICIES:
        policy["mask_path"] = str(random_mask(model_dir, model.config))
    server = start_server(model_dir, [*flags(policy, CHUNK), "--data-parallel-size", "2"],
                          env={**DP_ENV, **(server_env() if v2 else {})})
    log = server.log_tail(10 ** 7)
    assert "Started 2 API server processes" in log  # vLLM's default count: the DP size
    assert f"attention_backend={backend}" in log or backend == "cpu"
    assert runners_in(log) == ((2, 0) if v2 else (0, 2))  # each replica's runner
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")
    prompts = source_prompts(tokenizer, PROMPT_LENGTHS)

    def ask(prompt):
        return client.completions.create(
            model=SERVED_NAME, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True})

    with ThreadPoolExecutor(len(prompts)) as pool:  # at once: both replicas get requests
        responses = list(pool.map(ask, prompts))
    ranks = set()
    for prompt, r in zip(prompts, responses):
        stats = r.model_extra["kv_stats"]
        ref = reference(model, model_dir, policy, prompt, stats["chunk_boundaries"])
        assert r.choices[0].model_extra["token_ids"] == ref.token_ids, (name, len(prompt))
        assert stats["policy"] == policy["policy"] and stats["prompt_tokens"] == len(prompt)
        ranks.add(stats["data_parallel_rank"])
    assert ranks == {0, 1}, ranks  # vLLM's balancer spread them
    with httpx.Client(base_url=server.base_url, timeout=30, trust_env=False) as http:
        timeline = http.get("/v1/kv_stats/timeline").json()
        assert sorted(timeline["engines"]) == ["0", "1"]
        assert all(view["pool"]["num_blocks"] for view in timeline["engines"].values())
        metrics = http.get("/metrics").text
    for engine in ("0", "1"):
        assert f'vllm_kvevict_pool_blocks{{engine="{engine}",policy="{policy["policy"]}"}}' \
            in metrics
    # a stop string ends a request in its API server; its stats may reach the other one
    probes, stopped = [], []
    for prompt in prompts[:2]:
        probes.append(client.completions.create(model=SERVED_NAME, prompt=prompt[:64],
                                                max_tokens=8, temperature=0))
        text = probes[-1].choices[0].text  # greedy: the same text again, up to the stop string
        stopped.append(client.completions.create(
            model=SERVED_NAME, prompt=prompt[:64], max_tokens=24, temperature=0,
            stop=[text[len(text) // 2:][:3]]))
        assert stopped[-1].model_extra["kv_stats"]["finish_reason"] == "stop", stopped[-1]
    assert_api_servers_agree(server.base_url, [r.id for r in responses + probes + stopped],
                             policy["policy"])


@pytest.mark.server
@pytest.mark.serial
def test_dp2_short_soak(tiny_qwen3, tokenizer, one_torch_thread):
    """DP 2's short soak (`mechanism_soak.py`) on the CI case's server above (patched snapkv
    0.5, vLLM's default two API servers sharing one kv_stats log): both replicas take its
    traffic; its samples equal the reference's."""
    from transformers import AutoModelForCausalLM

    from mechanism_soak import short_soak

    model_dir = tiny_qwen3(4)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    policy = TP_POLICIES[DP_CI[0]]
    server = start_server(model_dir, [*flags(policy, CHUNK), "--data-parallel-size", "2"],
                          env=DP_ENV, reuse=True)
    short_soak(server, lambda prompt, ends, _: reference(model, model_dir, policy, prompt,
                                                         ends).token_ids,
               source_prompts(tokenizer, (300, 340)), new_tokens=NEW_TOKENS,
               xargs=[{"kv_sparsity": 0.3}, {"kv_obs_window": 16}, {"kv_teacher_forced": 4}])


def assert_api_servers_agree(base_url: str, response_ids: list[str], policy: str) -> None:
    """Each new connection may reach either API server (vLLM shares one listening socket):
    every one serves the engines' policy (its own config, built from the launcher's args),
    finds every request, and all report the same aggregates and timeline engines; /metrics
    (vLLM's multiprocess collector) counts each request once."""
    views: dict[int, tuple] = {}
    for attempt in range(40):
        with httpx.Client(base_url=base_url, timeout=30, trust_env=False) as http:
            summary = http.get("/v1/kv_stats").json()
            views[summary["api_server_pid"]] = (
                summary["policy"], summary["params"],  # (each API server's own config)
                summary["aggregates"]["requests"],
                summary["aggregates"]["requests_per_finish_reason"],
                sorted(http.get("/v1/kv_stats/timeline").json()["engines"]))
            for rid in response_ids[attempt % 2::2]:
                assert http.get(f"/v1/kv_stats/{rid}").status_code == 200, rid
        if len(views) == 2 and attempt >= 3:
            break
    assert len(views) == 2, views  # both API servers answered
    assert len(set(map(repr, views.values()))) == 1, views
    served, _, requests, reasons, engines = next(iter(views.values()))
    assert served == policy, views
    assert requests == len(response_ids) and reasons.get("stop") == 2, views
    assert engines == ["0", "1"]
    with httpx.Client(base_url=base_url, timeout=30, trust_env=False) as http:
        metrics = http.get("/metrics").text
    counted = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                  if line.startswith("vllm_kvevict_requests_total{")
                  and f'policy="{policy}"' in line)
    assert counted == len(response_ids), counted


@pytest.mark.server
@pytest.mark.serial
@pytest.mark.slow  # CI's budget: TP's prefix-caching test is the same mechanism per engine
def test_dp2_prefix_caching_with_naive_token_eviction(tiny_qwen3, tokenizer, one_torch_thread):
    """`--enable-prefix-caching` with naive snapkv under DP 2: each replica's engine core
    keeps its own cache. The same prompt sent four times one after the other reaches one
    replica at least twice, and a later one there hits its last chunk boundary (256); a prompt
    sharing the first 200 tokens hits 128 where it meets a replica holding them (256 where it
    meets its own earlier row). Every answer
    equals the reference at the canonical chunks, cold or hit."""
    from transformers import AutoModelForCausalLM

    policy = TP_POLICIES["snapkv naive"]
    model_dir = tiny_qwen3(4)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    server = start_server(model_dir, [*flags(policy, CHUNK), "--data-parallel-size", "2",
                                      "--api-server-count", "1", "--enable-prefix-caching"],
                          env=DP_ENV)
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")
    prompt, other = source_prompts(tokenizer, (340, 340))
    seen: dict[int, set[int]] = {}  # replica -> cached token counts of the full prompt
    for ids in [prompt] * 4 + [prompt[:200] + other[200:]] * 2:
        r = client.completions.create(model=SERVED_NAME, prompt=ids, max_tokens=NEW_TOKENS,
                                      temperature=0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
        stats = r.model_extra["kv_stats"]
        cached = stats["cached_tokens"]
        # (the shared one: 128 on a replica holding the prompt, 256 on one holding itself)
        assert cached in ((0, 256) if ids is prompt else (0, 128, 256)), stats
        if ids is prompt:
            seen.setdefault(stats["data_parallel_rank"], set()).add(cached)
        ends = list(range(CHUNK, len(ids), CHUNK)) + [len(ids)]
        ref = reference(model, model_dir, policy, ids, ends)
        assert r.choices[0].model_extra["token_ids"] == ref.token_ids, (cached, stats)
    assert any(256 in counts for counts in seen.values()), seen
