"""A head mask composed with token eviction (`--kv-policy prulong --kv-token-policy snapkv`).

Streaming heads keep sink + window; full heads keep, of each prefill chunk, what the token
policy keeps at `--kv-token-sparsity`. Unit tests: the policy answers the two questions from
its two parts, the streaming plan lays out patched questions behind their chunk and commits
nothing of them. Server tests: a tiny random Qwen3 (4 KV heads, a random mask) served with the
hybrid gives the reference oracle's tokens at the served chunk boundaries, at several
(head, token) sparsity pairs, both eviction modes, both token policies and two chunk sizes;
kv_stats count the full heads' compacted blocks and the streaming store.
"""

from __future__ import annotations

import openai
import pytest
import torch
from conftest import SERVED_NAME, pool_width, skip_without_fp8_kv_cache, start_server
from mechanism_soak import bundled_reference, short_soak
from test_model_families_vllm import NEW_TOKENS, random_mask
from test_policies_vllm import flags, source_prompts

from vllm_kvevict.config import KVPolicyConfig, KVPolicyError
from vllm_kvevict.features import parallel_error, speculative_error
from vllm_kvevict.footprint import kv_footprint
from vllm_kvevict.integration.attention.step_plan import build_step_plan
from vllm_kvevict.masks import resolve_full_heads
from vllm_kvevict.policies import HybridPolicy, build_policy
from vllm_kvevict.reference import ReferenceRunner


def hybrid(**cfg) -> KVPolicyConfig:
    return KVPolicyConfig(**{"policy": "prulong", "sparsity": 0.5, "token_policy": "snapkv",
                             "token_sparsity": 0.5, **cfg})


def test_hybrid_policy_answers_from_its_two_parts():
    full = torch.tensor([[True, False], [False, False], [True, True]])
    for token_policy in ("snapkv", "pyramidkv"):
        cfg = hybrid(token_policy=token_policy, token_sparsity=0.7)
        pol = build_policy(cfg, 3, 2, full_heads=full)
        assert isinstance(pol, HybridPolicy) and pol.evicts_tokens
        assert torch.equal(pol.streaming_heads(), ~full)
        alone = build_policy(KVPolicyConfig(policy=token_policy, sparsity=0.7), 3, 2)
        for layer in range(3):
            for c, final in ((128, False), (77, True)):
                assert pol.chunk_keep(layer, c, final) == alone.chunk_keep(layer, c, final)
    # one KV-cache group: layers of unequal page sizes would get unequal block sizes
    assert hybrid(token_policy="pyramidkv").num_tiers(4) == 1 and hybrid().num_tiers(4) == 1


@pytest.mark.parametrize("raw, field", [
    ({"policy": "snapkv", "token_policy": "snapkv"}, "token_policy"),
    ({"policy": "streaming", "token_policy": "snapkv"}, "token_policy"),
    ({"policy": "prulong", "token_policy": "h2o"}, "token_policy"),
    ({"policy": "prulong", "token_policy": "snapkv", "token_sparsity": 1.5}, "token_sparsity"),
    ({"policy": "prulong", "token_policy": "pyramidkv", "tiers": 2}, "tiers"),
])
def test_bad_hybrid_settings_are_refused(raw, field):
    with pytest.raises(KVPolicyError) as exc:
        KVPolicyConfig.from_dict(raw)
    assert exc.value.field == field
    assert any(valid in str(exc.value) for valid in ("snapkv, pyramidkv", "duo, prulong",
                                                      "[0, 1]", "valid: 1"))


def test_hybrid_refuses_what_it_is_not_tested_with():
    # (tensor and data parallel are served: tests/test_tensor_parallel.py, test_data_parallel.py)
    assert parallel_error(hybrid(), {"tensor_parallel_size": 2}, 4) is None
    assert "--kv-token-policy" in speculative_error(hybrid(), "ngram")
    assert speculative_error(hybrid(), None) is None


def test_streaming_plan_lays_questions_after_their_chunk():
    """Row 0 decodes, row 1 runs a 6-token chunk at 20 with a 3-token question; sink 2,
    window 4. The question's kernel row is [sink | window | chunk | question], its queries the
    last 3; the batch's own rows are those of the plan without questions."""
    with_q = build_step_plan([9, 20], [1, 6], 2, 4, block_size=4, questions=[(1, 3, 7)])
    plain = build_step_plan([9, 20], [1, 6], 2, 4, block_size=4)
    assert with_q.num_reqs == 3 and with_q.query_start_loc.tolist() == [0, 1, 7, 10]
    assert with_q.seq_lens.tolist() == plain.seq_lens.tolist() + [2 + 4 + 6 + 3]
    n = len(plain.prefix_pos)
    assert torch.equal(with_q.prefix_pos[:n], plain.prefix_pos)
    assert with_q.prefix_pos[n:].tolist() == [0, 1, 16, 17, 18, 19]  # sink, window before 20
    assert set(with_q.prefix_row[n:].tolist()) == {1}
    laid = with_q.chunk_src[-9:].tolist()
    assert laid == [1, 2, 3, 4, 5, 6, 7, 8, 9]  # the chunk's batch tokens, then the question


def test_hybrid_footprint_is_below_both_parts():
    full = torch.rand(4, 4, generator=torch.Generator().manual_seed(0)) > 0.5
    bounds = [1024, 2048, 3072, 4096]
    fp = {name: kv_footprint(build_policy(cfg, 4, 4, full_heads=full), 4096, bounds, 64)
          for name, cfg in (("hybrid", hybrid(sink=64, window=256)),
                            ("prulong", KVPolicyConfig(policy="prulong", sparsity=0.5,
                                                       sink=64, window=256)),
                            ("snapkv", KVPolicyConfig(policy="snapkv", sparsity=0.5)))}
    assert fp["hybrid"].footprint < min(fp["prulong"].footprint, fp["snapkv"].footprint)


# -- served ---------------------------------------------------------------------------------------

PROMPT_LENGTHS = (300, 340)
SERVED = [  # (id, policy, chunk, CI)
    ("snapkv-patched-h0.5-t0.5-c128", {"token_policy": "snapkv", "eviction": "patched"}, 128,
     False),  # (CI: the shipped mask's hybrid below and its soak: CI's budget)
    ("pyramidkv-naive-h0.5-t0.7-c96",
     {"token_policy": "pyramidkv", "eviction": "naive", "token_sparsity": 0.7}, 96, False),
    ("snapkv-naive-h0.3-t0.5-c128",
     {"token_policy": "snapkv", "eviction": "naive", "sparsity": 0.3}, 128, False),
    ("pyramidkv-patched-h0.7-t0.5-c160",
     {"token_policy": "pyramidkv", "eviction": "patched", "sparsity": 0.7}, 160, False),
    ("snapkv-patched-h0.7-t0.3-c64",
     {"token_policy": "snapkv", "eviction": "patched", "sparsity": 0.7, "token_sparsity": 0.3,
      "obs_window": 32}, 64, False),
    ("snapkv-patched-h0.5-t0.5-c128-fp8",
     {"token_policy": "snapkv", "eviction": "patched", "kv_cache_dtype": "fp8"}, 128, False),
]
CASES = [pytest.param(case[1:3], id=case[0], marks=[] if case[3] else [pytest.mark.slow])
         for case in SERVED]


@pytest.mark.server
@pytest.mark.parametrize("case", CASES)
def test_hybrid_serves_the_reference_tokens(case, tiny_qwen3, tokenizer, one_torch_thread):
    from transformers import AutoModelForCausalLM

    settings, chunk = case
    settings = dict(settings)
    kv_cache_dtype = settings.pop("kv_cache_dtype", "auto")
    skip_without_fp8_kv_cache(kv_cache_dtype)
    model_dir = tiny_qwen3(4)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    policy = {"policy": "prulong", "sparsity": 0.5, "token_sparsity": 0.5, "sink": 16,
              "window": 64, "obs_window": 16, **settings,
              "mask_path": str(random_mask(model_dir, model.config))}
    cfg = KVPolicyConfig.from_dict(policy)
    full_heads, _ = resolve_full_heads(cfg, str(model_dir), 4, 4)
    assert 0 < int(full_heads.sum()) < 16
    pol = build_policy(cfg, 4, 4, full_heads=full_heads)
    runner = ReferenceRunner(model, pol, kv_cache_dtype=kv_cache_dtype)
    server = start_server(model_dir, [*flags(policy, chunk), "--kv-cache-dtype", kv_cache_dtype])
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")
    width = pool_width(server)
    itemsize = 1 if kv_cache_dtype.startswith("fp8") else 4
    parts = [ReferenceRunner(model, p, kv_cache_dtype=kv_cache_dtype) for p in (
        build_policy(cfg.replace(token_policy=None, tiers=None), 4, 4, full_heads=full_heads), pol.token)]
    differs = [False, False]
    for prompt in source_prompts(tokenizer, PROMPT_LENGTHS):
        r = client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=NEW_TOKENS,
                                      temperature=0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
        stats = r.model_extra["kv_stats"]
        ends = stats["chunk_boundaries"]
        assert len(ends) >= 2
        ref = runner.generate(prompt, NEW_TOKENS, ends)
        assert r.choices[0].model_extra["token_ids"] == ref.token_ids, (settings, len(prompt))
        # full heads kept what the token policy keeps of each chunk, streaming heads the cut
        kept = ref.kept_per_head[0]
        for layer in range(4):
            want = pol.chunk_keep(layer, ends[0], False).kept
            assert bool((kept[layer][full_heads[layer]] == want).all())
        # every byte is a pool block (each costs the plan's widest group: width head pages x
        # K, V x 128 x 64); on these 300-token prompts the streaming groups' sink and window
        # blocks can outweigh what the full heads save (h0.3, h0.7: more than full attention)
        assert stats["kv_bytes_peak"] == (stats["blocks_held_peak"] * width * 2 * 128 * 64
                                          * itemsize)
        fp = kv_footprint(pol, len(prompt), ends, NEW_TOKENS - 1)
        assert stats["footprint"] == pytest.approx(fp.footprint, abs=1e-9)
        for i, part in enumerate(parts):  # neither part alone would have given these tokens
            alone = part.generate(prompt, NEW_TOKENS, ends)
            differs[i] |= alone.token_ids != ref.token_ids or not torch.allclose(
                alone.first_token_logprobs, ref.first_token_logprobs, atol=1e-4)
    assert all(differs), "the hybrid equals one of its parts here: the test checked nothing"


SHIPPED_HYBRID = {"policy": "prulong", "sparsity": 0.5, "token_policy": "snapkv",
                  "token_sparsity": 0.5, "eviction": "patched"}


@pytest.mark.server
@pytest.mark.parametrize("streaming", [pytest.param({"sink": 16, "window": 64}, marks=pytest.mark.slow),
                                       {}], ids=["sink16-window64", "defaults"])
def test_hybrid_on_the_bundled_model_with_its_shipped_mask(streaming, bundled_model_dir,
                                                          tokenizer, hf_model, one_torch_thread):
    """The real user's path: SmolLM2's shipped PruLong mask at head sparsity 0.5 (6 of its 30
    layers have no full head, 5 no streaming head) with patched SnapKV at 0.5 on the full
    heads; two prompts sent at once (mixed prefill / decode steps), each equal to the reference
    at the chunk boundaries it was served with. With a 16-token sink in vLLM's 128-token
    blocks, decode reads the streaming heads' window back; at the mask's defaults (sink 64,
    window 256) the plugin picks 64-token blocks for every group (the fast layout), and decode
    reads the streaming heads in place."""
    policy = {**SHIPPED_HYBRID, **streaming}
    cfg = KVPolicyConfig.from_dict(policy)
    full_heads, _ = resolve_full_heads(cfg, str(bundled_model_dir), 30, 3)
    counts = full_heads.sum(dim=1)
    assert (counts == 0).any() and (counts == 3).any()
    runner = ReferenceRunner(hf_model, build_policy(cfg, 30, 3, full_heads=full_heads))
    server = start_server(bundled_model_dir, flags(policy, 256))
    chosen = "streaming heads in 64-token blocks (the fast layout"
    assert (chosen in server.log_path.read_text(errors="replace")) == (not streaming)
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")
    prompts = source_prompts(tokenizer, (700, 1100))

    def ask(prompt):
        return client.completions.create(
            model=SERVED_NAME, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True})

    import concurrent.futures as cf
    with cf.ThreadPoolExecutor(2) as pool:
        responses = list(pool.map(ask, prompts))
    for prompt, r in zip(prompts, responses):
        ends = r.model_extra["kv_stats"]["chunk_boundaries"]
        ref = runner.generate(prompt, NEW_TOKENS, ends)
        assert r.choices[0].model_extra["token_ids"] == ref.token_ids, len(prompt)


@pytest.mark.server
def test_short_soak(bundled_model_dir, tokenizer, hf_model):
    """The hybrid's short soak (`mechanism_soak.py`) on the server above (the shipped mask at
    0.5, patched snapkv 0.5 on its full heads, the fast layout)."""
    server = start_server(bundled_model_dir, flags(SHIPPED_HYBRID, 256), reuse=True)
    short_soak(server, bundled_reference(hf_model, bundled_model_dir, SHIPPED_HYBRID),
               source_prompts(tokenizer, (300, 600)), xargs=[{"kv_teacher_forced": 4}])
