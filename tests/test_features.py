"""Start-up refusals for vLLM features a policy is not served exactly with (features.py), per
policy column of the compatibility matrix, and `vllm serve` stopping with the line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from compat_matrix import COLUMNS
from test_policies_vllm import CASES
from vllm_kvevict.config import KVPolicyConfig
from vllm_kvevict.features import (connector_error, full_block_error, kv_cache_dtype_error,
                                   lora_error, model_error, parallel_error,
                                   prefix_caching_error, prompt_embeds_error)

POLICIES = {"full": {"policy": "full"}, **{p: CASES[p][0] for p in COLUMNS.values() if p != "full"}}
EVICTING = [p for p in POLICIES if p != "full"]


def config(name: str) -> KVPolicyConfig:
    return KVPolicyConfig.from_dict(POLICIES[name])


@pytest.mark.parametrize("name", EVICTING)
def test_connector_refused(name):
    cfg = config(name)
    assert connector_error(cfg, []) is None
    assert connector_error(cfg, ["ExampleConnector"]).startswith(
        f"--kv-transfer-config connector(s) ExampleConnector cannot be combined with "
        f"--kv-policy {cfg.policy}")
    assert connector_error(config("full"), ["ExampleConnector"]) is None


@pytest.mark.parametrize("name", EVICTING)
def test_kv_cache_dtypes(name):
    """vLLM's CPU fp8 formats are served with every policy, except beside a decoupled eviction
    chunk (its read-back knows the model dtype's layout only); other dtypes are refused."""
    cfg = config(name)
    for dtype in ("auto", None, "fp8", "fp8_e4m3", "fp8_e5m2"):
        assert kv_cache_dtype_error(cfg, dtype) is None
    assert kv_cache_dtype_error(cfg, "int4") == (
        f"--kv-cache-dtype int4 is not supported with --kv-policy {cfg.policy}; valid: auto, "
        "fp8, fp8_e4m3, fp8_e5m2 (--kv-policy full serves any cache dtype vLLM does)")
    if cfg.evicts_tokens:
        chunked = cfg.replace(eviction_chunk=256)
        assert kv_cache_dtype_error(chunked, "auto") is None
        assert kv_cache_dtype_error(chunked, "fp8_e5m2") == (
            "--kv-cache-dtype fp8_e5m2 is not supported with --kv-eviction-chunk; valid with "
            "--kv-eviction-chunk: auto")
    assert kv_cache_dtype_error(config("full"), "int4") is None


@pytest.mark.parametrize("name", list(POLICIES))
def test_parallel_layouts(name):
    """Tensor parallel is served when the ranks split the KV heads evenly; data parallel is
    served (one engine core per replica, behind any number of API servers); pipeline parallel is refused
    for every policy."""
    cfg = config(name)
    assert parallel_error(cfg, {"tensor_parallel_size": 1, "pipeline_parallel_size": 1}) is None
    assert parallel_error(cfg, {"pipeline_parallel_size": 2}, 4) == (
        f"--pipeline-parallel-size 2 is not supported with --kv-policy {cfg.policy} yet (not "
        "built; vLLM CPU 0.32's own pipeline parallel fails on its first request); valid: 1")
    assert parallel_error(cfg, {"data_parallel_size": 2}, 4) is None
    assert parallel_error(cfg, {"tensor_parallel_size": 2}, 4) is None
    assert parallel_error(cfg, {"tensor_parallel_size": 4}, 4) is None
    assert parallel_error(cfg, {"tensor_parallel_size": 2}, 3) == (
        "--tensor-parallel-size 2 does not divide the model's 3 KV heads (vLLM would replicate "
        f"them across ranks); valid with --kv-policy {cfg.policy}: 1, 3")
    # fewer KV heads than ranks: vLLM replicates them; a head mask masks each replica, token
    # eviction gathers a replicated head's score from its replicas; the hybrid is refused
    replicated = parallel_error(cfg, {"tensor_parallel_size": 2}, 1)
    assert (replicated is None) != cfg.is_hybrid
    hybrid = KVPolicyConfig(policy="prulong", token_policy="snapkv")
    assert parallel_error(hybrid, {"tensor_parallel_size": 2}, 1) == (
        "--tensor-parallel-size 2 does not divide the model's 1 KV heads (vLLM would replicate "
        "them across ranks; a head mask with --kv-token-policy is not built there: a rank whose "
        "replica is a streaming head would not take part in a full head's score exchange); "
        "valid with --kv-policy prulong: 1")
    assert parallel_error(hybrid, {"tensor_parallel_size": 2}, 4) is None


@pytest.mark.parametrize("name", list(POLICIES))
def test_prompt_embeds_refused(name):
    cfg = config(name)
    assert prompt_embeds_error(cfg, False) is None
    assert prompt_embeds_error(cfg, True) == (
        f"--enable-prompt-embeds is not supported with --kv-policy {cfg.policy}")


@pytest.mark.parametrize("name", list(POLICIES))
def test_explicit_prefix_caching(name):
    """vLLM's default (None) is switched off for evicting policies; asking for it is
    refused, never silently dropped; `full` and head masks in vLLM's pool serve it."""
    cfg = config(name)
    assert prefix_caching_error(cfg, None) is None
    assert prefix_caching_error(cfg, False) is None
    if name == "full" or cfg.caches_prefixes or cfg.caches_token_prefixes:
        assert prefix_caching_error(cfg, True) is None
    else:
        assert prefix_caching_error(cfg, True).startswith(
            f"--enable-prefix-caching is not supported with --kv-policy {cfg.policy} --kv-")


PATCHED = [p for p in EVICTING if config(p).patched]


@pytest.mark.parametrize("name", list(POLICIES))
def test_lora_refused_with_patched_eviction(name):
    cfg = config(name)
    assert lora_error(cfg, False) is None
    if name in PATCHED:
        assert lora_error(cfg, True) == (
            f"--enable-lora is not supported with --kv-policy {cfg.policy} --kv-eviction "
            "patched; valid with LoRA: --kv-eviction naive")
    else:
        assert lora_error(cfg, True) is None
    naive_hybrid = KVPolicyConfig(policy="prulong", token_policy="snapkv", eviction="naive")
    assert "--kv-token-policy" in lora_error(naive_hybrid, True)


@pytest.mark.served_release
@pytest.mark.parametrize("argv, line", [
    (["--kv-policy", "snapkv", "--kv-eviction-chunk", "256", "--kv-cache-dtype", "fp8"],
     "--kv-cache-dtype fp8 is not supported with --kv-eviction-chunk; valid with "
     "--kv-eviction-chunk: auto"),
    # (tensor parallel 2 is refused by vLLM itself here: the bundled model has 9 query heads)
    (["--kv-policy", "full", "--pipeline-parallel-size", "2"],
     "--pipeline-parallel-size 2 is not supported with --kv-policy full yet (not built; vLLM "
     "CPU 0.32's own pipeline parallel fails on its first request); valid: 1"),
    (["--kv-policy", "snapkv", "--kv-eviction", "patched", "--enable-lora"],
     "--enable-lora is not supported with --kv-policy snapkv --kv-eviction patched"),
    (["--kv-policy", "snapkv", "--enable-prefix-caching"],
     "--enable-prefix-caching is not supported with --kv-policy snapkv --kv-eviction patched "
     "yet"),
    # decode-time eviction: what it is not tested with yet
    (["--kv-policy", "snapkv", "--kv-decode-budget", "64", "--kv-cache-dtype", "fp8"],
     "--kv-cache-dtype fp8 is not supported with --kv-decode-budget; valid with "
     "--kv-decode-budget: auto"),
    (["--kv-policy", "snapkv", "--kv-decode-budget", "64", "--speculative-config",
      '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}'],
     "--speculative-config is not supported with --kv-decode-budget"),
], ids=["fp8", "pp", "lora", "prefix-caching", "decode-fp8", "decode-spec"])
def test_vllm_serve_refuses(bundled_model_dir, argv, line):
    vllm = Path(sys.executable).parent / "vllm"
    proc = subprocess.run([str(vllm), "serve", str(bundled_model_dir), "--dtype", "float32",
                           *argv], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"vllm-kvevict: error: {line}"), proc.stderr[-3000:]
    assert "Loading weights" not in proc.stderr + proc.stdout


@pytest.mark.parametrize("config, needle", [
    ("LlamaConfig", None),
    ("Qwen2Config", None),  # sliding_window is set but use_sliding_window False
    ("Qwen3Config", None),
    ("MistralConfig:sliding_window=None", None),
    ("MistralConfig:sliding_window=4096", "sliding window of 4096 tokens"),
    ("Qwen2Config:use_sliding_window=True", "sliding window"),
    ("Gemma2Config", "sliding window"),
    ("DeepseekV2Config", "MLA"),
    ("GPT2Config", "architecture is not one the policies are tested on"),
])
def test_model_error(config, needle):
    """Evicting policies serve plain causal GQA decoders only; full serves anything."""
    import transformers

    name, _, override = config.partition(":")
    kwargs = {}
    if override:
        key, value = override.split("=")
        kwargs[key] = None if value == "None" else (True if value == "True" else int(value))
    hf = getattr(transformers, name)(**kwargs)
    hf.architectures = [name.replace("Config", "ForCausalLM").replace("GPT2ForCausalLM",
                                                                       "GPT2LMHeadModel")]
    error = model_error(KVPolicyConfig(policy="prulong"), hf)
    assert model_error(KVPolicyConfig(policy="full"), hf) is None
    if needle is None:
        assert error is None, error
    else:
        assert needle in error and error.startswith(f"model {hf.architectures[0]} cannot be "
                                                    "served with --kv-policy prulong"), error
        assert "supported: LlamaForCausalLM" in error


@pytest.mark.served_release
def test_vllm_serve_refuses_a_sliding_window_model(bundled_model_dir, tmp_path):
    """A Mistral whose layers use a 4096-token window: refused before any weight loads (the
    directory has a config and a tokenizer only)."""
    import shutil

    from transformers import MistralConfig

    MistralConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                  vocab_size=49152, sliding_window=4096,
                  architectures=["MistralForCausalLM"]).save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (bundled_model_dir / name).exists():
            shutil.copy(bundled_model_dir / name, tmp_path / name)
    vllm = Path(sys.executable).parent / "vllm"
    proc = subprocess.run([str(vllm), "serve", str(tmp_path), "--dtype", "float32",
                           "--kv-policy", "prulong"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("vllm-kvevict: error: model MistralForCausalLM cannot be served "
                           "with --kv-policy prulong: its layers use a sliding window of 4096 "
                           "tokens"), proc.stderr[-3000:]


def test_v2_model_runner_refuses_what_is_untested_there():
    """Under vLLM's V2 model runner every policy is served, eager or compiled, tensor and data
    parallel, the model's KV-cache dtype, no speculation, no LoRA (tests/test_v2_runner.py);
    each other feature turned on is refused with the flag that turned it on. `full` is stock
    vLLM.
    (Served: tests/test_v2_runner.py::test_v2_runner_refuses_untested_features.)"""
    from types import SimpleNamespace as NS

    from vllm_kvevict.features import model_runner_error, v2_features_on

    plain = NS(parallel_config=NS(tensor_parallel_size=1, pipeline_parallel_size=1,
                                  data_parallel_size=1),
               compilation_config=NS(mode=0), cache_config=NS(cache_dtype="auto"),
               speculative_config=None, lora_config=None)
    assert v2_features_on(plain) == []
    busy = NS(parallel_config=NS(tensor_parallel_size=2, pipeline_parallel_size=2,
                                 data_parallel_size=2),
              compilation_config=NS(mode=3), cache_config=NS(cache_dtype="fp8"),
              speculative_config=NS(method="ngram"), lora_config=object())
    on = v2_features_on(busy)
    # (compiled mode, tensor and data parallel are served)
    assert on == ["--pipeline-parallel-size 2", "--kv-cache-dtype fp8", "--speculative-config",
                  "--enable-lora"]
    for name in EVICTING:
        assert model_runner_error(config(name), True, []) is None
        assert model_runner_error(config(name), False, on) is None
        error = model_runner_error(config(name), True, on[1:2])
        assert error.startswith("VLLM_USE_V2_MODEL_RUNNER=1 (vLLM's V2 model runner) with "
                                f"--kv-policy {config(name).policy} is not supported with "
                                "--kv-cache-dtype fp8 yet (untested); valid: "
                                "VLLM_USE_V2_MODEL_RUNNER=0"), error
    assert model_runner_error(config("full"), True, on) is None


def test_larger_full_blocks_refused_where_untested():
    """`--kv-full-block-size`: a multiple of a --block-size that is a multiple of 32 (one CPU
    kernel path for both groups), on one process with vLLM's V1 runner."""
    cfg = KVPolicyConfig.from_dict({"policy": "prulong", "full_block_size": 128})
    one = {"tensor_parallel_size": 1, "pipeline_parallel_size": 1}
    assert full_block_error(cfg, 64, one, False) is None
    assert full_block_error(cfg, 128, {"tensor_parallel_size": 2}, True) is None  # (= block)
    assert full_block_error(KVPolicyConfig.from_dict({"policy": "prulong"}), 64,
                            {"tensor_parallel_size": 2}, True) is None
    assert full_block_error(cfg, 48, one, False).startswith(
        "--kv-full-block-size 128 must be a multiple of --block-size 48")
    assert "--block-size a multiple of 32" in full_block_error(cfg, 16, one, False)
    assert full_block_error(cfg, 64, {"tensor_parallel_size": 2}, False) == (
        "--kv-full-block-size 128 is not tested with --tensor-parallel-size; serve without "
        "--kv-full-block-size (the full heads then use --block-size 64)")
    assert "--pipeline-parallel-size" in full_block_error(cfg, 64, {"pipeline_parallel_size": 2},
                                                          False)
    assert "vLLM's V2 model runner" in full_block_error(cfg, 64, one, True)
    assert full_block_error(cfg, 64, one, False, 0, "fp8_e5m2") is None  # (tests/test_fp8.py)
    assert full_block_error(cfg, 64, {"data_parallel_size": 2}, False) is None
    assert full_block_error(cfg, 64, one, False, 1024) is None
    assert full_block_error(cfg, 64, one, False, 320) == (
        "--kv-full-block-size 128 must divide the canonical prefill chunk (320: "
        "--kv-eviction-chunk, else --max-num-batched-tokens with prefix caching)")


def test_fast_layout_is_chosen_where_it_is_served(monkeypatch):
    """The README's serve command gets the fast layout (issue 71): a head mask on the CPU path
    with no --block-size / --kv-full-block-size has its streaming heads in the largest block
    its sink fills whole (64 for the bundled masks' 64-token sink), its full heads in 128; a
    token policy alone, the flex path, or a user's own block size leaves vLLM's default. A
    head mask with a token policy (the hybrid), several TP / PP ranks or the V2 runner get the
    streaming heads' blocks for the full heads too (features.full_block_error)."""
    from vllm.engine.arg_utils import EngineArgs

    from vllm_kvevict.features import fast_layout
    from vllm_kvevict.integration.entrypoints.validation import choose_fast_layout

    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    assert fast_layout(KVPolicyConfig.from_dict({"policy": "prulong", "sparsity": 0.7})) == \
        (64, 128)
    assert fast_layout(KVPolicyConfig.from_dict({"policy": "streaming"})) == (64, None)
    assert fast_layout(KVPolicyConfig.from_dict({"policy": "duo", "sink": 128})) is None
    assert fast_layout(KVPolicyConfig.from_dict({"policy": "duo", "sink": 96})) == (32, 128)
    assert fast_layout(KVPolicyConfig.from_dict({"policy": "duo", "sink": 100})) is None
    assert fast_layout(KVPolicyConfig.from_dict({"policy": "prulong", "token_policy": "snapkv"})
                       ) == (64, None)
    assert fast_layout(KVPolicyConfig.from_dict({"policy": "snapkv", "sparsity": 0.7})) is None

    def chosen(policy: dict, **engine) -> tuple:
        args = EngineArgs(model="m", additional_config={"kv_policy": dict(policy)}, **engine)
        return (choose_fast_layout(args), args.block_size,
                args.additional_config["kv_policy"].get("full_block_size"))

    prulong = {"policy": "prulong", "sparsity": 0.7}
    from vllm_kvevict.integration.plugins.versions import V1_RUNNER

    if not V1_RUNNER:  # (vLLM 0.34: the V2 runner only, full heads in the streaming block)
        assert chosen(prulong) == (True, 64, None)
        return
    assert chosen(prulong) == (True, 64, 128)
    # several ranks: every group in the streaming heads' block (tests/test_tensor_parallel.py;
    # pipeline parallel is refused later, features.parallel_error)
    assert chosen(prulong, tensor_parallel_size=2) == (True, 64, None)
    assert chosen(prulong, kv_cache_dtype="fp8") == (True, 64, 128)  # (tests/test_fp8.py)
    assert chosen({"policy": "streaming"}) == (True, 64, None)
    assert chosen({**prulong, "token_policy": "snapkv"}) == (True, 64, None)
    for policy, engine in (
            (prulong, {"block_size": 128}), (prulong, {"block_size": 64}),
            ({**prulong, "full_block_size": 64}, {}),
            ({**prulong, "token_policy": "snapkv", "sink": 16}, {}),
            ({**prulong, "attention_backend": "flex"}, {}),
            ({"policy": "snapkv", "sparsity": 0.7}, {}), ({"policy": "full"}, {})):
        fast, block, full = chosen(policy, **engine)
        assert not fast and block == engine.get("block_size"), (policy, engine)
        assert full == policy.get("full_block_size"), (policy, engine)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")  # (vLLM's envs read it when asked)
    assert chosen(prulong) == (True, 64, None)  # (tests/test_v2_runner.py)
