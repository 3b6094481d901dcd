"""The reference oracle on a tiny random Llama: full equals transformers, streaming and token
eviction follow the paper's semantics (`policies/streaming.py`), and the scoring equals a slow loop written from the paper."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from vllm_kvevict.config import KVPolicyConfig
from vllm_kvevict.policies import build_policy
from vllm_kvevict.policies.snapkv import SnapKVPolicy
from vllm_kvevict.reference import (ReferenceRunner, attend, average_pool,
                                    chunked_streaming_visibility, observation_scores, select_kept,
                                    visibility)

VOCAB = 128
LAYERS = 2
Q_HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16
GROUP = Q_HEADS // KV_HEADS


def tiny_llama(layers: int = LAYERS, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=Q_HEADS * HEAD_DIM, intermediate_size=128,
                         num_hidden_layers=layers, num_attention_heads=Q_HEADS,
                         num_key_value_heads=KV_HEADS, max_position_embeddings=512,
                         initializer_range=0.2, tie_word_embeddings=False)
    config._attn_implementation = "eager"
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return tiny_llama()


def prompt(n: int, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


def runner(model, layers: int = LAYERS, full_heads=None, **cfg) -> ReferenceRunner:
    config = KVPolicyConfig(**cfg)
    return ReferenceRunner(model, build_policy(config, layers, KV_HEADS, full_heads=full_heads))


@torch.no_grad()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].float()


@torch.no_grad()
def hf_greedy(model, ids: list[int], steps: int) -> list[int]:
    seq = list(ids)
    for _ in range(steps):
        seq.append(int(hf_logits(model, seq)[-1].argmax()))
    return seq[len(ids):]


# -- full ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("chunk", [48, 7])
def test_full_equals_transformers_forward(model, chunk):
    ids = prompt(48)
    out = runner(model, policy="full").prefill(ids, chunk, all_logits=True)
    torch.testing.assert_close(out.logits, hf_logits(model, ids), atol=1e-4, rtol=0)


def test_full_greedy_equals_transformers_loop(model):
    ids = prompt(30)
    out = runner(model, policy="full").generate(ids, max_new_tokens=8, chunk_size=9)
    assert out.token_ids == hf_greedy(model, ids, 8)
    assert out.chunk_boundaries == [(0, 9), (9, 18), (18, 27), (27, 30)]
    torch.testing.assert_close(out.first_token_logprobs,
                               torch.log_softmax(hf_logits(model, ids)[-1], -1), atol=1e-4, rtol=0)
    assert out.cache.lengths().eq(30 + 7).all()  # the last generated token is never run


def test_dtype_argument_converts_a_copy(model):
    ids = prompt(30)
    bf16 = runner(model, policy="full")
    bf16 = ReferenceRunner(model, bf16.policy, dtype=torch.bfloat16)
    out = bf16.generate(ids, 3, 8)
    assert next(model.parameters()).dtype == torch.float32  # the caller's model is untouched
    assert out.cache.layers[0].keys.dtype == torch.bfloat16
    assert out.first_token_logprobs.dtype == torch.float32
    reference = torch.log_softmax(hf_logits(model, ids)[-1], -1)
    assert (out.first_token_logprobs - reference).abs().max() < 0.5


# -- streaming heads -----------------------------------------------------------------------------
def test_visibility_rules():
    streaming = torch.tensor([False, True])
    chunk = torch.arange(12, 16)  # chunk [12, 16) after positions 0..11
    key_pos = torch.arange(16).expand(2, -1)
    seen = visibility(chunk, key_pos, 12, streaming, sink=2, window=3)
    assert seen[0, 1].nonzero().flatten().tolist() == list(range(14))  # full: causal
    # streaming: the sink, the last 3 before the chunk, the chunk causally
    assert seen[1, 1].nonzero().flatten().tolist() == [0, 1, 9, 10, 11, 12, 13]
    assert seen[1, 3].nonzero().flatten().tolist() == [0, 1, 9, 10, 11, 12, 13, 14, 15]
    # decode at t = 20: the sink, the last 3 before t, itself
    seen = visibility(torch.tensor([20]), torch.arange(21).view(1, -1), 20,
                      torch.tensor([True]), sink=2, window=3)
    assert seen[0, 0].nonzero().flatten().tolist() == [0, 1, 17, 18, 19, 20]
    # the one-pass form: query 9 is in chunk [8, 10)
    one_pass = chunked_streaming_visibility(10, 4, sink=1, window=2)
    assert one_pass[9].nonzero().flatten().tolist() == [0, 6, 7, 8, 9]
    assert one_pass[5].nonzero().flatten().tolist() == [0, 2, 3, 4, 5]


def test_attend_equals_sdpa_and_is_differentiable():
    torch.manual_seed(2)
    q = torch.randn(Q_HEADS, 7, 8, requires_grad=True)
    k = torch.randn(KV_HEADS, 11, 8, requires_grad=True)
    v = torch.randn(KV_HEADS, 11, 8)
    seen = torch.rand(KV_HEADS, 7, 11) > 0.5
    seen[:, :, 0] = True
    out = attend(q, k, v, seen, scale=0.3, query_block=3)
    expected = F.scaled_dot_product_attention(
        q, k.repeat_interleave(GROUP, 0), v.repeat_interleave(GROUP, 0),
        attn_mask=seen.repeat_interleave(GROUP, 0), scale=0.3)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
    grad_q, grad_k = torch.autograd.grad(out.square().sum(), (q, k))
    ref_q, ref_k = torch.autograd.grad(expected.square().sum(), (q, k))
    torch.testing.assert_close(grad_q, ref_q, atol=1e-5, rtol=0)
    torch.testing.assert_close(grad_k, ref_k, atol=1e-5, rtol=0)


def test_streaming_one_chunk_is_causal_small_chunks_are_not(model):
    ids = prompt(40)
    stream = runner(model, policy="streaming", sink=2, window=4)
    one_chunk = stream.prefill(ids, 40, all_logits=True)
    torch.testing.assert_close(one_chunk.logits, hf_logits(model, ids), atol=1e-4, rtol=0)
    chunked = stream.prefill(ids, 8, all_logits=True)
    assert (chunked.logits - hf_logits(model, ids)).abs().max() > 1e-2
    # The first chunk has no past, so it is causal either way.
    torch.testing.assert_close(chunked.logits[:8], one_chunk.logits[:8], atol=1e-5, rtol=0)
    # After every chunk each head holds the sink + the last `window` positions.
    assert chunked.cache.kept_positions(1, 0) == [0, 1, 36, 37, 38, 39]
    assert chunked.kept_per_head[2].eq(4).all()


def test_streaming_heads_ignore_evicted_positions(model):
    # All heads stream, sink 4, window 8, chunks of 8, 2 layers. A token in chunk [a, a + 8)
    # reaches the layer-0 outputs of positions < a + 16 and the final states of positions
    # < a + 24; so tokens 4..15 cannot reach chunk [32, 40) or later decode steps.
    ids = prompt(40)
    stream = runner(model, policy="streaming", sink=4, window=8)
    base = stream.generate(ids, max_new_tokens=5, chunk_size=8)

    far = list(ids)
    for p in range(4, 16):
        far[p] = (far[p] + 1 + p) % VOCAB
    changed = stream.generate(far, max_new_tokens=5, chunk_size=8)
    assert torch.equal(changed.first_token_logprobs, base.first_token_logprobs)
    assert changed.token_ids == base.token_ids

    near = list(ids)
    near[30] = (near[30] + 1) % VOCAB  # inside the window of the last chunk
    assert not torch.allclose(stream.generate(near, 5, 8).first_token_logprobs,
                              base.first_token_logprobs, atol=1e-4)
    wider = runner(model, policy="streaming", sink=4, window=12)
    assert not torch.allclose(wider.generate(ids, 5, 8).first_token_logprobs,
                              base.first_token_logprobs, atol=1e-4)
    assert base.cache.lengths().eq(4 + 8).all()


def test_head_mask_chunked_equals_one_pass_masks(model):
    full_heads = torch.tensor([[True, False], [False, True]])
    duo = runner(model, full_heads=full_heads, policy="duo", sparsity=0.5, sink=3, window=5)
    ids = prompt(45)
    out = duo.prefill(ids, 10, all_logits=True)
    torch.testing.assert_close(out.logits, duo.one_pass_logits(ids, 10), atol=1e-5, rtol=0)
    assert (out.logits - hf_logits(model, ids)).abs().max() > 1e-2
    assert out.cache.lengths().tolist() == [[45, 8], [8, 45]]
    # Decode: a full head grows by one per step, a streaming head stays at sink + window.
    gen = duo.generate(ids, 4, 10)
    assert gen.cache.lengths().tolist() == [[48, 8], [8, 48]]


# -- token eviction ------------------------------------------------------------------------------
# PyramidKV is left out: its schedule caps the top layer's budget at the candidates, so even at
# sparsity 0 deeper layers keep less (see test_kept_counts_follow_chunk_keep).
@pytest.mark.parametrize("eviction", ["naive", "patched"])
def test_sparsity_zero_keeps_everything(model, eviction):
    ids = prompt(50)
    ref = runner(model, policy="snapkv", eviction=eviction, sparsity=0.0, obs_window=6)
    out = ref.prefill(ids, 16, all_logits=True)
    torch.testing.assert_close(out.logits, hf_logits(model, ids), atol=1e-4, rtol=0)
    assert out.kept_per_layer == [[16 * KV_HEADS] * LAYERS] * 3 + [[2 * KV_HEADS] * LAYERS]
    assert ref.generate(ids, 6, 16).token_ids == hf_greedy(model, ids, 6)


@pytest.mark.parametrize("policy", ["snapkv", "pyramidkv"])
@pytest.mark.parametrize("eviction", ["naive", "patched"])
def test_kept_counts_follow_chunk_keep(policy, eviction):
    layers = 4
    model = tiny_llama(layers=layers)
    ref = runner(model, layers=layers, policy=policy, eviction=eviction, sparsity=0.5,
                 obs_window=4)
    ids = prompt(70)
    out = ref.generate(ids, max_new_tokens=3, chunk_size=24)
    assert out.chunk_boundaries == [(0, 24), (24, 48), (48, 70)]
    expected = torch.zeros(layers, KV_HEADS, dtype=torch.long)
    for (start, end), kept in zip(out.chunk_boundaries, out.kept_per_head):
        for layer in range(layers):
            keep = ref.policy.chunk_keep(layer, end - start, end == 70)
            assert kept[layer].tolist() == [keep.kept] * KV_HEADS
            expected[layer] += keep.kept
            # The chunk's trailing window is always kept.
            for head in range(KV_HEADS):
                kept_pos = set(out.cache.kept_positions(layer, head))
                assert set(range(end - keep.window, end)) <= kept_pos
    assert torch.equal(out.cache.lengths(), expected + 2)  # decode tokens are never evicted
    if policy == "pyramidkv":
        assert out.kept_per_head[0][0, 0] > out.kept_per_head[0][-1, 0]


def test_patched_and_naive_keep_different_tokens(model):
    ids = prompt(64)
    kept = {}
    for eviction in ("naive", "patched"):
        ref = runner(model, policy="snapkv", eviction=eviction, sparsity=0.6, obs_window=8)
        out = ref.prefill(ids, 16, all_logits=True)
        kept[eviction] = [out.cache.kept_positions(l, h)
                          for l in range(LAYERS) for h in range(KV_HEADS)]
        kept[eviction + "_logits"] = out.logits
    assert kept["naive"] != kept["patched"]
    # The appended question tokens come after the chunk: the chunk's own outputs are the same.
    torch.testing.assert_close(kept["naive_logits"][:16], kept["patched_logits"][:16],
                               atol=1e-5, rtol=0)


@torch.no_grad()
@pytest.mark.parametrize("eviction", ["naive", "patched"])
def test_first_chunk_selection_matches_transformers_attentions(model, eviction):
    """First chunk [0, c): with no past, the (patched) forward is a plain causal forward of the
    chunk (+ the question after it), so transformers' own attention probabilities, renormalised
    over the chunk's keys, give the scores to check the oracle's kept sets against."""
    ids, c, k, kernel = prompt(60), 20, 6, 5
    ref = runner(model, policy="snapkv", eviction=eviction, sparsity=0.5, obs_window=k)
    out = ref.prefill(ids, c)
    seq = ids[:c] + (ids[-k:] if eviction == "patched" else [])
    attentions = model(torch.tensor([seq]), output_attentions=True).attentions
    for layer in range(LAYERS):
        keep = ref.policy.chunk_keep(layer, c, False)
        probs = attentions[layer][0, :, -k:, :c].double()  # [Hq, k, c]
        probs = probs / probs.sum(-1, keepdim=True)
        per_head = probs.sum(1).view(KV_HEADS, GROUP, c).mean(1)[:, : c - keep.window]
        pooled = F.avg_pool1d(per_head.unsqueeze(1), kernel, 1, kernel // 2).squeeze(1)
        for head in range(KV_HEADS):
            best = sorted(range(c - keep.window), key=lambda j: -pooled[head, j].item())
            expected = sorted(best[: keep.selected]) + list(range(c - keep.window, c))
            got = [p for p in out.cache.kept_positions(layer, head) if p < c]
            assert got == expected


# -- scoring, the slow obvious way ---------------------------------------------------------------
def slow_scores(q, keys, obs_offset, window, kernel):
    """Loops over heads, queries and keys, straight from the paper's description."""
    num_q, num_obs, d = q.shape
    num_kv, c, _ = keys.shape
    group = num_q // num_kv
    received = [[0.0] * c for _ in range(num_q)]
    for h in range(num_q):
        for i in range(num_obs):
            visible = range(obs_offset + i + 1 if obs_offset + i < c else c)
            logit = {j: sum(q[h, i, t].item() * keys[h // group, j, t].item()
                            for t in range(d)) / math.sqrt(d) for j in visible}
            top = max(logit.values())
            total = sum(math.exp(x - top) for x in logit.values())
            for j in visible:
                received[h][j] += math.exp(logit[j] - top) / total
    m = c - window
    out = torch.zeros(num_kv, m, dtype=torch.float64)
    for g in range(num_kv):
        mean = [sum(received[g * group + r][j] for r in range(group)) / group for j in range(m)]
        for j in range(m):
            out[g, j] = sum(mean[t] for t in range(j - kernel // 2, j + kernel // 2 + 1)
                            if 0 <= t < m) / kernel
    return out


@pytest.mark.parametrize("obs_offset_kind", ["naive", "patched"])
def test_scores_equal_slow_loops(obs_offset_kind):
    torch.manual_seed(3)
    c, k, window, kernel = 13, 4, 4, 5
    q = torch.randn(Q_HEADS, k, 8)
    keys = torch.randn(KV_HEADS, c, 8)
    offset = c - k if obs_offset_kind == "naive" else c
    fast = observation_scores(q, keys, offset, c - window, kernel)
    torch.testing.assert_close(fast.double(), slow_scores(q, keys, offset, window, kernel),
                               atol=1e-6, rtol=0)
    # The policy module (the vLLM side's scorer) agrees with the oracle.
    policy = SnapKVPolicy(KVPolicyConfig(policy="snapkv", pool_kernel=kernel), 1, KV_HEADS)
    torch.testing.assert_close(policy.score(q, keys, offset, window), fast, atol=1e-6, rtol=0)
    assert torch.equal(policy.select(fast, 3, c, window), select_kept(fast, 3, c, window))


def test_average_pool_and_ties():
    x = torch.rand(3, 11)
    for kernel in (1, 3, 5, 7):
        torch.testing.assert_close(average_pool(x, kernel),
                                   F.avg_pool1d(x.unsqueeze(1), kernel, 1, kernel // 2).squeeze(1))
    scores = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0, 0.0]])
    assert select_kept(scores, 2, 8, 2).tolist() == [[1, 2, 6, 7]]  # ties go to the earlier token
    assert select_kept(scores, 0, 8, 2).tolist() == [[6, 7]]
