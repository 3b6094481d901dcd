"""The self-check (`python -m vllm_kvevict.selfcheck`, issue 50): it serves every policy cell on
this vLLM and compares with the plain-PyTorch reference, records a pass only when all are exact,
refuses to record one when the comparison differs (a perturbed reference), and a recorded pass
is what unlocks a platform or vLLM release outside the supported list."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_kvevict._version import __version__
from vllm_kvevict.selfcheck import records

REPO = Path(__file__).resolve().parents[1]


def run_selfcheck(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, records.ENV_DIR: str(tmp_path / "passes")}
    env.pop(records.ENV_CHECKING, None)
    return subprocess.run([sys.executable, "-m", "vllm_kvevict.selfcheck", "--work-dir",
                           str(tmp_path / "work"), "--prompt-tokens", "600", "--new-tokens", "4",
                           *args], capture_output=True, text=True, timeout=1800, cwd=REPO,
                          env=env)


def table_rows(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines()
            if line.startswith("| ") and not line.startswith("| cell |")]


@pytest.mark.server
@pytest.mark.served_release
@pytest.mark.slow  # CI's budget (300 s on CI); CI runs the refusal below (two cells)
def test_selfcheck_passes_here_and_records_the_pass(tmp_path):
    proc = run_selfcheck(tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = table_rows(proc.stdout)
    assert len(rows) == 8 and all(row.endswith("| exact |") for row in rows), proc.stdout
    [(key, path)] = records.recorded_passes(tmp_path / "passes")
    import vllm

    assert key == records.PassKey(__version__, vllm.__version__.split("+")[0], "cpu",
                                  records.device_name("cpu"), "float32")
    saved = json.loads(path.read_text())
    assert saved["table"][2:] == rows and saved["attention_backend"] == "cpu"


@pytest.mark.server
@pytest.mark.served_release
def test_selfcheck_refuses_to_record_when_the_reference_differs(tmp_path):
    """Half the window for the head masks, +0.2 sparsity for token eviction: the served tokens
    (right) now differ from that reference, and nothing is recorded."""
    proc = run_selfcheck(tmp_path, "--perturb-reference", "--policies", "streaming",
                         "snapkv:naive")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = table_rows(proc.stdout)
    assert len(rows) == 2 and all(row.endswith("| DIFFERS |") for row in rows), proc.stdout
    assert "no pass recorded" in proc.stdout
    assert records.recorded_passes(tmp_path / "passes") == []


def test_selfcheck_records_are_keyed_by_plugin_vllm_platform_device_dtype(tmp_path):
    key = records.PassKey("0.1.0", "0.33.0", "cuda", "NVIDIA H100 80GB HBM3", "bfloat16")
    path = records.write_pass(key, {"table": []}, tmp_path)
    assert records.recorded_passes(tmp_path) == [(key, path)]
    assert records.passed_dtypes("0.1.0", "0.33.0", "cuda", "NVIDIA H100 80GB HBM3",
                                 tmp_path) == {"bfloat16": path}
    for other in (("0.1.1", "0.33.0", "cuda", "NVIDIA H100 80GB HBM3"),
                  ("0.1.0", "0.33.1", "cuda", "NVIDIA H100 80GB HBM3"),
                  ("0.1.0", "0.33.0", "rocm", "NVIDIA H100 80GB HBM3"),
                  ("0.1.0", "0.33.0", "cuda", "NVIDIA A100-SXM4-80GB")):
        assert records.passed_dtypes(*other, tmp_path) == {}
    (tmp_path / "pass-cuda-damaged.json").write_text("{not json")
    assert len(records.recorded_passes(tmp_path)) == 1  # a damaged file unlocks nothing


def test_an_unsupported_platform_is_unlocked_only_by_a_matching_pass(tmp_path, monkeypatch):
    """Simulated: vLLM 0.33 on CUDA (this machine has neither a GPU nor that release served)."""
    from vllm_kvevict.integration.plugins.support import activation

    monkeypatch.setenv(records.ENV_DIR, str(tmp_path))
    monkeypatch.delenv(records.ENV_CHECKING, raising=False)
    reason, unlocked = activation("0.33.0+cu130", "cuda")
    assert unlocked == {} and reason.startswith("vLLM 0.33.0+cu130 is not supported")
    assert "run `python -m vllm_kvevict.selfcheck` here" in reason
    device = records.device_name("cuda")
    records.write_pass(records.PassKey(__version__, "0.33.0", "cuda", "another GPU", "float32"),
                       {}, tmp_path)
    assert activation("0.33.0", "cuda")[1] == {}  # another device's pass
    path = records.write_pass(records.PassKey(__version__, "0.33.0", "cuda", device, "float32"),
                              {}, tmp_path)
    assert activation("0.33.0+cu130", "cuda") == (None, {"float32": str(path)})
    monkeypatch.setenv(records.ENV_CHECKING, "1")  # the self-check's own engines
    assert activation("0.33.0", "rocm") == (None, {"*": "this self-check run"})
    assert activation("0.32.0", "cpu") == (None, {})  # supported: nothing needed


def test_an_unlocked_platform_serves_only_the_dtypes_that_passed():
    from vllm_kvevict.integration.plugins.support import unlocked_dtype_error

    unlocked = {"float32": "/x/pass.json"}
    assert unlocked_dtype_error("float32", unlocked) is None
    error = unlocked_dtype_error("bfloat16", unlocked)
    assert error.startswith("--dtype bfloat16: this platform is unlocked by self-check passes "
                            "for float32 only")
    assert "`python -m vllm_kvevict.selfcheck --dtype bfloat16`" in error
    assert unlocked_dtype_error("bfloat16", {}) is None  # a supported platform


GATE = """
import json, sys
from vllm.engine.arg_utils import EngineArgs
from vllm_kvevict.config import KVPolicyError
from vllm_kvevict.integration.plugins import contract, registration
registration.register()
print("REASON", json.dumps(registration.inactive_reason))
print("UNLOCKED", json.dumps(registration.unlocked_by))
print("APPLIED", len(registration.applied),  # (the API server's rows: only under `vllm serve`)
      sum(not wrap.if_loaded for wrap in contract.WRAPS))
args = EngineArgs(model=sys.argv[1], dtype=sys.argv[2], enforce_eager=True, max_model_len=2048,
                  additional_config={"kv_policy": {"policy": "prulong", "sparsity": 0.5}})
try:
    config = args.create_engine_config()
    print("CONFIG", config.parallel_config.worker_cls)
except KVPolicyError as exc:
    print("REFUSED", json.dumps(str(exc)))
"""


def gate(model_dir, pass_dir: Path, dtype: str = "float32") -> dict:
    env = {**os.environ, records.ENV_DIR: str(pass_dir), "VLLM_TARGET_DEVICE": "cpu"}
    env.pop(records.ENV_CHECKING, None)
    proc = subprocess.run([sys.executable, "-c", GATE, str(model_dir), dtype],
                          capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = {}
    for line in proc.stdout.splitlines():
        tag, _, rest = line.partition(" ")
        out[tag] = rest
    return out


def test_vllm033_needs_a_recorded_pass_and_then_activates(bundled_model_dir, tmp_path):
    """vLLM 0.33 or 0.34 (releases outside the supported list; run in their environments, where
    the engine configs are real): a policy is refused, naming the self-check, until a pass for this
    plugin, vLLM, platform and device exists; with one the plugin applies its table and installs
    its scheduler and worker; a dtype the pass does not cover stays refused."""
    from vllm_kvevict.integration.plugins.versions import vllm_release

    if vllm_release() == (0, 32):
        pytest.skip("the served release needs no pass: runs in the vLLM 0.33 / 0.34 environments")
    import vllm

    out = gate(bundled_model_dir, tmp_path)
    assert "run `python -m vllm_kvevict.selfcheck` here" in json.loads(out["REASON"])
    assert out["APPLIED"].split()[0] == str(len(__import__(
        "vllm_kvevict.integration.plugins.contract", fromlist=["x"]).INERT_WRAPS))
    refused = json.loads(out["REFUSED"])
    assert refused.startswith("additional_config['kv_policy'] needs an active plugin")
    records.write_pass(records.PassKey(__version__, vllm.__version__.split("+")[0], "cpu",
                                       records.device_name("cpu"), "float32"), {}, tmp_path)
    out = gate(bundled_model_dir, tmp_path)
    assert json.loads(out["REASON"]) is None and "float32" in json.loads(out["UNLOCKED"])
    applied, total = out["APPLIED"].split()
    assert applied == total
    assert out["CONFIG"].startswith("vllm_kvevict.integration.worker.kvevict_worker"), out
    out = gate(bundled_model_dir, tmp_path, "bfloat16")
    assert json.loads(out["REFUSED"]).startswith("--dtype bfloat16: this platform is unlocked")


def test_the_plugin_version_in_a_pass_is_the_installed_distributions():
    from importlib.metadata import version

    assert version("vllm-kvevict") == __version__
