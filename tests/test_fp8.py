"""fp8 KV cache (`--kv-cache-dtype fp8|fp8_e4m3|fp8_e5m2`) with every policy.

vLLM's CPU kernels store x / scale rounded toward zero to the fp8 grid (test_vllm_contract.py
pins it). The served path lays a streaming head's window out of fp8 blocks with that rule
(`integration/attention/fp8.py`); the reference oracle quantizes its cache with its own code (`reference/
quantization.py`). Unit tests: the two quantizers agree, and a window read back as codes is
laid out as their grid values. Server tests: a tiny random Qwen3 (4 KV heads) served with an
fp8 cache gives the tokens of the reference with the same fp8 cache, and kv_stats count one
byte per element. CI runs a head mask and patched token eviction; the other policies and e5m2
are slow.
"""

from __future__ import annotations

import openai
import pytest
import torch
from compat_matrix import FP8_CI, FP8_IDS
from conftest import SERVED_NAME, pool_width, skip_without_fp8_kv_cache, start_server
from test_model_families_vllm import NEW_TOKENS, random_mask
from test_policies_vllm import flags, source_prompts
from test_tensor_parallel import TP_POLICIES

from vllm_kvevict.config import HEAD_MASK_POLICIES, KVPolicyConfig
from vllm_kvevict.integration.attention.fp8 import grid_values, quantize
from vllm_kvevict.integration.attention.step_plan import build_step_plan, lay_out_visible
from vllm_kvevict.masks import resolve_full_heads
from vllm_kvevict.policies import build_policy
from vllm_kvevict.reference import ReferenceRunner
from vllm_kvevict.reference.quantization import cached_kv

FORMATS = ("fp8", "fp8_e4m3", "fp8_e5m2")


@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
@pytest.mark.parametrize("scale", [1.0, 0.37, 8.0])
def test_served_and_reference_quantizers_agree(kv_cache_dtype, scale):
    torch.manual_seed(0)
    x = torch.randn(50000) * torch.logspace(-7, 6, 50000)  # subnormal to saturated
    x[:3] = torch.tensor([0.0, -0.0, 1e-30])
    served = grid_values(quantize(x, scale, kv_cache_dtype), kv_cache_dtype, torch.float32)
    assert torch.equal(served * scale, cached_kv(x, kv_cache_dtype, scale))
    # rounding toward zero: never larger in magnitude, saturating at the format's largest
    q = cached_kv(x, kv_cache_dtype, scale)
    assert bool((q.abs() <= x.abs()).all())
    largest = torch.finfo(torch.float8_e5m2 if kv_cache_dtype == "fp8_e5m2"
                          else torch.float8_e4m3fn).max
    assert float(q.abs().max()) == float(torch.tensor(largest) * scale)


def test_reference_refuses_unknown_cache_dtypes():
    with pytest.raises(ValueError, match="valid: auto, fp8, fp8_e4m3, fp8_e5m2"):
        cached_kv(torch.zeros(2), "int8")


def test_a_window_read_back_as_fp8_codes_is_laid_out_as_their_grid_values():
    """Streaming heads' blocks hold fp8 codes (one byte per element); a step lays the window
    read back from them, and its own K/V, out as the codes' grid values (written with scale 1
    they are the codes vLLM would have stored)."""
    sink, window, heads, d = 2, 4, 3, 64
    torch.manual_seed(0)
    k, one = torch.randn(10, heads, d) * 5, torch.randn(1, heads, d)
    plan = build_step_plan([10], [1], sink, window, block_size=16)
    seen = plan.prefix_pos  # the sink (0, 1) and the last 4 positions (6..9)
    assert seen.tolist() == [0, 1, 6, 7, 8, 9]
    codes = quantize(k[seen], 0.5, "fp8")
    assert codes.element_size() == 1
    laid = lay_out_visible(plan, codes, one[plan.chunk_src], 0.5, "fp8")
    assert torch.equal(laid[:6] * 0.5, cached_kv(k[seen], "fp8", 0.5))
    assert torch.equal(laid[6:] * 0.5, cached_kv(one, "fp8", 0.5))


# -- served ---------------------------------------------------------------------------------------

CHUNK = 128
PROMPT_LENGTHS = (300, 340)
CASES = [pytest.param((column, "fp8"), id=test_id,
                      marks=[] if column in FP8_CI else [pytest.mark.slow])
         for column, test_id in FP8_IDS.items()]
CASES.append(pytest.param(("prulong 0.7", "fp8_e5m2"), id="kv4-prulong-0.7-e5m2",
                          marks=pytest.mark.slow))
# the README's prulong (sink 64, window 256) with no --block-size: the fast layout (streaming
# heads in 64-token blocks read in place, full heads in 128) over fp8 codes
FAST = "prulong 0.7, fast layout"
CASES.append(pytest.param((FAST, "fp8"), id="kv4-prulong-0.7-fast-layout"))


@pytest.mark.server
@pytest.mark.parametrize("case", CASES)
def test_fp8_serves_the_reference_tokens(case, tiny_qwen3, tokenizer, one_torch_thread):
    from transformers import AutoModelForCausalLM

    column, kv_cache_dtype = case
    skip_without_fp8_kv_cache(kv_cache_dtype)
    model_dir = tiny_qwen3(4)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    policy = (dict(TP_POLICIES[column]) if column != FAST
              else {"policy": "prulong", "sparsity": 0.7})
    cfg = KVPolicyConfig.from_dict(policy)
    full_heads = None
    if cfg.policy in HEAD_MASK_POLICIES:
        policy["mask_path"] = str(random_mask(model_dir, model.config))
        cfg = KVPolicyConfig.from_dict(policy)
        full_heads, _ = resolve_full_heads(cfg, str(model_dir), 4, 4)
    runner = ReferenceRunner(model, build_policy(cfg, 4, 4, full_heads=full_heads),
                             kv_cache_dtype=kv_cache_dtype)
    server = start_server(model_dir, [*flags(policy, CHUNK), "--kv-cache-dtype", kv_cache_dtype])
    fast = "(the fast layout;" in server.log_tail(10 ** 6)
    assert fast == (column == FAST)
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")
    width = pool_width(server)
    fp8_differs = False
    for prompt in source_prompts(tokenizer, PROMPT_LENGTHS):
        r = client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=NEW_TOKENS,
                                      temperature=0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
        stats = r.model_extra["kv_stats"]
        ends = stats["chunk_boundaries"]
        ref = runner.generate(prompt, NEW_TOKENS, ends)
        assert r.choices[0].model_extra["token_ids"] == ref.token_ids, (column, len(prompt))
        # one byte per element: full attention's bytes are 4 layers x 2 x 4 heads x 64 x 1 per
        # token, in 128-token blocks
        tokens = len(prompt) + NEW_TOKENS - 1
        assert stats["full_kv_bytes_peak"] == 4 * 2 * 4 * 64 * 128 * -(-tokens // 128)
        if cfg.uses_head_mask and not fast:
            # every group's block: the plan's width in head pages x K, V x 128 x 64 x 1 byte
            assert stats["kv_bytes_peak"] == stats["blocks_held_peak"] * width * 2 * 128 * 64
        unquantized = ReferenceRunner(model, runner.policy).generate(prompt, NEW_TOKENS, ends)
        fp8_differs |= unquantized.token_ids != ref.token_ids or not torch.allclose(
            unquantized.first_token_logprobs, ref.first_token_logprobs, atol=1e-4)
    assert fp8_differs, "fp8 changed nothing on this model: the test checked nothing"


@pytest.mark.server
@pytest.mark.serial  # one rank per core
@pytest.mark.parametrize("column", ["prulong 0.7", "snapkv patched"])
def test_fp8_under_tensor_parallel_serves_the_reference_tokens(column, tiny_qwen3, tokenizer,
                                                               one_torch_thread):
    """fp8 KV x TP 2 (issue 87): each rank quantizes its own heads' pages with the layer's one
    scale; the served tokens equal the fp8 reference's (a head mask at the defaults: the fast
    layout; patched snapkv, whose scores each rank gathers). Where vLLM's CPU attention has no
    fp8 (AVX2 only), vLLM refuses the server, and the test says so."""
    from transformers import AutoModelForCausalLM

    from test_tensor_parallel import TP_ENV

    skip_without_fp8_kv_cache("fp8")
    model_dir = tiny_qwen3(4)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    policy = ({"policy": "prulong", "sparsity": 0.7} if column == "prulong 0.7"
              else dict(TP_POLICIES[column]))
    full_heads = None
    if policy["policy"] in HEAD_MASK_POLICIES:
        policy["mask_path"] = str(random_mask(model_dir, model.config))
        full_heads, _ = resolve_full_heads(KVPolicyConfig.from_dict(policy), str(model_dir), 4, 4)
    cfg = KVPolicyConfig.from_dict(policy)
    runner = ReferenceRunner(model, build_policy(cfg, 4, 4, full_heads=full_heads),
                             kv_cache_dtype="fp8")
    server = start_server(model_dir, [*flags(policy, CHUNK), "--kv-cache-dtype", "fp8",
                                      "--tensor-parallel-size", "2"], env=TP_ENV)
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")
    for prompt in source_prompts(tokenizer, PROMPT_LENGTHS):
        r = client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=NEW_TOKENS,
                                      temperature=0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
        stats = r.model_extra["kv_stats"]
        ref = runner.generate(prompt, NEW_TOKENS, stats["chunk_boundaries"])
        assert r.choices[0].model_extra["token_ids"] == ref.token_ids, (column, len(prompt))
        assert stats["tensor_parallel_size"] == 2
