"""Head-mask files (ours, PruLong TSV, DuoAttention TSV) and sparsity selection."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from vllm_kvevict.config import KVPolicyConfig
from vllm_kvevict.masks import (HEAD_MASKS_DIR, HeadGates, MaskError, check_shape,
                                default_mask_path, duo_quantile_full_heads,
                                full_heads_at_sparsity, load_head_gates, model_key,
                                save_head_gates)
from vllm_kvevict.policies import build_policy

SHARED = Path(__file__).resolve().parents[2] / "shared"
DUO_TSV = SHARED / "data/duo_attention/Meta-Llama-3.1-8B-Instruct/full_attention_heads.tsv"
needs_duo = pytest.mark.skipif(not DUO_TSV.is_file(),
                               reason=f"DuoAttention pattern not found at {DUO_TSV}")


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_bytes(text.encode())  # bytes, so CRLF stays CRLF
    return path


def valid_doc(**changes) -> dict:
    doc = {"format": "vllm-kvevict-head-mask", "version": 1, "model": "tiny",
           "num_layers": 2, "num_kv_heads": 3, "objective": "heuristic", "sink": 4,
           "window": 8, "train_sparsity": None, "gates": [[0.1, 0.9, 0.5], [1.0, 0.0, 0.25]],
           "log_alphas": None}
    doc.update(changes)
    return doc


def write_json(tmp_path: Path, doc: dict) -> Path:
    return write(tmp_path, "mask.json", json.dumps(doc))


# -- the released DuoAttention pattern ------------------------------------------------------------

@needs_duo
def test_duo_file_loads_with_shape_and_clipping():
    gates = load_head_gates(DUO_TSV)
    assert gates.shape == (32, 8)
    assert gates.gates.dtype == torch.float32
    expected = np.clip(np.loadtxt(DUO_TSV, delimiter="\t"), 0, 1).astype(np.float32)
    assert np.array_equal(gates.gates.numpy(), expected)
    assert gates.meta["objective"] == "duo" and gates.meta["source_format"] == "duo-tsv"
    assert (gates.meta["sink"], gates.meta["window"]) == (128, 256)  # from its config.json
    assert gates.log_alphas is None


@needs_duo
@pytest.mark.parametrize("sparsity, full", [(0.5, 128), (0.7, 77)])
def test_duo_quantile_rule_on_released_pattern(sparsity, full):
    gates = load_head_gates(DUO_TSV)
    mask = duo_quantile_full_heads(gates, sparsity)
    assert mask.dtype == torch.bool and mask.shape == (32, 8)
    assert int(mask.sum()) == full
    values = np.clip(np.loadtxt(DUO_TSV, delimiter="\t"), 0, 1)
    assert np.array_equal(mask.numpy(), values >= np.quantile(values, sparsity))


@needs_duo
def test_quantile_and_top_k_differ_on_ties():
    gates = load_head_gates(DUO_TSV)
    assert int((gates.gates == 1.0).sum()) == 57
    # S = 0.8: the quantile lands on the tied 1.0 gates, all of which stay full ...
    assert int(duo_quantile_full_heads(gates, 0.8).sum()) == 57
    # ... while top-k streams round(0.8 * 256) = 205 heads and keeps exactly 51.
    top_k = full_heads_at_sparsity(gates, 0.8)
    assert int(top_k.sum()) == 51
    assert bool((gates.gates[top_k] == 1.0).all())


@needs_duo
@pytest.mark.parametrize("sparsity", [0.0, 0.1, 0.5, 0.7, 0.9, 1.0])
def test_top_k_on_released_pattern(sparsity):
    gates = load_head_gates(DUO_TSV)
    full = full_heads_at_sparsity(gates, sparsity)
    assert int((~full).sum()) == int(np.floor(sparsity * 256 + 0.5))
    if 0 < sparsity < 1:
        assert gates.gates[~full].max() <= gates.gates[full].min()


@needs_duo
def test_duo_quantile_extremes():
    gates = load_head_gates(DUO_TSV)
    assert bool(duo_quantile_full_heads(gates, 0.0).all())
    assert not bool(duo_quantile_full_heads(gates, 1.0).any())


# -- top-k rule -----------------------------------------------------------------------------------

def test_top_k_ties_stream_in_index_order_and_round_half_up():
    gates = HeadGates(torch.full((2, 3), 0.5))
    assert full_heads_at_sparsity(gates, 0.5).tolist() == [[False, False, False],
                                                             [True, True, True]]
    # 0.25 * 6 = 1.5 rounds up to 2 streaming heads
    assert full_heads_at_sparsity(gates, 0.25).tolist() == [[False, False, True],
                                                              [True, True, True]]
    gates = HeadGates(torch.tensor([[0.9, 0.2, 0.2], [0.1, 0.2, 1.0]]))
    # lowest first (0.1 at flat 3), then the 0.2s by index: 1, 2, then 4
    assert full_heads_at_sparsity(gates, 3 / 6).tolist() == [[True, False, False],
                                                              [False, True, True]]


def test_top_k_mask_builds_a_policy():
    gates = HeadGates(torch.rand(30, 3, generator=torch.Generator().manual_seed(1)))
    full = full_heads_at_sparsity(gates, 0.7)
    pol = build_policy(KVPolicyConfig(policy="prulong", sparsity=0.7), 30, 3, full_heads=full)
    assert int(pol.streaming_heads().sum()) == 63


@pytest.mark.parametrize("sparsity", [-0.1, 1.1, float("nan"), float("inf"), "0.5", True])
def test_sparsity_out_of_range(sparsity):
    gates = HeadGates(torch.zeros(2, 2))
    with pytest.raises(MaskError, match="sparsity"):
        full_heads_at_sparsity(gates, sparsity)
    with pytest.raises(MaskError, match="sparsity"):
        duo_quantile_full_heads(gates, sparsity)


# -- TSV files ------------------------------------------------------------------------------------

@pytest.mark.parametrize("text", [
    "1.0\t0.0\t1.0\r\n0.0\t0.0\t1.0\r\n",  # as PruLong's csv.writer writes it
    "1.0\t0.0\t1.0\r\n0.0\t0.0\t1.0",      # no trailing newline
    "1\t0\t1\n0\t0\t1\n",                  # LF, integers
])
def test_prulong_tsv(tmp_path, text):
    gates = load_head_gates(write(tmp_path, "masks_sp0.7.tsv", text))
    assert gates.gates.tolist() == [[1.0, 0.0, 1.0], [0.0, 0.0, 1.0]]
    assert gates.meta["objective"] == "prulong"
    assert gates.meta["source_format"] == "prulong-tsv"


def test_duo_tsv_clips_within_tolerance(tmp_path):
    text = "%.18e\t%.18e\n%.18e\t%.18e\n" % (-0.0005, 0.5, 1.0008, 0.25)
    gates = load_head_gates(write(tmp_path, "full_attention_heads.tsv", text))
    assert gates.gates.tolist() == [[0.0, 0.5], [1.0, 0.25]]
    assert gates.meta["source_format"] == "duo-tsv"
    assert gates.meta["sink"] is None  # no config.json beside it


@pytest.mark.parametrize("text, message", [
    ("", "empty"),
    ("  \n\n", "empty"),
    ("1\t0\t1\n0\t1\n", "row 2 has 2 values, row 1 has 3"),
    ("0.5\tabc\n0.5\t0.5\n", "'abc' is not a number"),
    ("0.5\t\n0.5\t0.5\n", "column 2"),
    ("0.5\tnan\n0.5\t0.5\n", "nan"),
    ("0.5\t0.5\n-inf\t0.5\n", "inf"),
    ("0.5\t1.5\n0.5\t0.5\n", "outside \\[0, 1\\]"),
    ("0.5\t0.5\n-0.01\t0.5\n", "outside \\[0, 1\\]"),
])
def test_tsv_errors(tmp_path, text, message):
    path = write(tmp_path, "bad.tsv", text)
    with pytest.raises(MaskError, match=message) as info:
        load_head_gates(path)
    assert str(path) in str(info.value)


def test_missing_file(tmp_path):
    path = tmp_path / "nope.tsv"
    with pytest.raises(MaskError, match="not found") as info:
        load_head_gates(path)
    assert str(path) in str(info.value)
    assert issubclass(MaskError, ValueError)


# -- our JSON format ------------------------------------------------------------------------------

def test_json_round_trip_is_exact(tmp_path):
    gen = torch.Generator().manual_seed(0)
    original = HeadGates(
        gates=torch.rand(30, 3, generator=gen),
        log_alphas=torch.randn(30, 3, generator=gen) * 5,
        meta={"model": "SmolLM2-135M-Instruct", "objective": "prulong", "sink": 64,
              "window": 256, "train_sparsity": 0.7, "notes": "test run",
              "extra": {"steps": 10, "seed": 0}})
    path = tmp_path / "prulong.json"
    save_head_gates(path, original)
    loaded = load_head_gates(path)
    assert torch.equal(loaded.gates, original.gates)
    assert torch.equal(loaded.log_alphas, original.log_alphas)
    for key, value in original.meta.items():
        assert loaded.meta[key] == value
    assert loaded.meta["source_format"] == "json"
    doc = json.loads(path.read_text())
    assert doc["format"] == "vllm-kvevict-head-mask" and doc["version"] == 1
    assert (doc["num_layers"], doc["num_kv_heads"]) == (30, 3)


@needs_duo
def test_duo_pattern_survives_conversion(tmp_path):
    duo = load_head_gates(DUO_TSV)
    save_head_gates(tmp_path / "duo.json", duo)
    again = load_head_gates(tmp_path / "duo.json")
    assert torch.equal(again.gates, duo.gates) and again.log_alphas is None
    assert (again.meta["objective"], again.meta["sink"], again.meta["window"]) == ("duo", 128,
                                                                                   256)


def test_json_minimal_document_loads(tmp_path):
    gates = load_head_gates(write_json(tmp_path, valid_doc()))
    assert gates.shape == (2, 3)
    assert gates.meta["notes"] == "" and gates.meta["extra"] == {}


@pytest.mark.parametrize("changes, message", [
    ({"gates": [[0.1, 0.9, 0.5]]}, "2 x 3 list .* got 1 rows"),
    ({"gates": [[0.1, 0.9, 0.5], [1.0, 0.0]]}, "row 2 has 2 values"),
    ({"num_layers": 3}, "3 x 3 list"),
    ({"num_kv_heads": 0}, "num_kv_heads must be a positive integer"),
    ({"format": "something-else"}, "expected 'vllm-kvevict-head-mask'"),
    ({"version": 2}, "version 2 is not supported"),
    ({"gates": [[0.1, "x", 0.5], [1.0, 0.0, 0.2]]}, "'x' is not a finite number"),
    ({"gates": [[0.1, True, 0.5], [1.0, 0.0, 0.2]]}, "True is not a finite number"),
    ({"gates": [[0.1, 2.0, 0.5], [1.0, 0.0, 0.2]]}, "outside \\[0, 1\\]"),
    ({"log_alphas": [[1.0, 2.0]]}, "log_alphas must be a 2 x 3"),
    ({"train_sparsity": 1.5}, "train_sparsity"),
    ({"sink": -1}, "sink must be"),
    ({"log_alpha": None}, "unknown key"),
])
def test_json_errors(tmp_path, changes, message):
    path = write_json(tmp_path, valid_doc(**changes))
    with pytest.raises(MaskError, match=message) as info:
        load_head_gates(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("key", ["gates", "num_layers", "objective", "log_alphas"])
def test_json_missing_key(tmp_path, key):
    doc = valid_doc()
    del doc[key]
    with pytest.raises(MaskError, match=f"missing key.*'{key}'"):
        load_head_gates(write_json(tmp_path, doc))


def test_json_not_parseable(tmp_path):
    with pytest.raises(MaskError, match="not valid JSON"):
        load_head_gates(write(tmp_path, "mask.json", '{"format": '))


# -- shapes and shipped masks ---------------------------------------------------------------------

def test_check_shape_names_both_shapes():
    gates = HeadGates(torch.zeros(32, 8))
    check_shape(gates, 32, 8, "duo.tsv")
    with pytest.raises(MaskError, match="32 layers x 8 KV heads.*30 layers x 3 KV heads"):
        check_shape(gates, 30, 3, "duo.tsv")


def test_head_gates_validates():
    assert HeadGates(torch.zeros(4, 2)).shape == (4, 2)
    with pytest.raises(MaskError):
        HeadGates(torch.zeros(8))
    with pytest.raises(MaskError):
        HeadGates(torch.full((2, 2), 1.5))
    with pytest.raises(MaskError):
        HeadGates(torch.zeros(2, 2), log_alphas=torch.zeros(2, 3))


def test_model_key():
    for name in ("SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct",
                 "/models/SmolLM2-135M-Instruct/", "SmolLM2-135M-Instruct.Q4_1.gguf"):
        assert model_key(name) == "SmolLM2-135M-Instruct"
    assert model_key("Llama-3.1-8B.gguf") == "Llama-3.1-8B"


def test_default_mask_path(tmp_path):
    root = tmp_path / "head_masks"
    shipped = root / "SmolLM2-135M-Instruct" / "prulong.json"
    shipped.parent.mkdir(parents=True)
    shipped.write_text("{}")
    assert default_mask_path("HuggingFaceTB/SmolLM2-135M-Instruct", "prulong", root=root) == shipped
    assert default_mask_path("SmolLM2-135M-Instruct", "duo", root=root) is None
    assert default_mask_path("OtherModel", "prulong", root=root) is None
    # a model directory under another name, whose config names the original model
    model_dir = tmp_path / "served-model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(
        json.dumps({"_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct"}))
    assert default_mask_path(str(model_dir), "prulong", root=root) == shipped
    with pytest.raises(MaskError):
        default_mask_path("SmolLM2-135M-Instruct", "../prulong", root=root)


def test_default_mask_path_prefers_the_mask_trained_nearest_the_sparsity(tmp_path):
    folder = tmp_path / "SmolLM2-135M-Instruct"
    folder.mkdir()
    for name in ("prulong.json", "prulong-s0.5.json", "prulong-s0.7.json", "prulong-sx.json",
                 "prulong-s0.9.json.bak", "duo-s0.5.json"):
        (folder / name).write_text("{}")
    pick = lambda s: default_mask_path("SmolLM2-135M-Instruct", "prulong", s, tmp_path).name
    assert pick(0.3) == pick(0.5) == pick(0.55) == "prulong-s0.5.json"
    assert pick(0.6) == "prulong-s0.7.json"  # a tie goes to the higher target
    assert pick(0.9) == pick(None) == "prulong-s0.7.json"
    assert default_mask_path("SmolLM2-135M-Instruct", "duo", 0.9, tmp_path).name == \
        "duo-s0.5.json"
    (folder / "prulong-s0.5.json").unlink()
    (folder / "prulong-s0.7.json").unlink()
    assert pick(0.5) == "prulong.json"  # the untargeted file when no trained one exists


def test_shipped_masks_live_in_repo_root():
    assert HEAD_MASKS_DIR == Path(__file__).resolve().parents[1] / "head_masks"
    assert default_mask_path("SmolLM2-135M-Instruct", "no-such-policy") is None


# -- masks for real models ----------------------------------------------------------------------

LLAMA31 = HEAD_MASKS_DIR / "Meta-Llama-3.1-8B-Instruct" / "duo.json"


def test_shipped_duo_pattern_for_llama31_is_the_released_one():
    """head_masks/Meta-Llama-3.1-8B-Instruct/duo.json holds DuoAttention's released gates
    (../shared/data/duo_attention, MIT: its LICENSE ships beside it) exactly."""
    from vllm_kvevict.masks import load_head_gates

    released = load_head_gates(SHARED / "data" / "duo_attention" /
                               "Meta-Llama-3.1-8B-Instruct" / "full_attention_heads.tsv")
    shipped = load_head_gates(LLAMA31)
    assert shipped.shape == (32, 8) and torch.equal(shipped.gates, released.gates)
    assert (shipped.meta["objective"], shipped.meta["sink"], shipped.meta["window"]) == \
        ("duo", 128, 256)
    assert "MIT License" in (LLAMA31.parent / "LICENSE").read_text()


@pytest.mark.parametrize("name", ["meta-llama/Llama-3.1-8B-Instruct",
                                  "meta-llama/Meta-Llama-3.1-8B-Instruct",
                                  "/models/Llama-3.1-8B-Instruct/"])
def test_real_model_names_find_the_shipped_pattern(name):
    from vllm_kvevict.masks import default_mask_path

    assert default_mask_path(name, "duo") == LLAMA31
    assert default_mask_path(name, "prulong") is None


def test_a_same_named_model_of_another_shape_is_refused():
    from vllm_kvevict.config import KVPolicyError
    from vllm_kvevict.masks import resolve_head_mask

    cfg = KVPolicyConfig(policy="duo", sparsity=0.5)
    full, path, meta = resolve_head_mask(cfg, "meta-llama/Llama-3.1-8B-Instruct", 32, 8)
    assert path == str(LLAMA31) and int(full.sum()) == 128 and meta["objective"] == "duo"
    with pytest.raises(KVPolicyError, match="32 layers x 8 KV heads, but the model has 16"):
        resolve_head_mask(cfg, "meta-llama/Llama-3.1-8B-Instruct", 16, 8)


def test_no_shipped_mask_says_how_to_train_one():
    from vllm_kvevict.config import KVPolicyError
    from vllm_kvevict.masks import resolve_head_mask

    with pytest.raises(KVPolicyError) as err:
        resolve_head_mask(KVPolicyConfig(policy="prulong", sparsity=0.5),
                          "Qwen/Qwen2.5-7B-Instruct", 28, 4)
    assert ("python -m vllm_kvevict.train --objective prulong --model "
            "Qwen/Qwen2.5-7B-Instruct --target-sparsity 0.5") in str(err.value)
