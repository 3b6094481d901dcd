"""Each supported model family served with an evicting policy (tiny random models from
tests/tiny_models.py, through the OpenAI API) against the plain-PyTorch reference, which
test_model_families.py shows computes each family's own attention inputs: greedy tokens
identical, first-token log-prob close.

One server per (family, policy). Prompts go one at a time, so vLLM prefills them in the
regular 128-token chunks; the reference is still given the boundaries the server reports.
CI runs a head mask on llama3 (and qwen3, elsewhere) and patched snapkv on qwen2; the other
combinations, mistral's included, are slow (CI's budget), and scripts/model_matrix.py runs the
whole grid (docs/results/model_matrix/).
"""

from __future__ import annotations

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import SERVED_NAME, start_server
from test_policies_vllm import LOGPROB_TOL, flags, source_prompts
from tiny_models import FAMILIES, build_tiny_model
from vllm_kvevict.config import HEAD_MASK_POLICIES, KVPolicyConfig
from vllm_kvevict.masks import HeadGates, resolve_full_heads, save_head_gates
from vllm_kvevict.policies import build_policy
from vllm_kvevict.reference import ReferenceRunner

pytestmark = pytest.mark.server

CHUNK = 128  # --max-num-batched-tokens: 300-token prompts prefill in 3 chunks
NEW_TOKENS = 16
PROMPT_LENGTHS = (300, 340)
POLICIES = {
    # sink + window well under the prompt, so streaming heads do drop tokens
    "prulong": {"policy": "prulong", "sparsity": 0.7, "sink": 16, "window": 64},
    "snapkv-patched": {"policy": "snapkv", "sparsity": 0.5, "eviction": "patched"},
    "pyramidkv-naive": {"policy": "pyramidkv", "sparsity": 0.5, "eviction": "naive",
                        "tiers": 2},
}
# CI: each mechanism at least once, each family but Qwen3 once here (CI serves tiny Qwen3
# models against the reference in test_hybrid.py and test_tensor_parallel.py); the rest is the
# slow tier (and the full grid is scripts/model_matrix.py)
CI = {("llama3", "prulong"), ("qwen2", "snapkv-patched")}  # (mistral: slow, CI's budget)
CASES = [pytest.param((family, name), id=f"{family}-{name}",
                      marks=[] if (family, name) in CI else [pytest.mark.slow])
         for family in FAMILIES for name in POLICIES]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """family -> its tiny model's directory, built on first use."""
    root, built = tmp_path_factory.mktemp("families"), {}

    def get(family: str):
        if family not in built:
            built[family] = build_tiny_model(family, root)
        return built[family]

    return get


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """Every test here runs the reference beside a server."""


def random_mask(model_dir, config):
    """A random gate per KV head in our JSON format (no mask is shipped for a tiny model)."""
    gates = torch.rand(config.num_hidden_layers, config.num_key_value_heads,
                       generator=torch.Generator().manual_seed(0))
    path = model_dir.parent / f"{model_dir.name}-mask.json"
    save_head_gates(path, HeadGates(gates, meta={"model": model_dir.name, "objective": "random"}))
    return path


@pytest.fixture(scope="module", params=CASES)
def case(request, tiny_model_dir):
    """(model dir, policy dict, transformers model, server); one server start per case."""
    family, name = request.param
    model_dir = tiny_model_dir(family)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    policy = dict(POLICIES[name])
    if policy["policy"] in HEAD_MASK_POLICIES:
        policy["mask_path"] = str(random_mask(model_dir, model.config))
    server = start_server(model_dir, flags(policy, CHUNK))
    return model_dir, policy, model, server


def reference(model, model_dir, policy: dict, prompt, chunk_ends):
    cfg = KVPolicyConfig.from_dict(policy)
    layers, heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    full_heads = None
    if cfg.policy in HEAD_MASK_POLICIES:
        full_heads, _ = resolve_full_heads(cfg, str(model_dir), layers, heads)
        assert full_heads.any() and not full_heads.all()  # both kinds of head are exercised
    runner = ReferenceRunner(model, build_policy(cfg, layers, heads, full_heads=full_heads))
    return runner.generate(prompt, NEW_TOKENS, chunk_ends)


def test_served_tokens_match_reference(case, tokenizer):
    model_dir, policy, model, server = case
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")
    for prompt in source_prompts(tokenizer, PROMPT_LENGTHS):
        # token ids, not text: random models emit arbitrary tokens that may decode alike
        r = client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=NEW_TOKENS,
                                      temperature=0, logprobs=1,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
        choice, stats = r.choices[0], r.model_extra["kv_stats"]
        ends = stats["chunk_boundaries"]
        assert ends == list(range(CHUNK, len(prompt), CHUNK)) + [len(prompt)], ends
        ref = reference(model, model_dir, policy, prompt, ends)
        assert choice.model_extra["token_ids"] == ref.token_ids, (model_dir.name, len(prompt))
        first = choice.logprobs.token_logprobs[0]
        assert abs(first - float(ref.first_token_logprobs.max())) < LOGPROB_TOL
        # the policy really evicts something that matters on this model
        full = reference(model, model_dir, {"policy": "full"}, prompt, ends)
        gap = (ref.first_token_logprobs - full.first_token_logprobs).abs().max()
        assert gap > 1e-2, (model_dir.name, policy, float(gap))


@pytest.mark.slow  # CI's budget (74 s on this machine)
def test_llama31_shaped_model_serves_the_released_duo_pattern(tmp_path, tokenizer):
    """A random model with Llama-3.1-8B-Instruct's 32 layers x 8 KV heads (tiny hidden size), in
    a directory named like the HF model: `--kv-policy duo` without --kv-mask serves DuoAttention's
    released pattern (head_masks/Meta-Llama-3.1-8B-Instruct/duo.json), the start-up line names
    it, and the served tokens equal the reference's under that mask."""
    from vllm_kvevict.masks import HEAD_MASKS_DIR

    model_dir = build_tiny_model("llama3", tmp_path, num_kv_heads=8, num_layers=32,
                                 name="Llama-3.1-8B-Instruct", init_std=0.02)
    shipped = HEAD_MASKS_DIR / "Meta-Llama-3.1-8B-Instruct" / "duo.json"
    policy = {"policy": "duo", "sparsity": 0.5, "sink": 16, "window": 64}
    # 32 x 8 heads of 64 in float32: 128 KiB a token at full attention; the 512 MiB pool
    # holds a 2K context comfortably
    server = start_server(model_dir, [*flags(policy, CHUNK), "--max-model-len", "2048"])
    line = next(x for x in server.log_tail(10 ** 7).splitlines()
                if "vllm-kvevict: serving policy=duo" in x)
    assert f"mask_path={shipped}" in line, line
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    (prompt,) = source_prompts(tokenizer, (300,))
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")
    r = client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=NEW_TOKENS,
                                  temperature=0, logprobs=1,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    stats = r.model_extra["kv_stats"]
    assert stats["params"]["mask"] == "duo.json"
    ref = reference(model, model_dir, {**policy, "mask_path": str(shipped)}, prompt,
                    stats["chunk_boundaries"])
    assert r.choices[0].model_extra["token_ids"] == ref.token_ids
    first = r.choices[0].logprobs.token_logprobs[0]
    assert abs(first - float(ref.first_token_logprobs.max())) < LOGPROB_TOL
    full = reference(model, model_dir, {"policy": "full"}, prompt, stats["chunk_boundaries"])
    assert full.token_ids[0] != ref.token_ids[0]  # the released pattern matters here
