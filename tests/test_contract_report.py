"""`python -m vllm_kvevict.contract` (integration/plugins/contract_report.py): on the installed vLLM
(0.32 here, 0.33 / 0.34 in the other environments) every WRAPS / RELIED_ON / TOUCHED /
PUBLIC_INTERNALS row is present and the verdict is the activation gate's; a name that moved or
vanished is reported as such and makes the command exit 1."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_kvevict.integration.plugins import contract, contract_report
from vllm_kvevict.integration.plugins.versions import V1_RUNNER, vllm_release

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def source():
    return contract_report.VLLMSource()


def test_the_command_reports_every_row_present_and_the_activation_verdict(tmp_path):
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "vllm_kvevict.contract", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    tables = [r["table"] for r in result["rows"]]
    assert tables.count("WRAPS") == len(contract.WRAPS)
    # (where vLLM has no V1 runner, its rows are listed as n/a: vLLM 0.34)
    unused = () if V1_RUNNER else contract.V1_RUNNER_ROWS
    unused_internals = () if V1_RUNNER else contract.V1_RUNNER_INTERNALS
    assert tables.count("RELIED_ON") == len(set(contract.RELIED_ON) | set(unused))
    assert tables.count("TOUCHED") == len(contract.TOUCHED)
    assert tables.count("PUBLIC_INTERNALS") == len(
        set(contract.PUBLIC_INTERNALS) | set(unused_internals))
    assert {r["name"] for r in result["rows"] if r["status"] == "n/a"} == \
        set(unused) | set(unused_internals)
    # the surface counted as the ratchet counts it (n/a rows left out), internals apart
    assert result["surface"] == {
        "WRAPS": len(contract.WRAPS), "RELIED_ON": len(contract.RELIED_ON),
        "TOUCHED": len(contract.TOUCHED), "PUBLIC_INTERNALS": len(contract.PUBLIC_INTERNALS)}
    assert f"surface: RELIED_ON + TOUCHED = {len(contract.RELIED_ON)} + " \
        f"{len(contract.TOUCHED)} = {len(contract.RELIED_ON) + len(contract.TOUCHED)}" in proc.stdout
    assert {r["status"] for r in result["rows"]} <= {"present", "ours", "n/a"}, result["rows"]
    # the verdict is the entry point's: the served release activates, 0.33 names its reason
    assert result["can_activate"] is (vllm_release() == (0, 32)), result["inactive_reason"]
    assert proc.stdout.strip().splitlines()[-1].startswith(
        "plugin can activate here: " + ("yes" if result["can_activate"] else "no (vLLM 0."))


def test_a_moved_name_and_a_missing_one(source):
    moved = contract_report.check_name(
        "RELIED_ON", "vllm.v1.core.sched.elsewhere.Scheduler.schedule", source)
    assert (moved.status, moved.where) == ("moved", "vllm/v1/core/sched/scheduler.py")
    missing = contract_report.check_name(
        "RELIED_ON", "vllm.v1.core.sched.scheduler.Scheduler.no_such_method_kvevict", source)
    assert missing.status == "missing"
    gone = contract_report.check_touched("x.py", "_no_such_private_attribute_kvevict", source)
    assert gone.status == "missing"
    assert contract_report.check_touched("x.py", "kvevict_masks", source).status == "ours"
    internal = contract_report.check_internal(
        "vllm.v1.core.single_type_kv_cache_manager.SingleTypeKVCacheManager.req_to_blocks_kv")
    assert internal.status == "missing"
    assert contract_report.check_internal(
        "vllm.v1.core.single_type_kv_cache_manager.SingleTypeKVCacheManager.req_to_blocks"
    ).status == "present"  # (set in __init__, not a class attribute)


def test_the_command_exits_1_when_a_row_is_missing(monkeypatch, capsys):
    monkeypatch.setattr(contract, "RELIED_ON",
                        (*contract.RELIED_ON, "vllm.v1.core.block_pool.BlockPool.gone_kv"))
    assert contract_report.main([]) == 1
    out = capsys.readouterr().out
    assert "RELIED_ON        missing  vllm.v1.core.block_pool.BlockPool.gone_kv" in out
