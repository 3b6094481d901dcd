"""The heuristic head mask (vllm_kvevict.heuristic_mask) on a tiny random Llama built here."""

from __future__ import annotations

import json

import pytest
import torch

from vllm_kvevict import heuristic_mask as hm
from vllm_kvevict import masks

SINK, WINDOW, TOKENS = 4, 16, 160


@pytest.fixture(scope="module")
def tiny():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(1)
    config = LlamaConfig(vocab_size=128, hidden_size=96, intermediate_size=128,
                         num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=256, initializer_range=0.3,
                         attn_implementation="eager")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(0, config.vocab_size, (TOKENS,), generator=torch.Generator().manual_seed(1))
    return model, ids


def eager_probs(model, ids):
    """[L, Hq, T, T] attention probabilities from transformers' own eager attention."""
    with torch.inference_mode():
        out = model(input_ids=ids.view(1, -1), output_attentions=True, use_cache=False)
    return torch.stack([a[0] for a in out.attentions]), out.logits


def test_shape_range_and_determinism(tiny):
    model, ids = tiny
    first = hm.long_range_mass(model, ids, SINK, WINDOW, query_block=48)
    second = hm.long_range_mass(model, ids, SINK, WINDOW, query_block=48)
    assert first.shape == (3, 2)
    assert torch.equal(first, second)
    assert ((first > 0) & (first < 1)).all()
    gates = hm.build_head_gates(first, "tiny", SINK, WINDOW).gates
    assert gates.shape == (3, 2) and gates.dtype == torch.float32
    assert ((gates >= 0) & (gates <= 1)).all()
    assert torch.equal(gates, hm.build_head_gates(second, "tiny", SINK, WINDOW).gates)
    # gates are exactly the ranks 0..N-1 over N-1
    assert torch.equal(gates.flatten().sort().values,
                       (torch.arange(6, dtype=torch.float64) / 5).float())
    assert model.config._attn_implementation == "eager"  # restored after the run


def test_forward_matches_eager(tiny):
    """The custom attention computes the same model output as transformers' eager attention."""
    from vllm_kvevict.heuristic_mask import _MassAccumulator
    from transformers import AttentionInterface

    model, ids = tiny
    _, eager_logits = eager_probs(model, ids)
    acc = _MassAccumulator(3, 2, SINK, WINDOW, query_block=48)
    AttentionInterface.register(hm.ATTN_IMPLEMENTATION, acc.attention)
    model.set_attn_implementation(hm.ATTN_IMPLEMENTATION)
    try:
        with torch.inference_mode():
            ours = model(input_ids=ids.view(1, -1), use_cache=False).logits
    finally:
        model.set_attn_implementation("eager")
    torch.testing.assert_close(ours, eager_logits, rtol=1e-4, atol=1e-4)


def test_matches_brute_force(tiny):
    model, ids = tiny
    mass = hm.long_range_mass(model, ids, SINK, WINDOW, query_block=48)
    probs, _ = eager_probs(model, ids)
    group = 3
    # One head by explicit loops: layer 1, KV head 1 = query heads 3, 4, 5.
    layer, head = 1, 1
    total, count = 0.0, 0
    for q in range(TOKENS):
        evicted = [k for k in range(q + 1) if not (k < SINK or q - WINDOW <= k <= q)]
        if not evicted:
            continue
        for qh in range(head * group, (head + 1) * group):
            total += sum(float(probs[layer, qh, q, k]) for k in evicted)
            count += 1
    assert count == (TOKENS - SINK - WINDOW - 1) * group
    assert mass[layer, head].item() == pytest.approx(total / count, rel=1e-5)
    # Every head, vectorised, for the ranking.
    keys = torch.arange(TOKENS).view(1, -1)
    queries = torch.arange(TOKENS).view(-1, 1)
    far = (keys >= SINK) & (keys < queries - WINDOW)
    rows = torch.arange(TOKENS) > SINK + WINDOW
    per_q_head = (probs.double() * far).sum(-1)[:, :, rows].mean(-1)  # [L, Hq]
    brute = per_q_head.view(3, 2, group).mean(-1)
    torch.testing.assert_close(mass, brute, rtol=1e-5, atol=0)
    flat = brute.flatten()
    gaps = flat.sort().values.diff()
    assert gaps.min() > 1e-4, "masses too close for a meaningful ranking check"
    gates = hm.rank_gates(mass)
    assert torch.equal(gates.flatten().argsort(), flat.argsort())
    # Top-k of the gates at any sparsity = the heads with the most long-range mass.
    head_gates = masks.HeadGates(gates=gates)
    for streaming in range(7):
        full = masks.full_heads_at_sparsity(head_gates, streaming / 6).flatten()
        expected = torch.zeros(6, dtype=torch.bool)
        expected[flat.argsort(descending=True)[: 6 - streaming]] = True
        assert torch.equal(full, expected)


def test_evicted_keys_semantics():
    # sink 2, window 3: query 8 keeps 0, 1 and 5..8, evicts 2, 3, 4.
    got = hm.evicted_keys(torch.tensor([5, 6, 8]), 9, sink=2, window=3)
    assert got[0].nonzero().flatten().tolist() == []
    assert got[1].nonzero().flatten().tolist() == [2]
    assert got[2].nonzero().flatten().tolist() == [2, 3, 4]


def test_uniform_mass():
    # sink 2, window 3, 9 tokens: queries 6, 7, 8 evict 1, 2, 3 of 7, 8, 9 causal keys.
    assert hm.uniform_mass(9, 2, 3) == pytest.approx((1 / 7 + 2 / 8 + 3 / 9) / 3)
    assert hm.uniform_mass(6, 2, 3) == 0.0


def test_rank_gates_ties_follow_index_order():
    mass = torch.tensor([[0.2, 0.1], [0.2, 0.3]], dtype=torch.float64)
    gates = hm.rank_gates(mass)
    assert torch.equal(gates, torch.tensor([[1 / 3, 0.0], [2 / 3, 1.0]], dtype=torch.float32))
    assert hm.rank_gates(torch.tensor([[0.5]])).tolist() == [[1.0]]


def test_too_few_tokens(tiny):
    model, ids = tiny
    with pytest.raises(hm.HeuristicMaskError, match="beyond"):
        hm.long_range_mass(model, ids[: SINK + WINDOW + 1], SINK, WINDOW)


class ByteTokenizer:
    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": list(text.encode("utf-8"))}


def test_corpus_is_exact_and_deterministic():
    tok = ByteTokenizer()
    a = hm.build_corpus(tok, 3001)
    b = hm.build_corpus(tok, 3001)
    assert len(a.token_ids) == 3001 and a.token_ids == b.token_ids and a.sha256 == b.sha256
    assert sum(s["tokens_used"] for s in a.sources if s["kind"] == "prose") == 1500
    assert sum(s["tokens_used"] for s in a.sources if s["kind"] == "code") == 1501
    assert a.sources[0]["name"].startswith("this.py")
    assert bytes(a.token_ids[:40]).decode().startswith("The Zen of Python")
    assert a.sources[-1]["name"] == "json/__init__.py"


def test_file_round_trip_and_lookup(tiny, tmp_path):
    model, ids = tiny
    mass = hm.long_range_mass(model, ids, SINK, WINDOW)
    corpus = hm.Corpus(ids.tolist(), [{"name": "random", "kind": "test", "tokens_used": TOKENS}])
    gates = hm.build_head_gates(mass, "tiny-llama", SINK, WINDOW, corpus)
    (tmp_path / "tiny-llama").mkdir()
    path = tmp_path / "tiny-llama" / hm.FILE_NAME
    masks.save_head_gates(path, gates)
    back = masks.load_head_gates(path)
    assert torch.equal(back.gates, gates.gates)
    assert back.meta["objective"] == "heuristic" and back.meta["train_sparsity"] is None
    assert (back.meta["sink"], back.meta["window"]) == (SINK, WINDOW)
    assert back.meta["notes"].startswith("NOT trained")
    assert back.meta["extra"]["long_range_mass"] == mass.tolist()
    assert json.loads(path.read_text())["log_alphas"] is None


def test_shipped_heuristic_mask_loads():
    path = masks.HEAD_MASKS_DIR / "SmolLM2-135M-Instruct" / hm.FILE_NAME
    gates = masks.load_head_gates(path)
    assert gates.shape == (30, 3) and gates.meta["objective"] == "heuristic"
    assert gates.meta["notes"].startswith("NOT trained")
    mass = torch.tensor(gates.meta["extra"]["long_range_mass"], dtype=torch.float64)
    assert torch.equal(gates.gates, hm.rank_gates(mass))
