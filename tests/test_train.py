"""The mask trainer (`vllm_kvevict.train`) on a tiny random Llama: hard-concrete math, the
Lagrangian's ascent, the hybrid attention against the reference oracle, export/import, data
packing, and 3-step smoke runs of both objectives with checkpoint and resume; and the CLI
(`--device cpu`) for 3 steps on tiny random Qwen3 and Mistral models (tests/tiny_models.py)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from vllm_kvevict.config import KVPolicyConfig
from vllm_kvevict.masks import full_heads_at_sparsity, load_head_gates
from vllm_kvevict.policies import build_policy
from vllm_kvevict.reference import ReferenceRunner, attend, chunked_streaming_visibility
from vllm_kvevict.train import data as data_mod
from vllm_kvevict.train import evaluate as eval_mod
from vllm_kvevict.train import hard_concrete as hc
from vllm_kvevict.train.hybrid import StreamingMask, hybrid_attention
from vllm_kvevict.train.trainer import (TrainConfig, Trainer, ascend_, lagrangian, lr_factor,
                                        target_sparsity_at)

torch.set_num_threads(1)

VOCAB = 128
LAYERS, Q_HEADS, KV_HEADS, HEAD_DIM = 2, 4, 2, 16
SEQ, CHUNK, SINK, WINDOW = 256, 64, 4, 16
EOS = 1


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=Q_HEADS * HEAD_DIM, intermediate_size=96,
                         num_hidden_layers=LAYERS, num_attention_heads=Q_HEADS,
                         num_key_value_heads=KV_HEADS, max_position_embeddings=1024,
                         initializer_range=0.2, tie_word_embeddings=False)
    config._attn_implementation = "eager"
    return LlamaForCausalLM(config).eval()


def encode(text: str) -> list[int]:
    """A character-level stand-in tokenizer: ids 2..121."""
    return [2 + ord(c) % 120 for c in text]


def make_sources() -> list[data_mod.Source]:
    words = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron "
             "pi rho sigma tau upsilon phi chi psi omega").split()
    out = []
    for i in range(8):
        text = " ".join(words[(i * 7 + j * j) % len(words)] for j in range(400))
        out.append(data_mod.Source(f"doc:t{i}", "text", text_value=text))
        code = "\n".join(f"def f{i}_{j}(x):\n    return x * {j} + {i}" for j in range(80))
        out.append(data_mod.Source(f"stdlib:m{i}", "code", text_value=code))
    out.append(data_mod.Source("book:held", "text", text_value=" ".join(words) * 60))
    return out


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return tiny_llama()


def make_trainer(model, tmp_path, objective="prulong", steps=3, resume=False, **kw) -> Trainer:
    cfg = TrainConfig(objective=objective, model="tiny-llama", out=str(tmp_path / "mask.json"),
                      target_sparsity=0.5, seq_len=SEQ, steps=steps, chunk=CHUNK, sink=SINK,
                      window=WINDOW, ckpt_dir=str(tmp_path / f"ckpt-{objective}"),
                      ckpt_every=1, resume=resume, query_block=48, loss_block=100,
                      duo_passkeys=2, duo_passkey_words=2, **kw)
    return Trainer(cfg, model=model, encode=encode, eos_id=EOS, sources=make_sources(),
                   log=lambda _: None)


# -- hard concrete -------------------------------------------------------------------------------
@pytest.mark.parametrize("log_alpha", [-4.0, -1.5, 0.0, 0.7, 2.5, 5.0])
def test_expected_sparsity_matches_monte_carlo(log_alpha):
    g = torch.Generator().manual_seed(0)
    la = torch.full((200_000,), log_alpha)
    z = hc.sample_gates(la, g)
    mc_zero = float((z == 0).float().mean())
    closed = float(hc.expected_sparsity(la))
    assert abs(mc_zero - closed) < 0.004, (mc_zero, closed)
    # and the closed form itself: 1 - sigmoid(log_alpha - tau log(-l / r))
    assert closed == pytest.approx(
        1 - 1 / (1 + math.exp(-(log_alpha - (2 / 3) * math.log(0.1 / 1.1)))), abs=1e-6)


def test_gates_saturate_at_exactly_zero_and_one():
    u = torch.tensor([hc.EPS, 1e-3, 0.5, 1 - 1e-3, 1 - hc.EPS])
    assert torch.equal(hc.gates_from_noise(torch.full((5,), 30.0), u), torch.ones(5))
    assert torch.equal(hc.gates_from_noise(torch.full((5,), -30.0), u), torch.zeros(5))
    z = hc.sample_gates(torch.tensor([40.0, -40.0]).repeat(1000), torch.Generator().manual_seed(1))
    assert torch.equal(z.view(1000, 2), torch.tensor([[1.0, 0.0]]).expand(1000, 2))
    assert torch.equal(hc.deterministic_gates(torch.tensor([30.0, -30.0])), torch.tensor([1.0, 0.0]))
    assert hc.TEMPERATURE == pytest.approx(2 / 3) and (hc.LIMIT_L, hc.LIMIT_R) == (-0.1, 1.1)
    # u is truncated to (EPS, 1 - EPS): never exactly 0 or 1
    u = hc.uniform_noise((100_000,), torch.Generator().manual_seed(2))
    assert float(u.min()) >= hc.EPS and float(u.max()) <= 1 - hc.EPS
    # the gradient flows where 0 < z < 1 and vanishes where it is clamped
    la = torch.tensor([0.0, 30.0, -30.0], requires_grad=True)
    z, saturated = hc.sample_gates_with_saturation(la, torch.Generator().manual_seed(3))
    z.sum().backward()
    assert saturated.tolist()[1:] == [True, True] and la.grad[1:].eq(0).all()


def test_log_alpha_clamp_bounds_and_default_start():
    lo, hi = hc.log_alpha_bounds(2.5)
    assert float(hc.prob_nonzero(torch.tensor(hi))) == pytest.approx(1 / (1 + math.exp(-2.5)))
    assert float(hc.prob_nonzero(torch.tensor(lo))) == pytest.approx(1 / (1 + math.exp(2.5)))
    x = torch.tensor([-50.0, 0.0, 50.0])
    hc.clamp_log_alpha_(x, 2.5)
    assert x.tolist() == pytest.approx([lo, 0.0, hi])
    assert TrainConfig(model="m").init_log_alpha == pytest.approx(hi)
    assert TrainConfig(model="m", gate_logit_clamp=0).init_log_alpha == hc.FULL_MODEL_LOG_ALPHA


@pytest.mark.parametrize("start, target", [(5.0, 0.7), (-5.0, 0.2)])
def test_lagrangian_ascent_pushes_sparsity_toward_target(start, target):
    log_alpha = torch.nn.Parameter(torch.full((3, 2), start))
    lambdas = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([{"params": [log_alpha], "lr": 1.0},
                             {"params": [lambdas], "lr": 1.0}], betas=(0.9, 0.95),
                            weight_decay=0.0)
    below = float(hc.expected_sparsity(log_alpha.detach())) < target
    for _ in range(2):
        opt.zero_grad()
        lagrangian(hc.expected_sparsity(log_alpha), target, lambdas).backward()
        ascend_(lambdas)
        opt.step()
    # ascent: lambda1 moves with the sign of (s - t), lambda2 grows
    lam = lambdas.detach()
    assert (float(lam[0]) < 0) == below and float(lam[1]) > 0
    # and the penalty's gradient then moves log_alpha so that s moves toward t
    opt.zero_grad()
    lagrangian(hc.expected_sparsity(log_alpha), target, lambdas).backward()
    assert ((log_alpha.grad > 0).all() if below else (log_alpha.grad < 0).all())
    before = float(hc.expected_sparsity(log_alpha.detach()))
    torch.optim.SGD([log_alpha], lr=10.0).step()
    after = float(hc.expected_sparsity(log_alpha.detach()))
    assert (after > before) if below else (after < before)


def test_schedules():
    assert [round(lr_factor(i, 100), 4) for i in (0, 9, 10, 99)] == [0.1, 1.0, 0.989, 0.01]
    assert lr_factor(0, 1) == 1.0
    assert target_sparsity_at(0, 0.7, 800) == 0.0
    assert target_sparsity_at(400, 0.7, 800) == pytest.approx(0.35)
    assert target_sparsity_at(900, 0.7, 800) == 0.7
    # the trainer warms up from the gates' initial expected sparsity, never below it
    assert target_sparsity_at(0, 0.7, 10, start=0.1) == pytest.approx(0.1)
    assert target_sparsity_at(5, 0.7, 10, start=0.1) == pytest.approx(0.4)
    assert target_sparsity_at(10, 0.7, 10, start=0.1) == pytest.approx(0.7)


# -- hybrid attention = the reference's semantics ------------------------------------------------
def test_hybrid_attention_matches_reference_attend():
    torch.manual_seed(0)
    n = 150
    q, k, v = torch.randn(Q_HEADS, n, 8), torch.randn(KV_HEADS, n, 8), torch.randn(KV_HEADS, n, 8)
    mask = StreamingMask(n, 40, SINK, WINDOW, query_block=32)
    stream_vis = chunked_streaming_visibility(n, 40, SINK, WINDOW).expand(KV_HEADS, n, n)
    causal = torch.ones(n, n, dtype=torch.bool).tril().expand(KV_HEADS, n, n)
    full_ref, stream_ref = attend(q, k, v, causal, 0.3), attend(q, k, v, stream_vis, 0.3)
    z = torch.tensor([0.25, 1.0])
    out = hybrid_attention(q, k, v, 0.3, z, mask, saturated=torch.tensor([False, True]))
    want = torch.cat([0.25 * full_ref[:2] + 0.75 * stream_ref[:2], full_ref[2:]])
    torch.testing.assert_close(out, want, atol=1e-5, rtol=0)
    out0 = hybrid_attention(q, k, v, 0.3, torch.zeros(2), mask, torch.tensor([True, True]))
    torch.testing.assert_close(out0, stream_ref, atol=1e-5, rtol=0)


def test_binary_gates_give_the_reference_chunked_prefill(model, tmp_path):
    """With z in {0, 1} the trainer's hybrid model is the inference model: its logits equal
    the reference oracle's chunk-by-chunk prefill with the same head mask."""
    trainer = make_trainer(model, tmp_path)
    full_heads = torch.tensor([[True, False], [False, True]])
    z = full_heads.float()
    ids = torch.randint(2, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(4)).tolist()
    with torch.no_grad():
        hidden = trainer._hidden(ids, lambda layer, q, k, v, scale: hybrid_attention(
            q, k, v, scale, z[layer], trainer.streaming, torch.ones(KV_HEADS, dtype=torch.bool)))
        ours = trainer.runner.logits(hidden)
    policy = build_policy(KVPolicyConfig(policy="prulong", sink=SINK, window=WINDOW),
                          LAYERS, KV_HEADS, full_heads=full_heads)
    ref = ReferenceRunner(model, policy).prefill(ids, CHUNK, all_logits=True).logits
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=0)


# -- training smoke runs, checkpoints, resume, export ---------------------------------------------
@pytest.mark.parametrize("objective", ["prulong", "duo"])
def test_three_steps_checkpoint_and_resume(model, tmp_path, objective):
    trainer = make_trainer(model, tmp_path, objective, steps=3)
    results = trainer.train(progress=False)
    assert [r.step for r in results] == [1, 2, 3]
    if objective == "prulong":
        lo, hi = hc.log_alpha_bounds(trainer.cfg.gate_logit_clamp)
        la = trainer.log_alpha.detach()
        assert float(la.min()) >= lo - 1e-6 and float(la.max()) <= hi + 1e-6
    assert all(math.isfinite(r.loss) for r in results)
    ckpt = tmp_path / f"ckpt-{objective}" / "checkpoint.pt"
    assert ckpt.is_file()
    assert len((tmp_path / f"ckpt-{objective}" / "train_log.jsonl").read_text().splitlines()) == 3
    if objective == "prulong":
        assert results[-1].metrics["lambda2"] > 0  # ascent on lambda2 = (s - t)^2 >= 0
        # the target warms up from the initial expected sparsity (never asks for less)
        start = float(hc.expected_sparsity(torch.full((1,), trainer.cfg.init_log_alpha)))
        assert trainer.start_sparsity == pytest.approx(start)
        assert results[0].metrics["target_sparsity"] == pytest.approx(start)
        assert all(r.metrics["target_sparsity"] >= start - 1e-9 for r in results)
        assert not torch.equal(trainer.log_alpha.detach(),
                               torch.full((LAYERS, KV_HEADS), trainer.cfg.init_log_alpha))
    else:
        alpha = trainer.alpha.detach()
        assert 0.0 <= float(alpha.min()) and float(alpha.max()) <= 1.0
        assert float(alpha.min()) < 1.0  # the gates moved

    resumed = make_trainer(model, tmp_path, objective, steps=4, resume=True)
    assert resumed.step == 3
    more = resumed.train(progress=False)
    assert [r.step for r in more] == [4] and math.isfinite(more[0].loss)
    assert torch.load(ckpt, weights_only=False)["step"] == 4


def test_resume_equals_uninterrupted_run(model, tmp_path):
    straight = make_trainer(model, tmp_path / "a", steps=4)
    straight.train(progress=False)
    first = make_trainer(model, tmp_path / "b", steps=4)
    first.train(stop_at=2, progress=False)
    second = make_trainer(model, tmp_path / "b", steps=4, resume=True)
    assert second.step == 2
    second.train(progress=False)
    torch.testing.assert_close(second.log_alpha, straight.log_alpha, atol=0, rtol=0)
    torch.testing.assert_close(second.lambdas, straight.lambdas, atol=0, rtol=0)


def test_resume_refuses_other_settings(model, tmp_path):
    make_trainer(model, tmp_path, steps=1).train(progress=False)
    with pytest.raises(ValueError, match="seed"):
        make_trainer(model, tmp_path, steps=2, resume=True, seed=5)


def test_export_round_trip(model, tmp_path):
    trainer = make_trainer(model, tmp_path, steps=1)
    with torch.no_grad():
        trainer.log_alpha.copy_(torch.tensor([[3.0, -2.0], [0.5, -7.25]]))
    path = trainer.export()
    loaded = load_head_gates(path)
    torch.testing.assert_close(loaded.log_alphas, trainer.log_alpha.detach(), atol=0, rtol=0)
    torch.testing.assert_close(loaded.gates, torch.sigmoid(trainer.log_alpha.detach()),
                               atol=1e-7, rtol=0)
    assert loaded.meta["objective"] == "prulong" and loaded.meta["train_sparsity"] == 0.5
    assert (loaded.meta["sink"], loaded.meta["window"]) == (SINK, WINDOW)
    extra = loaded.meta["extra"]
    for key in ("steps", "seq_len", "chunk", "wall_time_s", "data", "seed"):
        assert key in extra
    assert extra["data"]["held_out_sources"]["text"]["names"] == ["book:held"]
    # top-k of the gates is the top-k of the log_alphas
    assert full_heads_at_sparsity(loaded, 0.5).tolist() == [[True, False], [True, False]]
    json.loads(path.read_text())  # plain JSON

    duo = make_trainer(model, tmp_path, "duo", steps=1)
    with torch.no_grad():
        duo.alpha.copy_(torch.tensor([[0.9, 0.1], [0.4, 1.0]]))
    loaded = load_head_gates(duo.export(tmp_path / "duo.json"))
    assert loaded.log_alphas is None and loaded.meta["objective"] == "duo"
    torch.testing.assert_close(loaded.gates, duo.alpha.detach(), atol=0, rtol=0)


# -- data ----------------------------------------------------------------------------------------
def test_packing_exact_lengths_and_disjoint_held_out_split():
    sources = make_sources()
    train, held = data_mod.split_sources(sources)
    assert {s.name for s in train}.isdisjoint({s.name for s in held})
    assert {s.name for s in train} | {s.name for s in held} == {s.name for s in sources}
    assert "book:held" in {s.name for s in held}
    seqs = data_mod.take(data_mod.mixed_stream(train, encode, EOS, 100, seed=0), 60)
    assert all(len(s.ids) == 100 for s in seqs)
    assert {s.kind for s in seqs} == {"text", "code"}
    used = {name for s in seqs for name in s.sources}
    assert used <= {s.name for s in train}
    again = data_mod.take(data_mod.mixed_stream(train, encode, EOS, 100, seed=0), 60)
    assert [s.ids for s in again] == [s.ids for s in seqs]  # deterministic
    other = data_mod.take(data_mod.mixed_stream(train, encode, EOS, 100, seed=1), 60)
    assert [s.ids for s in other] != [s.ids for s in seqs]
    held_seqs = eval_mod.held_out_sequences(encode, EOS, 100, 3, sources=sources)
    assert all(len(s.ids) == 100 and set(s.sources) <= {x.name for x in held}
               for s in held_seqs)
    # the same text, no token lost or invented: one pass of one source is its ids + EOS
    one = data_mod.Source("doc:x", "text", text_value="abcdefghij" * 10)
    packed = list(data_mod.pack_kind([one], encode, EOS, 25, seed=0, max_passes=1))
    assert [t for s in packed for t in s.ids] == (encode(one.text_value) + [EOS])[:100]


def test_split_of_the_machine_sources_is_by_source():
    sources = data_mod.discover_sources(max_source_chars=1000)
    train, held = data_mod.split_sources(sources)
    assert train and held
    assert {s.name for s in train}.isdisjoint({s.name for s in held})
    assert all(s.name in {h.name for h in held} for s in sources if s.name.startswith("book:"))
    assert all(data_mod.held_out(s.name) for s in held)


def test_passkey_sequence_is_exact_and_ends_with_the_answer():
    hay = encode("the quick brown fox jumps over the lazy dog " * 20)
    seq = data_mod.passkey_sequence(hay, encode, SEQ * 2, seed=0, index=3, num_passkeys=2,
                                    words=3)
    assert len(seq.ids) == SEQ * 2
    answer = "".join(f"The passkey number {i + 1} is: {k}.\n" for i, k in enumerate(seq.passkeys))
    assert list(seq.ids[-seq.answer_len:]) == encode(answer)
    for i, key in enumerate(seq.passkeys):
        needle = encode(f"\nThe passkey number {i + 1} is: {key}. Remember it.\n")
        body = list(seq.ids[:-seq.answer_len])
        assert any(body[j:j + len(needle)] == needle for j in range(len(body)))


# -- evaluation ----------------------------------------------------------------------------------
def test_evaluate_runs_the_reference_chunked_prefill(model, tmp_path):
    trainer = make_trainer(model, tmp_path, steps=1)
    path = trainer.export()
    seqs = [list(s.ids) for s in eval_mod.held_out_sequences(encode, EOS, 128, 2,
                                                             sources=make_sources())]
    methods = eval_mod.build_methods(LAYERS, KV_HEADS, 0.5, [str(path)], random_seed=0)
    results = eval_mod.evaluate(model, seqs, methods, CHUNK, SINK, WINDOW, progress=False)
    assert [r.full_heads for r in results] == [4, 2, 2, 0]
    assert all(math.isfinite(r.loss) and math.isfinite(r.late_loss) for r in results)
    # the full row is the plain model's loss
    with torch.no_grad():
        logits = model(torch.tensor(seqs)).logits.float()
    want = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB),
                                             torch.tensor(seqs)[:, 1:].reshape(-1))
    assert results[0].loss == pytest.approx(float(want), abs=1e-4)
    assert "full" in eval_mod.format_table(results, 0.5, CHUNK)


# -- the CLI on tiny random models of other families ----------------------------------------------
@pytest.fixture(scope="module")
def family_models(tmp_path_factory):
    from tiny_models import build_tiny_model

    root = tmp_path_factory.mktemp("families")
    return {family: build_tiny_model(family, root) for family in ("qwen3", "mistral")}


@pytest.mark.parametrize("family, objective", [("qwen3", "prulong"), ("mistral", "prulong"),
                                               ("qwen3", "duo")])
def test_cli_trains_other_families(family_models, tmp_path, family, objective):
    """`python -m vllm_kvevict.train` (in process) for 3 steps of a tiny random Qwen3 (q/k
    norm, explicit head_dim) and Mistral on the CPU: the mask file loads with the model's
    layers x KV heads and finite gates, and the log has the 3 steps."""
    from vllm_kvevict.masks import check_shape
    from vllm_kvevict.train.__main__ import main as train_main

    model_dir = family_models[family]
    out, ckpt = tmp_path / "mask.json", tmp_path / "ckpt"
    argv = ["--objective", objective, "--model", str(model_dir), "--out", str(out),
            "--seq-len", "256", "--steps", "3", "--chunk", "128", "--sink", "16",
            "--window", "32", "--threads", "1", "--device", "cpu", "--target-sparsity", "0.5",
            "--ckpt-dir", str(ckpt), "--max-source-chars", "20000", "--no-progress"]
    if objective == "duo":
        argv += ["--duo-passkeys", "2", "--duo-passkey-words", "2"]
    assert train_main(argv) == 0
    gates = load_head_gates(out)
    check_shape(gates, 4, 2, str(out))  # tiny_models: 4 layers x 2 KV heads
    assert gates.gates.shape == (4, 2) and torch.isfinite(gates.gates).all()
    assert gates.meta["extra"]["device"] == "cpu"
    steps = [json.loads(line)["step"] for line in
             (ckpt / "train_log.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
