"""One torch-only command for a GPU box without vLLM: every policy's attention path checked
against the plain-PyTorch reference, a bounded mask-trainer run, and each policy's step timed
against dense attention and the device's bandwidth.

    python -m vllm_kvevict.gpu_check [--device cuda] [--budget-s 480] [--out DIR]

Checked (`cells.py`, `layer.py`): full, streaming, duo (the bundled Llama-3.1-8B mask),
prulong at 0.5 / 0.7 (the bundled SmolLM2 masks and a seeded Llama-3.1-8B-shaped one),
snapkv / pyramidkv naive and patched, and head mask + token policy hybrids, over prefill chunks
and decode steps of a mixed batch, in float32 and bfloat16, flex_attention eager and compiled.
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
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from vllm_kvevict.gpu_check import cells, report, timing


def build_parser() -> argparse.ArgumentParser:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(prog="python -m vllm_kvevict.gpu_check",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--budget-s", type=float, default=480.0,
                   help="wall-clock budget (default fits one 10-minute command with start-up)")
    p.add_argument("--out", help="directory for results.json and timing.png")
    p.add_argument("--dtypes", default="float32,bfloat16")
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


def check_cells(args, deadline: float) -> list[dict]:
    """Every (policy, dtype, mode) cell until `deadline`, printed as it ends."""
    cuda = args.device.startswith("cuda")
    sizes = cells.CUDA_SIZES if cuda else cells.CPU_SIZES
    if args.layers:
        sizes = cells.Sizes(**{**vars(sizes), "layers": args.layers})
    modes = (args.modes or ("compiled,eager" if cuda else "eager")).split(",")
    names = args.policies.split(",") if args.policies else list(cells.CASES)
    out = []
    for mode in modes:
        for dtype in args.dtypes.split(","):
            for name in names:
                base = {"policy": name, "dtype": dtype, "mode": mode}
                if time.monotonic() > deadline:
                    out.append(dict(base, status="skipped: budget", passed=None))
                    continue
                try:
                    out.append(cells.run_case(name, sizes, args.device, dtype,
                                              mode == "compiled", args.perturb))
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
    if not args.no_train:
        results["trainer"] = _trainer(args)
    if not args.no_timing:
        cuda = args.device.startswith("cuda")
        grid = timing.CUDA_GRID if cuda else timing.CPU_GRID
        compiled = "compiled" in (args.modes or ("compiled" if cuda else "eager"))
        results["timing"] = timing.run_timing(grid, args.device, torch.bfloat16 if cuda
                                              else torch.float32, compiled,
                                              start + args.budget_s - 10, log=_progress,
                                              parts=tuple(args.timing_parts.split(",")))
        print(report.timing_table(results["timing"]["cells"]))
    return _finish(args, results, time.monotonic() - start)


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
    results["summary"] = {"seconds": round(seconds, 1), "cells": len(checked),
                          "failed": len(failed), "skipped": len(skipped),
                          "timing_cells": len(timed), "timing_skipped": len(skipped_t),
                          "trainer_failed": trainer_failed}
    print(f"correctness: {len(checked) - len(failed) - len(skipped)} of {len(checked)} cells "
          f"within tolerance, {len(failed)} failed, {len(skipped)} skipped (budget); timing: "
          f"{len(timed) - len(skipped_t)} cells, {len(skipped_t)} skipped (budget or memory); "
          f"{seconds:.1f} s", flush=True)
    if args.out:
        for line in report.write(Path(args.out), results):
            print(f"wrote {line}" if not line.endswith(")") and "not drawn" not in line
                  else line)
    return 1 if failed or trainer_failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
