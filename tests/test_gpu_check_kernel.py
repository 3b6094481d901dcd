"""gpu_check's head-pages kernel cells (`gpu_check/kernel_path.py`) on the CPU, in Triton's
interpreter at tiny sizes: the correctness cells against the reference (a hybrid with patched
question rows, full / streaming heads with freed pages, float16; a perturbed head mask fails),
the kernel's timing kinds, the split workspace, the CUDA-graph check saying it did not run, and
the report built from a fake results file (the targets of issue 86).

The interpreter must be on when Triton is first imported (see tests/test_triton_head_pages.py):
where Triton came earlier without it, the interpreter tests skip and `test_in_fresh_process`
runs this file in a pytest process of its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import triton_interpreter

triton = triton_interpreter.import_interpreted_triton()
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from vllm_kvevict.gpu_check import cells, kernel_path, report, timing  # noqa: E402
from vllm_kvevict.gpu_check.__main__ import main  # noqa: E402
from vllm_kvevict.kernels.head_pages import (head_pages_attention,  # noqa: E402
                                             split_workspace)

IN_PROCESS = isinstance(triton.language.standard.sum, InterpretedFunction)
NO_INTERPRETER = ("test_in_fresh_process", "test_report_from_a_fake_results_file",
                  "test_options_and_the_cpu_without_interpreter")
# two requests (40 and 23 tokens) in chunks of 16, two decode steps; sink 4, window 8 (a
# streaming head's page 1 is freed at 40 tokens); one layer
TINY = cells.Sizes((40, 23), 16, 2, 4, 8, 8, 1)


@pytest.fixture(autouse=True)
def _interpreter(request, monkeypatch):
    torch.set_num_threads(1)
    if request.function.__name__ in NO_INTERPRETER:
        return
    if not IN_PROCESS:
        pytest.skip("Triton was imported here without the interpreter: test_in_fresh_process")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def test_in_fresh_process():
    if IN_PROCESS:
        pytest.skip("the interpreter tests run in this process")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop("PYTEST_XDIST_WORKER", None)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-p", "no:xdist", __file__, "-k", "not test_in_fresh_process"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1], \
        proc.stdout[-2000:]


def test_hybrid_cell_with_patched_question_rows():
    """prulong 0.7 + snapkv patched (Llama shape: 8 KV heads, 4 query heads each, d 128):
    compacted heads with question rows and streaming heads in one launch a step, split decode."""
    got = cells.run_case("prulong-0.7 + snapkv patched", TINY, "cpu", "float32", False,
                         path="kernel")
    assert got["mode"] == "kernel" and got["passed"], got
    assert got["kept_mismatch"] == 0 and 0 < got["decode"] <= 1e-4 and got["prefill"] > 0


def test_command_runs_kernel_cells_and_a_perturbed_mask_fails(tmp_path, monkeypatch, capsys):
    """`--paths kernel` through the command (float16, the bundled SmolLM2 mask: full and
    streaming heads); the perturbed head mask fails and the command exits 1; the log and the
    JSON are written; the CUDA-graph check says it did not run here."""
    monkeypatch.setattr(cells, "CPU_SIZES", TINY)
    common = ["--device", "cpu", "--paths", "kernel", "--no-timing", "--no-train",
              "--policies", "prulong-0.7 smollm2 (bundled)"]
    assert main(common + ["--dtypes", "float16", "--out", str(tmp_path / "ok")]) == 0
    results = json.loads((tmp_path / "ok" / "results.json").read_text())
    [cell] = results["correctness"]
    assert cell["passed"] and cell["mode"] == "kernel" and cell["tolerance"] == 2.0 ** -8
    assert results["graph"]["passed"] is None
    assert "CUDA graphs need a CUDA device" in results["graph"]["status"]
    log = (tmp_path / "ok" / "gpu_check.log").read_text()
    assert "CUDA graph (kernel decode step): skipped: CUDA graphs need a CUDA device" in log
    assert "prulong-0.7 smollm2 (bundled)    float16   kernel" in log
    assert main(common + ["--dtypes", "bfloat16", "--perturb", "--no-graph"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_kernel_timing_kinds_run_and_relate_to_sdpa(monkeypatch):
    monkeypatch.setattr(timing, "measure_bandwidth", lambda device: 1e9)
    grid = timing.Grid((64,), (1,), 16, 16, 1)
    got = timing.run_timing(grid, "cpu", torch.float32, False, float("inf"),
                            log=lambda _: None, parts=("layer:decode",),
                            kinds=("sdpa",) + kernel_path.KINDS)["cells"]
    assert [c["kind"] for c in got] == ["sdpa", *kernel_path.KINDS]
    assert all(c["status"] == "ok" and c["ms"] > 0 and c["vs_sdpa"] > 0 for c in got), got
    kernel = {c["kind"]: c for c in got}
    assert kernel["kernel-dense"]["bytes"] > kernel["kernel-snapkv-0.7"]["bytes"]
    assert kernel["kernel-dense"]["splits"] >= 1 and "graph_ms" not in kernel["kernel-dense"]
    with pytest.raises(ValueError, match="unknown timing kinds"):
        timing.run_timing(grid, "cpu", torch.float32, False, 0, kinds=("kernel-fast",))


def test_kernel_call_matches_the_streaming_flags():
    """A kernel timing call: prulong's streaming heads see less than the dense call's."""
    q = torch.randn(32, 2, 128)
    ks = kernel_path.make_kernel_step(q, 2, 400, 1, 8, 1, 0.3)
    dense = kernel_path.KernelCall("kernel-dense", ks, [2], 1, {}, 4, 16, 0.1)().clone()
    prulong = kernel_path.KernelCall("kernel-prulong-0.7", ks, [2], 1, {}, 4, 16, 0.1)()
    assert torch.equal(dense[:, :8], prulong[:, :8])  # the 2 full KV heads' 8 query heads
    assert not torch.allclose(dense[:, 8:], prulong[:, 8:])


def test_workspace_gives_the_same_output_and_is_checked():
    gen = torch.Generator().manual_seed(0)
    pool = torch.randn(12, 8, 32, generator=gen)
    table = torch.randperm(12, generator=gen).int().view(2, 2, 3)
    lengths = torch.tensor([[20, 17], [9, 24]], dtype=torch.int32)
    q = torch.randn(2, 4, 32, generator=gen)
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32)
    args = (q, pool, pool.flip(0).contiguous(), table, lengths, qsl)
    kw = dict(streaming=torch.tensor([0, 1]), sink=2, window=5, max_query_len=1, num_splits=4,
              block_n=16)
    plain = head_pages_attention(*args, **kw)
    ws = split_workspace(5, 4, 32, 4, "cpu")  # more rows than tokens: fine
    assert torch.equal(head_pages_attention(*args, workspace=ws, **kw), plain)
    with pytest.raises(ValueError, match="workspace"):
        head_pages_attention(*args, workspace=split_workspace(2, 4, 32, 2, "cpu"), **kw)


def test_options_and_the_cpu_without_interpreter(monkeypatch):
    assert kernel_path.parse_options("block_n=32,num_splits=8") == {"block_n": 32,
                                                                   "num_splits": 8}
    with pytest.raises(ValueError, match="NAME=INT"):
        kernel_path.parse_options("tile=3")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    problem = kernel_path.interpreter_problem("cpu")
    assert problem.startswith("skipped:") and "TRITON_INTERPRET=1" in problem
    got = cells.run_case("full", TINY, "cpu", "float32", False, path="kernel")
    assert got["passed"] is None and got["status"] == problem
    assert kernel_path.interpreter_problem("cuda") is None
    skipped = kernel_path.graph_replay("cpu")
    assert skipped["passed"] is None and "this run is on cpu" in skipped["status"]


def test_report_from_a_fake_results_file(tmp_path, capsys):
    """The timing table, the targets and the graph line from a results file as a GPU run
    writes it (no device needed): met, not met, not run."""
    def cell(kind, ms, phase="decode", context=32768, **more):
        return dict(scope="layer", phase=phase, context=context, batch=8, layers=1,
                    kind=kind, ms=ms, bytes=int(4e9), bandwidth_share=0.8, status="ok",
                    vs_sdpa=ms / 1.0, **more)
    cells_ = [cell("sdpa", 1.0), cell("kernel-dense", 1.1, graph_ms=1.05, splits=16),
              cell("kernel-prulong-0.7", 0.5, graph_ms=0.44, splits=16),
              cell("kernel-snapkv-0.7", 0.5), cell("kernel-streaming", 0.05),
              dict(scope="layer", phase="prefill", context=8192, batch=8,
                   kind="kernel-dense", status="skipped: budget")]
    lines = report.kernel_targets(cells_)
    text = "\n".join(lines)
    assert "decode    32K batch  8 kernel-dense         <= 1.15x: 1.10x, graph 1.05x, 80% " \
           "of the copy bandwidth (target >= 70%) -> met" in text
    assert "kernel-prulong-0.7   <= 0.45x: 0.50x, graph 0.44x -> met" in text
    assert "kernel-snapkv-0.7    <= 0.40x: 0.50x -> NOT met" in text
    assert "prefill    8K batch  8 kernel-dense         <= 1.50x: not run (skipped: budget)" \
        in text
    assert "128K batch  8 kernel-dense         <= 1.15x: not run (not in this grid)" in text
    table = report.timing_table(cells_)
    assert "kernel-dense" in table and "1.050" in table and "skipped: budget" in table
    ok = {"check": "cuda-graph decode replay", "batch": 8, "context": 4096, "splits": 16,
          "max_diff": 0.0, "inputs_changed_output": True, "passed": True, "status": "ok"}
    assert report.graph_line(ok).endswith("-> ok") and report.graph_word(ok) == "replay equal"
    assert report.graph_word(dict(ok, passed=False)) == "FAILED"
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"environment": {"device_name": "fake H200"},
                                "timing": {"cells": cells_}}))
    assert main(["--plot", str(path), "--out", str(tmp_path)]) == 0
    assert "timing.png" in capsys.readouterr().out
