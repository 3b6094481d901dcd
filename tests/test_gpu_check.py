"""`python -m vllm_kvevict.gpu_check` at CPU sizes (no server, torch only): every correctness
cell within tolerance, the trainer's bounded run, the timing table; a perturbed head mask
fails; the budget stops the timing cells; the JSON (and, with matplotlib, the PNG) written."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import time
import types

import pytest
import torch

from vllm_kvevict.gpu_check import cells, layer, timing
from vllm_kvevict.gpu_check.__main__ import main


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    rc = main(["--device", "cpu", "--out", str(out)])
    return rc, json.loads((out / "results.json").read_text()), out


def test_cpu_run_passes_every_cell_and_writes_json(cpu_run):
    rc, results, out = cpu_run
    assert rc == 0
    checked = results["correctness"]
    assert len(checked) == len(cells.CASES) * 2  # float32, bfloat16; eager on CPU
    assert all(c["passed"] for c in checked), [c for c in checked if not c["passed"]]
    assert {c["policy"] for c in checked} == set(cells.CASES)
    # token eviction kept the reference's positions; prefill and decode rows both compared
    assert all(c["kept_mismatch"] == 0 and c["ties"] == 0 and c["decode"] >= 0
               for c in checked)
    trainer = results["trainer"]
    assert trainer["passed"] and trainer["losses"][-1] < trainer["losses"][0]
    assert (out / "trainer-smoke-duo.json").is_file()
    timed = results["timing"]["cells"]
    assert {c["kind"] for c in timed} == set(timing.CPU_KINDS)  # the kernel's: elsewhere
    assert {c["scope"] for c in timed} == {"layer", "model"}
    assert all(c["status"] == "ok" and c["ms"] > 0 and c["bytes"] > 0 for c in timed)
    assert results["timing"]["bandwidth_bytes_per_s"] > 0
    assert results["summary"]["failed"] == 0 and results["environment"]["torch"]


def test_a_near_tie_at_the_cut_is_adopted_and_a_real_gap_is_not():
    """The reference takes the checked path's choice only where both are top-k up to
    TIE_RTOL of the head's largest score (another summation order on a GPU)."""
    scores = torch.tensor([[4.0, 1.0, 1.0 + 1e-6, 0.5], [4.0, 1.0, 2.0, 0.5]])
    window = torch.tensor([[4], [4]])
    chosen = torch.cat([torch.tensor([[0, 2], [0, 2]]), window], 1)  # the exact top 2
    other = torch.cat([torch.tensor([[0, 1], [0, 1]]), window], 1)   # token 1 for token 2
    rows, ties = layer.adopt_ties(scores, chosen.clone(), other, selected=2)
    assert ties == 1
    assert rows[0].tolist() == [0, 1, 4] and rows[1].tolist() == [0, 2, 4]
    assert layer.adopt_ties(scores, chosen.clone(), chosen, selected=2)[1] == 0


def test_the_png_is_drawn_where_matplotlib_is(cpu_run, tmp_path):
    _, _, out = cpu_run
    pytest.importorskip("matplotlib")
    assert main(["--plot", str(out / "results.json"), "--out", str(tmp_path)]) == 0
    assert (tmp_path / "timing.png").stat().st_size > 1000


def test_a_perturbed_head_mask_fails(tmp_path):
    """The checked path serves one streaming head as full (the reference does not): the head
    mask cells fail and the command exits 1; token eviction alone is unaffected."""
    rc = main(["--device", "cpu", "--perturb", "--no-timing", "--no-train", "--dtypes",
               "float32", "--policies", "prulong-0.7 llama,snapkv naive,streaming",
               "--out", str(tmp_path)])
    assert rc == 1
    got = {c["policy"]: c for c in json.loads((tmp_path / "results.json").read_text())
           ["correctness"]}
    assert not got["prulong-0.7 llama"]["passed"] and not got["streaming"]["passed"]
    assert got["prulong-0.7 llama"]["prefill"] > 1e-2 and got["snapkv naive"]["passed"]


def test_the_budget_stops_the_cells_and_says_so(tmp_path, capsys, monkeypatch):
    rc = main(["--device", "cpu", "--budget-s", "0", "--no-train", "--policies", "full",
               "--out", str(tmp_path)])
    assert rc == 0  # nothing failed; what did not run is listed
    results = json.loads((tmp_path / "results.json").read_text())
    assert all(c["status"] == "skipped: budget" for c in results["correctness"])
    assert results["timing"]["cells"] and all(
        c["status"] == "skipped: budget" for c in results["timing"]["cells"])
    assert results["summary"]["timing_skipped"] == len(results["timing"]["cells"])
    assert "skipped (budget" in capsys.readouterr().out
    # a clock that moves 0.4 s per look and a deadline at 1.0: the first cells run, the rest
    # are skipped, whatever the machine's speed
    clock = itertools.count(step=0.4)
    monkeypatch.setattr(timing, "time", types.SimpleNamespace(
        monotonic=lambda: next(clock), perf_counter=time.perf_counter))
    monkeypatch.setattr(timing, "measure_bandwidth", lambda device: 1e9)
    part = timing.run_timing(timing.CPU_GRID, "cpu", torch.float32, False, 1.0,
                             log=lambda _: None, kinds=timing.CPU_KINDS)["cells"]
    assert part[0]["status"] == "ok" and part[-1]["status"] == "skipped: budget"


def test_the_command_imports_neither_vllm_nor_the_integration():
    code = ("import sys; import vllm_kvevict.gpu_check.__main__; "
            "bad = [m for m in sys.modules if m == 'vllm' or m.startswith(('vllm.', "
            "'vllm_kvevict.integration'))]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.slow
def test_compiled_flex_attention_on_cpu(tmp_path):
    """The compiled mode (`--modes compiled`) at CPU sizes, a hybrid (both kinds of head-mask
    call and token eviction's): minutes of C++ compilation here (~3.5 for one cell), hence
    slow; on CUDA it is the default, before eager."""
    rc = main(["--device", "cpu", "--modes", "compiled", "--no-timing", "--no-train",
               "--dtypes", "float32", "--policies", "prulong-0.7 + snapkv patched",
               "--budget-s", "3600", "--out", str(tmp_path)])
    assert rc == 0
    [got] = json.loads((tmp_path / "results.json").read_text())["correctness"]
    assert got["mode"] == "compiled" and got["passed"]


def test_the_one_call_experiment_computes_what_the_two_served_calls_do():
    """`prulong-0.7-one-call` (one flex_attention call, a per-query-head block mask) is timed
    beside the served two calls; it must compute the same attention to be a fair comparison."""
    # (past sink + window, so the streaming heads see less than the full ones)
    step = timing.make_step("prefill", 1024, 2, timing.CPU_GRID, 1, "cpu", torch.float32)
    masks = timing.step_masks(step, "cpu")
    f, group, scale = 2, cells.LLAMA_8B[2], cells.LLAMA_8B[3] ** -0.5
    mixed = timing.mixed_masks(step, "cpu", [f])[f]
    run = layer.kernel("cpu", compiled=False)
    (k, v), q = step.full[0], step.q
    one = run(q, k, v, mixed, scale)
    two = torch.cat([run(q[:f * group], k[:, :f], v[:, :f], masks["full"], scale),
                     run(q[f * group:], k[:, f:], v[:, f:], masks["streaming"], scale)])
    torch.testing.assert_close(one, two)
    # and it is not the dense answer: the streaming heads' mask took effect
    assert not torch.allclose(one, run(q, k, v, masks["full"], scale))
