"""`--kv-attention-backend triton` served by `vllm serve` with our head-pages kernel in Triton's
interpreter (`TRITON_INTERPRET=1`: this machine has no Triton CPU backend): greedy tokens
identical to the reference, first-token log-prob close. CI serves the bundled model's prulong
0.7 (a head mask, a prefix-cache hit included) and the other impls (token eviction with
decode-time eviction, the hybrid with patched questions) on a tiny random model (the
interpreter's cost grows with layers x heads); the other cells are the slow tier. And the start-up refusal of what the
Triton path does not serve yet (`kernels/support.py`)."""

from __future__ import annotations

import pytest
import torch
import openai
from conftest import SERVED_NAME, start_server
from test_model_families_vllm import random_mask
from test_model_families_vllm import reference as tiny_reference
from test_policies_vllm import CASES as POLICY_CASES
from test_policies_vllm import (LOGPROB_TOL, flags, reference, served, source_prompts)
from tiny_models import build_tiny_model
from transformers import AutoModelForCausalLM

from vllm_kvevict.config import KVPolicyConfig
from vllm_kvevict.kernels.support import triton_error

TRITON = {"attention_backend": "triton"}
INTERPRETER = {"TRITON_INTERPRET": "1"}
CASES = {"full": ({"policy": "full"}, 256), **POLICY_CASES,
         "snapkv-patched-0.7": ({"policy": "snapkv", "sparsity": 0.7, "eviction": "patched"},
                                256)}
PROMPT_LENGTHS = (300,)  # a 256-token step, then a partial chunk


@pytest.mark.server
@pytest.mark.parametrize("case", ["prulong-0.7", *(
    pytest.param(c, marks=pytest.mark.slow) for c in (
        "full", "streaming", "duo-0.3", "snapkv-naive-0.5", "snapkv-patched-0.5",
        "snapkv-patched-0.7", "pyramidkv-naive-0.5-tiers3", "pyramidkv-patched-0.7",
        "hybrid-prulong-0.5-snapkv-patched-0.5", "snapkv-naive-0.5-decode"))])
def test_triton_matches_reference(case, bundled_model_dir, tokenizer, hf_model):
    policy, chunk = CASES[case]
    server = start_server(bundled_model_dir, flags({**policy, **TRITON}, chunk),
                          env=INTERPRETER)
    log = server.log_path.read_text(errors="replace")
    assert "attention_backend=triton" in log
    for prompt in source_prompts(tokenizer, PROMPT_LENGTHS):
        ref = reference(hf_model, bundled_model_dir, policy, prompt, chunk)
        for _ in range(2):  # the second from the prefix cache (head masks: whole chunks)
            text, logprob = served(server.base_url, prompt)
            assert text == tokenizer.decode(ref.token_ids), f"{case}, {len(prompt)} tokens"
            assert abs(logprob - float(ref.first_token_logprobs.max())) < LOGPROB_TOL


TINY_CHUNK = 128  # a 300-token prompt prefills in 3 steps
TINY_CASES = {
    # a head mask (TritonHeadMaskImpl): full and streaming heads in one launch
    "prulong": {"policy": "prulong", "sparsity": 0.5, "sink": 16, "window": 64},
    # token eviction (TritonTokenImpl) with decode-time eviction: 150 kept after the prompt,
    # compressed to 64 every 4 generated tokens
    "snapkv-naive-decode": {"policy": "snapkv", "sparsity": 0.5, "eviction": "naive",
                            "decode_budget": 64, "decode_interval": 4},
    # the hybrid (TritonHybridImpl): patched questions on full and streaming heads
    "hybrid-patched": {"policy": "prulong", "sparsity": 0.5, "sink": 16, "window": 64,
                       "token_policy": "snapkv", "token_sparsity": 0.5,
                       "eviction": "patched"},
    "pyramidkv-patched": {"policy": "pyramidkv", "sparsity": 0.5, "eviction": "patched",
                          "tiers": 2},
}


@pytest.mark.server
@pytest.mark.parametrize("case", [  # CI: the impls the bundled model's CI cell does not run
    "snapkv-naive-decode", "hybrid-patched",
    *(pytest.param(c, marks=pytest.mark.slow) for c in ("prulong", "pyramidkv-patched"))])
def test_triton_serves_the_reference_on_a_tiny_model(case, tmp_path, tokenizer,
                                                     one_torch_thread):
    """Each Triton impl served against the reference on a tiny random llama3 (4 layers, 2 KV
    heads): token ids equal, first-token log-prob close, and the policy changes the answer's
    distribution (it evicted something that matters)."""
    model_dir = build_tiny_model("llama3", tmp_path)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    policy = dict(TINY_CASES[case])
    if "sink" in policy:
        policy["mask_path"] = str(random_mask(model_dir, model.config))
    server = start_server(model_dir, flags({**policy, **TRITON}, TINY_CHUNK), env=INTERPRETER)
    assert "attention_backend=triton" in server.log_path.read_text(errors="replace")
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")
    prompt = source_prompts(tokenizer, (300,))[0]
    r = client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=16,
                                  temperature=0, logprobs=1,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    choice, stats = r.choices[0], r.model_extra["kv_stats"]
    ends = stats["chunk_boundaries"]
    assert ends == [128, 256, 300], ends
    ref = tiny_reference(model, model_dir, policy, prompt, ends)
    assert choice.model_extra["token_ids"] == ref.token_ids, case
    assert abs(choice.logprobs.token_logprobs[0] - float(ref.first_token_logprobs.max())) \
        < LOGPROB_TOL
    if "decode_budget" in policy:  # 16 tokens: compressed after the 4th, 8th, 12th
        assert stats["decode_compressions"] == 3, stats
    full = tiny_reference(model, model_dir, {"policy": "full"}, prompt, ends)
    assert (ref.first_token_logprobs - full.first_token_logprobs).abs().max() > 1e-2


class _Stand:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def _config(cache_dtype="auto", tp=1, pp=1, dp=1, spec=None):
    return _Stand(cache_config=_Stand(cache_dtype=cache_dtype), speculative_config=spec,
                  parallel_config=_Stand(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                         data_parallel_size=dp))


@pytest.mark.parametrize("policy,where,named", [
    ({"policy": "snapkv"}, {"platform": "cuda"}, "platform 'cuda'"),
    ({"policy": "duo"}, {"interpreting": False}, "TRITON_INTERPRET=1"),
    ({"policy": "full"}, {"cache_dtype": "fp8"}, "--kv-cache-dtype fp8"),
    ({"policy": "duo"}, {"tp": 2}, "--tensor-parallel-size 2"),
    ({"policy": "duo"}, {"dp": 2}, "--data-parallel-size 2"),
    ({"policy": "duo"}, {"spec": object()}, "speculative decoding"),
], ids=["cuda", "no-interpreter", "fp8", "tp", "dp", "spec"])
def test_triton_refusals_name_the_flag(policy, where, named):
    cfg = KVPolicyConfig.from_dict({**policy, **TRITON})
    where = dict(where)
    platform, interpreting = where.pop("platform", "cpu"), where.pop("interpreting", True)
    error = triton_error(cfg, _config(**where), platform, interpreting)
    assert error and named in error and "supported:" in error, error
    for served in ({"policy": "duo"}, {"policy": "snapkv", "sparsity": 0.5},
                   {"policy": "prulong", "token_policy": "pyramidkv"}):
        assert triton_error(KVPolicyConfig.from_dict({**served, **TRITON}), _config(), "cpu",
                            True) is None


@pytest.mark.parametrize("layout", ["head-pages", "layer-outer"])
def test_pool_pages_address_every_heads_block(layout):
    """The kernel's pool page of each (head, block) holds exactly that head's block of the
    layer: one head per cache layer (the head-pages layout), or a layer's heads side by side in
    each token's row (vLLM's layer-outer layout, `full`)."""
    from vllm_kvevict.integration.attention.triton_attention import page_table, pool_pages

    layers, blocks, size, heads, hs = 3, 5, 4, 2, 8
    buf = torch.randn(layers * blocks * size * heads * 2 * hs)
    for layer in range(layers):
        flat = buf[layer * blocks * size * heads * 2 * hs:][:blocks * size * heads * 2 * hs]
        cache = (flat.view(blocks, size, heads, 2 * hs).transpose(1, 2)
                 if layout == "layer-outer" else flat.view(blocks, 1, size * heads, 2 * hs))
        k, v, unit = pool_pages(cache, hs)
        order = [3, 1, 4]
        table = page_table(cache, torch.tensor([order], dtype=torch.int32), unit)
        for h in range(cache.shape[1]):
            for j, b in enumerate(order):
                page = int(table[0, h, j])
                assert torch.equal(k[page], cache[b, h, :, :hs])
                assert torch.equal(v[page], cache[b, h, :, hs:])
