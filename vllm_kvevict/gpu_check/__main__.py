"""One torch-only command for a GPU box without vLLM: every policy's attention path checked
against the plain-PyTorch reference, a bounded mask-trainer run, and each policy's step timed
against dense attention and the device's bandwidth.

    python -m vllm_kvevict.gpu_check [--device cuda] [--budget-s 480] [--out DIR]

Checked (`cells.py`; `kernel_path.py`: the head-pages Triton kernel, bfloat16 / float16 /
float32; `layer.py`: FlexAttention, float32 / bfloat16, eager and compiled): full, streaming, duo (the bundled Llama-3.1-8B mask),
prulong at 0.5 / 0.7 (the bundled SmolLM2 masks and a seeded Llama-3.1-8B-shaped one),
snapkv / pyramidkv naive and patched, and head mask + token policy hybrids, over prefill chunks
and decode steps of a mixed batch. On a CPU the kernel runs in Triton's interpreter (slow: its
cells are not run by default there, `--paths kernel` runs them). A decode step of the kernel is
captured in a CUDA graph and replayed equal to the eager step (CUDA only).
Not covered (they import vLLM): vLLM's metadata, the step plans and ledgers of
`integration/` (`compress_chunks` itself: its score / select / keep steps are run here through
the same policy calls), the streaming heads' pool pages (a null page where vLLM freed one),
patched question rows on a hybrid's streaming heads (`flex_token.streaming_questions`),
decode-time eviction, fp8 caches, CUDA graphs.

Correctness cells stop starting at half of `--budget-s`, timing cells at the budget, and
whatever did not run is listed as skipped. Exit status 1 when a correctness cell (or the
trainer's run) fails; skipped cells are not failures but are printed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

if __name__ == "__main__" and not torch.cuda.is_available() and "triton" not in sys.modules:
    # no CUDA: the head-pages kernel's cells run in Triton's interpreter, which Triton must
    # know when it is first imported (below, through kernel_path)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from vllm_kvevict.gpu_check import cells, kernel_path, report, timing  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(prog="python -m vllm_kvevict.gpu_check",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--budget-s", type=float, default=480.0,
                   help="wall-clock budget (default fits one 10-minute command with start-up)")
    p.add_argument("--out", help="directory for results.json and timing.png")
    p.add_argument("--paths", default=None, help="comma list of checked paths: kernel (the "
                   "head-pages Triton kernel), flex (FlexAttention); default: kernel,flex on "
                   "CUDA, flex on CPU")
    p.add_argument("--dtypes", default=None, help="default: bfloat16,float16,float32 for the "
                   "kernel, float32,bfloat16 for flex")
    p.add_argument("--kernel-options", default="", help="the kernel's launch options, e.g. "
                   "block_n=64,block_m=64,num_warps=4,num_stages=2,num_splits=16 (num_splits: "
                   "decode steps; default: auto)")
    p.add_argument("--timing-kinds", default=None, help="comma list of "
                   f"{', '.join(timing.KINDS)} (default: all on CUDA; on CPU "
                   f"{', '.join(timing.CPU_KINDS)})")
    p.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph replay check")
    p.add_argument("--modes", default=None, help="compiled,eager (default: both on CUDA, "
                   "eager on CPU, where compiling flex_attention takes minutes)")
    p.add_argument("--policies", default=None, help="comma list of cells.CASES names")
    p.add_argument("--layers", type=int, default=None,
                   help="layers checked per policy (default: 8 on CUDA, 2 on CPU)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default on CPU: 1, the sizes are tiny)")
    p.add_argument("--no-timing", action="store_true")
    p.add_argument("--no-correctness", action="store_true")
    p.add_argument("--timing-parts", default=",".join(timing.PARTS),
                   help=f"comma list of {', '.join(timing.PARTS)}")
    p.add_argument("--no-train", action="store_true")
    p.add_argument("--perturb", action="store_true",
                   help="negative control: the checked path serves each checked layer's first "
                        "streaming head as a full head (the head-mask cells must fail)")
    p.add_argument("--plot", metavar="RESULTS_JSON", help="only draw timing.png of a results "
                   "file into --out (where matplotlib is installed)")
    return p


def cell_plan(args) -> list[tuple[str, str, str, str]]:
    """(path, mode, dtype, policy) of every correctness cell, in the order they run: the
    kernel's first, then flex_attention's per mode."""
    cuda = args.device.startswith("cuda")
    paths = (args.paths or ("kernel,flex" if cuda else "flex")).split(",")
    if set(paths) - set(cells.PATHS):
        raise SystemExit(f"--paths: unknown {sorted(set(paths) - set(cells.PATHS))}; known: "
                         f"{', '.join(cells.PATHS)}")
    modes = (args.modes or ("compiled,eager" if cuda else "eager")).split(",")
    names = args.policies.split(",") if args.policies else list(cells.CASES)
    plan = []
    for path in (p for p in cells.PATHS if p in paths):
        dtypes = (args.dtypes or ("bfloat16,float16,float32" if path == "kernel" else
                                  "float32,bfloat16")).split(",")
        for mode in (["kernel"] if path == "kernel" else modes):
            plan += [(path, mode, dtype, name) for dtype in dtypes for name in names]
    return plan


def check_cells(args, deadline: float) -> list[dict]:
    """Every (path, mode, dtype, policy) cell until `deadline`, printed as it ends."""
    cuda = args.device.startswith("cuda")
    sizes = cells.CUDA_SIZES if cuda else cells.CPU_SIZES
    if args.layers:
        sizes = cells.Sizes(**{**vars(sizes), "layers": args.layers})
    options = kernel_path.parse_options(args.kernel_options)
    out = []
    for path, mode, dtype, name in cell_plan(args):
        base = {"policy": name, "dtype": dtype, "mode": mode}
        if time.monotonic() > deadline:
            out.append(dict(base, status="skipped: budget", passed=None))
            continue
        try:
            out.append(cells.run_case(name, sizes, args.device, dtype, mode == "compiled",
                                      args.perturb, path, options))
        except Exception as exc:  # (reported as a failed cell; the run goes on)
            out.append(dict(base, status=f"error: {type(exc).__name__}: {exc}"[:300],
                            passed=False))
        print(report.correctness_table(out[-1:]).splitlines()[-1], flush=True)
    return out


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.plot:
        results = json.loads(Path(args.plot).read_text())
        print(report.plot(results, Path(args.out or ".") / "timing.png"))
        return 0
    log = report.tee(Path(args.out) / LOG_NAME) if args.out else contextlib.nullcontext()
    with log:
        return _run(args)


LOG_NAME = "gpu_check.log"  # under --out: everything the run printed


def _run(args) -> int:
    start = time.monotonic()
    if args.threads or not args.device.startswith("cuda"):
        torch.set_num_threads(args.threads or 1)
    env = report.environment(args.device)
    print(f"gpu_check on {args.device} ({env.get('device_name')}), torch {env['torch']}, "
          f"triton {env['triton']}, transformers {env['transformers']}; budget "
          f"{args.budget_s:.0f} s", flush=True)
    print(report.correctness_table([]), flush=True)
    checked = [] if args.no_correctness else check_cells(args, start + 0.5 * args.budget_s)
    results = {"environment": env, "argv": sys.argv[1:], "correctness": checked}
    if not args.no_graph:
        results["graph"] = _graph(args)
    if not args.no_train:
        results["trainer"] = _trainer(args)
    if not args.no_timing:
        cuda = args.device.startswith("cuda")
        grid = timing.CUDA_GRID if cuda else timing.CPU_GRID
        compiled = "compiled" in (args.modes or ("compiled" if cuda else "eager"))
        kinds = args.timing_kinds or ",".join(timing.KINDS if cuda else timing.CPU_KINDS)
        results["timing"] = timing.run_timing(grid, args.device, torch.bfloat16 if cuda
                                              else torch.float32, compiled,
                                              start + args.budget_s - 10, log=_progress,
                                              parts=tuple(args.timing_parts.split(",")),
                                              kinds=tuple(kinds.split(",")),
                                              options=kernel_path.parse_options(
                                                  args.kernel_options))
        print(report.timing_table(results["timing"]["cells"]))
        print("\n".join(report.kernel_targets(results["timing"]["cells"])), flush=True)
    return _finish(args, results, time.monotonic() - start)


def _graph(args) -> dict:
    try:
        got = kernel_path.graph_replay(args.device,
                                       kernel_path.parse_options(args.kernel_options))
    except Exception as exc:
        got = {"check": "cuda-graph decode replay", "passed": False,
               "status": f"error: {type(exc).__name__}: {exc}"[:300]}
    print(report.graph_line(got), flush=True)
    return got


def _trainer(args) -> dict:
    out = args.out or tempfile.mkdtemp(prefix="gpu_check-")
    Path(out).mkdir(parents=True, exist_ok=True)
    try:
        got = cells.trainer_smoke(args.device, out)
    except Exception as exc:
        got = {"passed": False, "status": f"error: {type(exc).__name__}: {exc}"[:300]}
    print(f"mask trainer (duo, tiny random Llama, {args.device}): losses "
          f"{' '.join(f'{x:.5f}' for x in got.get('losses', []))} -> "
          f"{'ok' if got['passed'] else 'FAIL ' + got.get('status', 'loss did not fall')}")
    return got


def _progress(line: str) -> None:
    print(line, flush=True)


def _finish(args, results: dict, seconds: float) -> int:
    checked = results["correctness"]
    failed = [c for c in checked if c.get("passed") is False]
    skipped = [c for c in checked if c.get("passed") is None]
    timed = results.get("timing", {}).get("cells", [])
    skipped_t = [c for c in timed if c.get("status", "").startswith("skipped")]
    trainer_failed = results.get("trainer", {}).get("passed") is False
    graph_failed = results.get("graph", {}).get("passed") is False
    results["summary"] = {"seconds": round(seconds, 1), "cells": len(checked),
                          "failed": len(failed), "skipped": len(skipped),
                          "timing_cells": len(timed), "timing_skipped": len(skipped_t),
                          "trainer_failed": trainer_failed, "graph_failed": graph_failed}
    print(f"correctness: {len(checked) - len(failed) - len(skipped)} of {len(checked)} cells "
          f"within tolerance, {len(failed)} failed, {len(skipped)} skipped (budget); timing: "
          f"{len(timed) - len(skipped_t)} cells, {len(skipped_t)} skipped (budget or memory); "
          f"CUDA graph: {report.graph_word(results.get('graph'))}; {seconds:.1f} s", flush=True)
    if args.out:
        for line in report.write(Path(args.out), results):
            print(f"wrote {line}" if not line.endswith(")") and "not drawn" not in line
                  else line)
    return 1 if failed or trainer_failed or graph_failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
