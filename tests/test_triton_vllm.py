"""`--kv-attention-backend triton` served by `vllm serve` (bundled model) with our head-pages
kernel in Triton's interpreter (`TRITON_INTERPRET=1`: this machine has no Triton CPU backend):
greedy tokens identical to the reference, first-token log-prob close, a prefix-cache hit
included; and the start-up refusal of what the Triton path does not serve yet
(`kernels/support.py`)."""

from __future__ import annotations

import pytest
import torch
from conftest import start_server
from test_policies_vllm import CASES as POLICY_CASES
from test_policies_vllm import (LOGPROB_TOL, flags, reference, served, source_prompts)

from vllm_kvevict.config import KVPolicyConfig
from vllm_kvevict.kernels.support import triton_error

TRITON = {"attention_backend": "triton"}
INTERPRETER = {"TRITON_INTERPRET": "1"}
CASES = {"full": ({"policy": "full"}, 256), **POLICY_CASES}
PROMPT_LENGTHS = (300,)  # a 256-token step, then a partial chunk


@pytest.mark.server
@pytest.mark.parametrize("case", ["prulong-0.7", *(pytest.param(c, marks=pytest.mark.slow)
                                                    for c in ("full", "streaming", "duo-0.3"))])
def test_triton_matches_reference(case, bundled_model_dir, tokenizer, hf_model):
    policy, chunk = CASES[case]
    server = start_server(bundled_model_dir, flags({**policy, **TRITON}, chunk),
                          env=INTERPRETER)
    log = server.log_path.read_text(errors="replace")
    assert "attention_backend=triton" in log
    for prompt in source_prompts(tokenizer, PROMPT_LENGTHS):
        ref = reference(hf_model, bundled_model_dir, policy, prompt, chunk)
        for _ in range(2):  # the second from the prefix cache (whole 256-token chunks)
            text, logprob = served(server.base_url, prompt)
            assert text == tokenizer.decode(ref.token_ids), f"{case}, {len(prompt)} tokens"
            assert abs(logprob - float(ref.first_token_logprobs.max())) < LOGPROB_TOL


class _Stand:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def _config(cache_dtype="auto", tp=1, pp=1, dp=1, spec=None):
    return _Stand(cache_config=_Stand(cache_dtype=cache_dtype), speculative_config=spec,
                  parallel_config=_Stand(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                         data_parallel_size=dp))


@pytest.mark.parametrize("policy,where,named", [
    ({"policy": "snapkv", "sparsity": 0.5}, {}, "--kv-policy snapkv"),
    ({"policy": "prulong", "sparsity": 0.5, "token_policy": "snapkv"}, {},
     "--kv-token-policy snapkv"),
    ({"policy": "duo"}, {"platform": "cuda"}, "platform 'cuda'"),
    ({"policy": "duo"}, {"interpreting": False}, "TRITON_INTERPRET=1"),
    ({"policy": "full"}, {"cache_dtype": "fp8"}, "--kv-cache-dtype fp8"),
    ({"policy": "duo"}, {"tp": 2}, "--tensor-parallel-size 2"),
    ({"policy": "duo"}, {"dp": 2}, "--data-parallel-size 2"),
    ({"policy": "duo"}, {"spec": object()}, "speculative decoding"),
], ids=["snapkv", "hybrid", "cuda", "no-interpreter", "fp8", "tp", "dp", "spec"])
def test_triton_refusals_name_the_flag(policy, where, named):
    cfg = KVPolicyConfig.from_dict({**policy, **TRITON})
    where = dict(where)
    platform, interpreting = where.pop("platform", "cpu"), where.pop("interpreting", True)
    error = triton_error(cfg, _config(**where), platform, interpreting)
    assert error and named in error and "supported:" in error, error
    assert triton_error(KVPolicyConfig.from_dict({"policy": "duo", **TRITON}), _config(),
                        "cpu", True) is None


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
