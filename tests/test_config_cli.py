"""Flag parsing and config plumbing: no model, no server (except the one `bogus` start-up)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_kvevict.config import POLICIES, KVPolicyConfig, KVPolicyError
from vllm_kvevict.integration.entrypoints import cli


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_kv_policy_args(parser)
    return parser.parse_args(argv)


def test_flags_fold_into_additional_config():
    args = parse(["--kv-policy", "snapkv", "--kv-sparsity", "0.5", "--kv-eviction", "naive",
                  "--kv-obs-window", "32", "--kv-admission", "vllm"])
    policy = cli.policy_from_args(args, {})
    assert policy["admission"] == "vllm"
    assert policy["policy"] == "snapkv"
    assert policy["sparsity"] == 0.5
    assert policy["eviction"] == "naive"
    assert policy["obs_window"] == 32
    assert policy["sink"] == KVPolicyConfig().sink  # untouched fields keep their defaults


def test_eviction_chunk_flag_and_eviction_points():
    args = parse(["--kv-policy", "pyramidkv", "--kv-eviction-chunk", "1024"])
    cfg = KVPolicyConfig.from_dict(cli.policy_from_args(args, {}))
    assert cfg.eviction_chunk == 1024
    # a step closes an eviction chunk at multiples of E and at the prompt's end only
    assert [e for e in (128, 1024, 1152, 2048, 2500) if cfg.is_eviction_point(e, 2500)] == [
        1024, 2048, 2500]
    assert not cfg.is_eviction_point(2501, 2500)  # decode
    every_step = KVPolicyConfig(policy="snapkv")
    assert every_step.is_eviction_point(128, 2500)
    assert not KVPolicyConfig(policy="prulong").is_eviction_point(128, 2500)


def test_question_rows_only_under_patched_eviction():
    """The patched question (the prompt's last k tokens, run after each non-final chunk) has
    one rule: scheduler, ledger, worker and backend all ask the config."""
    patched = KVPolicyConfig(policy="snapkv", obs_window=64)
    assert (patched.question_rows(1000), patched.question_rows(10)) == (64, 10)
    assert KVPolicyConfig(policy="prulong", token_policy="pyramidkv",
                          obs_window=32).question_rows(1000) == 32
    for cfg in (KVPolicyConfig(policy="snapkv", eviction="naive"),
                KVPolicyConfig(policy="prulong"), KVPolicyConfig()):
        assert cfg.question_rows(1000) == 0
    assert KVPolicyConfig(policy="snapkv", eviction="naive").observation_rows(10) == 10


def test_flags_override_additional_config_json_form():
    additional = {"kv_policy": {"policy": "streaming", "window": 128}, "other": 1}
    args = parse(["--kv-window", "512"])
    policy = cli.policy_from_args(args, additional)
    assert policy["policy"] == "streaming" and policy["window"] == 512


def test_no_policy_given_means_none():
    assert cli.policy_from_args(parse([]), {}) is None


@pytest.mark.parametrize("raw, fragment", [
    ({"policy": "bogus"}, "valid policies: " + ", ".join(POLICIES)),
    ({"policy": "prulong", "sparsity": 1.5}, "sparsity must be a number in [0, 1]"),
    ({"policy": "prulong", "sparsity": float("nan")}, "sparsity must be a number in [0, 1]"),
    ({"policy": "streaming", "window": 0}, "window must be an integer >= 1"),
    ({"policy": "snapkv", "eviction": "sometimes"}, "valid modes: patched, naive"),
    ({"policy": "snapkv", "pool_kernel": 4}, "pool_kernel must be odd"),
    ({"policy": "snapkv", "mask_path": "x.json"}, "mask_path only applies to duo, prulong"),
    ({"policy": "full", "windw": 3}, "unknown kv_policy key(s) ['windw']"),
    ({"policy": "prulong", "tiers": 2}, "tiers only applies to snapkv, pyramidkv"),
    ({"policy": "pyramidkv", "tiers": 0}, "tiers must be an integer >= 1"),
    ({"policy": "snapkv", "admission": "greedy"}, "valid modes: reserve, vllm"),
    ({"policy": "full", "eviction_chunk": 1024},
     "eviction_chunk only applies to snapkv, pyramidkv, streaming, duo, prulong, not 'full'"),
    ({"policy": "snapkv", "eviction_chunk": 0}, "eviction_chunk must be an integer >= 1"),
    ({"policy": "prulong", "full_block_size": 0}, "full_block_size must be an integer >= 1"),
    ({"policy": "snapkv", "full_block_size": 128},
     "full_block_size only applies to a head mask (duo, prulong) without a token_policy on "
     "attention_backend cpu, not 'snapkv'"),
    ({"policy": "prulong", "full_block_size": 128, "token_policy": "snapkv"},
     "not 'prulong' with token_policy snapkv"),
    ({"policy": "prulong", "full_block_size": 128, "attention_backend": "flex"},
     "not 'prulong' on flex"),
])
def test_invalid_config_names_the_problem(raw, fragment):
    with pytest.raises(KVPolicyError) as exc:
        KVPolicyConfig.from_dict(raw)
    assert fragment in str(exc.value)


def test_json_string_form():
    cfg = KVPolicyConfig.from_dict('{"policy": "pyramidkv", "sparsity": 0.7}')
    assert cfg.evicts_tokens and cfg.patched  # the paper's default
    assert KVPolicyConfig.from_dict('"streaming"').policy == "streaming"


def test_fold_into_engine_args_exits_with_one_line(capsys):
    class Args:  # what vLLM's EngineArgs looks like to us: an additional_config field
        additional_config: dict = {}

    with pytest.raises(SystemExit) as exc:
        cli.fold_into_engine_args(Args(), parse(["--kv-policy", "nope"]))
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--kv-policy 'nope' is unknown" in err[0]


@pytest.mark.parametrize("argv, message", [
    (["--kv-policy", "prulong", "--kv-sparsity", "1.5"],
     "--kv-sparsity must be a number in [0, 1], got 1.5"),
    (["--kv-policy", "streaming", "--kv-window", "0"], "--kv-window must be an integer >= 1, got 0"),
    (["--kv-policy", "snapkv", "--kv-eviction", "sometimes"],
     "--kv-eviction 'sometimes' is unknown; valid modes: patched, naive"),
    (["--kv-policy", "prulong", "--kv-tiers", "2"],
     "--kv-tiers only applies to snapkv, pyramidkv (or a token_policy), not 'prulong'"),
    (["--kv-policy", "streaming", "--kv-full-block-size", "128"],
     "--kv-full-block-size only applies to a head mask (duo, prulong) without a token_policy "
     "on attention_backend cpu, not 'streaming'"),
])
def test_flag_errors_name_the_flag(argv, message):
    with pytest.raises(KVPolicyError) as exc:
        cli.policy_from_args(parse(argv), {})
    assert str(exc.value) == message


def test_vllm_serve_rejects_bogus_policy_before_loading(bundled_model_dir):
    vllm = Path(sys.executable).parent / "vllm"
    proc = subprocess.run([str(vllm), "serve", str(bundled_model_dir), "--kv-policy", "bogus"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last == ("vllm-kvevict: error: --kv-policy 'bogus' is unknown; valid policies: "
                    + ", ".join(POLICIES))
    assert "Loading weights" not in proc.stderr + proc.stdout


def test_vllm_serve_help_documents_every_flag():
    vllm = Path(sys.executable).parent / "vllm"
    proc = subprocess.run([str(vllm), "serve", "--help=vllm-kvevict"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    for flag in cli.FLAGS:
        assert flag in proc.stdout


def test_tiers_default_and_divisibility():
    """pyramidkv: one KV-cache group per layer unless told; snapkv one; head masks never; a tier
    count that does not divide the layers is refused before any model loads."""
    from types import SimpleNamespace

    from vllm_kvevict.integration.entrypoints.validation import validate_against_model

    assert KVPolicyConfig(policy="pyramidkv").num_tiers(30) == 30
    assert KVPolicyConfig(policy="pyramidkv", tiers=6).num_tiers(30) == 6
    assert KVPolicyConfig(policy="snapkv").num_tiers(30) == 1
    assert KVPolicyConfig(policy="prulong").num_tiers(30) == 1

    def config(**policy):
        hf = SimpleNamespace(num_hidden_layers=30, num_key_value_heads=3, num_attention_heads=9,
                             architectures=["LlamaForCausalLM"],
                              hidden_size=576)
        return SimpleNamespace(additional_config={"kv_policy": policy},
                               model_config=SimpleNamespace(hf_config=hf, model="m"),
                               cache_config=SimpleNamespace(enable_prefix_caching=True))

    validate_against_model(config(policy="pyramidkv", tiers=5))
    with pytest.raises(KVPolicyError, match="--kv-tiers 4 does not divide the model's 30 layers"):
        validate_against_model(config(policy="pyramidkv", tiers=4))


def test_eviction_chunk_needs_a_step_budget_that_holds_the_observation_window():
    from types import SimpleNamespace

    from vllm_kvevict.integration.entrypoints.validation import validate_against_model

    def config(budget, **policy):
        hf = SimpleNamespace(num_hidden_layers=30, num_key_value_heads=3, num_attention_heads=9,
                             architectures=["LlamaForCausalLM"],
                              hidden_size=576)
        return SimpleNamespace(additional_config={"kv_policy": policy},
                               model_config=SimpleNamespace(hf_config=hf, model="m"),
                               cache_config=SimpleNamespace(enable_prefix_caching=True),
                               scheduler_config=SimpleNamespace(max_num_batched_tokens=budget))

    validate_against_model(config(64, policy="snapkv", eviction_chunk=1024))
    with pytest.raises(KVPolicyError, match=r"max-num-batched-tokens >= --kv-obs-window "
                                            r"\(64\), got 32"):
        validate_against_model(config(32, policy="snapkv", eviction_chunk=1024))


@pytest.mark.parametrize("argv, count", [
    (["--kv-policy", "prulong", "--data-parallel-size", "2"], None),  # vLLM's: the DP size
    (["--kv-policy", "prulong", "--data-parallel-size", "2", "--api-server-count", "1"], 1),
    (["--api-server-count", "3", "--kv-policy", "prulong"], 3),
])
def test_kv_policy_leaves_the_api_server_count_to_vllm(argv, count):
    """Several API servers serve a policy (`server/shared.py`): `--kv-policy` changes nothing
    in vLLM's count (None here: vLLM's serve command defaults it to --data-parallel-size)."""
    import importlib

    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from vllm_kvevict.integration.plugins.versions import vllm_release

    serve_args = importlib.import_module(  # (the serve parser's module moved in 0.33)
        "vllm.entrypoints.common.cli_args" if vllm_release() >= (0, 33)
        else "vllm.entrypoints.launchers.cli_args")
    parser = serve_args.make_arg_parser(FlexibleArgumentParser())
    cli.add_kv_policy_args(parser)
    assert parser.parse_args(argv).api_server_count == count


def test_launcher_makes_one_shared_log_directory_for_several_api_servers(monkeypatch):
    """`vllm serve`'s launcher (from_cli_args) makes the directory once, before it starts the
    API servers, which inherit it; one API server gets none."""
    from vllm_kvevict.integration.entrypoints import api_server

    # (monkeypatch restores both variables: later servers of this worker must not inherit them)
    monkeypatch.setenv(api_server.SHARED_DIR_ENV, "/nonexistent/stale")
    # an unrelated launcher's pid (neither this process nor its parent, which is pid 1 when
    # pytest was started detached): ignored
    other = str(next(p for p in (1, 2, 3) if p not in (os.getpid(), os.getppid())))
    monkeypatch.setenv(api_server.SHARED_BY_ENV, other)
    assert api_server.shared_dir() is None
    for count in (None, 1):
        api_server.share_between_api_servers(count)
        assert os.environ[api_server.SHARED_BY_ENV] == other
    api_server.share_between_api_servers(2)
    directory = os.environ[api_server.SHARED_DIR_ENV]
    assert os.path.isdir(directory) and os.environ[api_server.SHARED_BY_ENV] == str(os.getpid())
    api_server.share_between_api_servers(2)  # the launcher's second from_cli_args: the same
    assert os.environ[api_server.SHARED_DIR_ENV] == directory
    assert api_server.shared_dir() is None  # (this process is the launcher, not its child)
    os.rmdir(directory)
