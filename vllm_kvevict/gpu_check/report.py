"""What a run prints and writes: the correctness and timing tables, the JSON of every cell with
the machine's versions, and a PNG of the timing cells (when matplotlib is installed; else
`--plot RESULTS.json` draws it later where it is)."""

from __future__ import annotations

import contextlib
import json
import platform
import subprocess
import sys
from pathlib import Path

import torch


def environment(device: str) -> dict:
    """Versions and device, for the results file."""
    env = {"torch": torch.__version__, "python": platform.python_version(), "device": device,
           "cuda": torch.version.cuda}
    for name in ("triton", "transformers"):
        try:
            env[name] = __import__(name).__version__
        except ImportError:
            env[name] = None
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(torch.device(device))
        env.update(device_name=props.name, device_memory_bytes=props.total_memory,
                   driver=_driver_version())
    else:
        env["device_name"] = platform.processor() or platform.machine()
    return env


def _driver_version() -> str | None:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,"
                               "noheader"], capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def correctness_table(cells: list[dict]) -> str:
    lines = [f"{'policy':32s} {'dtype':9s} {'mode':8s} {'prefill':>9s} {'decode':>9s} "
             f"{'kept≠':>5s} {'ties':>4s} {'graphs':>6s} {'tol':>7s}  result   (error: max "
             "|checked - reference| / (1 + |reference|); ties: heads whose cut fell on a "
             "near-tie; graphs: flex_attention graphs compiled in the cell)"]
    for c in cells:
        if "prefill" not in c:
            lines.append(f"{c['policy']:32s} {c['dtype']:9s} {c['mode']:8s} {c['status']}")
            continue
        lines.append(f"{c['policy']:32s} {c['dtype']:9s} {c['mode']:8s} {c['prefill']:9.2e} "
                     f"{c['decode']:9.2e} {c['kept_mismatch']:5d} {c.get('ties', 0):4d} "
                     f"{'-' if c.get('compiles') is None else c['compiles']:>6} "
                     f"{c['tolerance']:7.1e}  "
                     f"{'ok' if c['passed'] else 'FAIL'}")
    return "\n".join(lines)


def timing_table(cells: list[dict]) -> str:
    lines = [f"{'scope':5s} {'phase':7s} {'ctx':>6s} {'batch':>5s} {'kind':25s} {'ms':>9s} "
             f"{'/sdpa':>6s} {'/flex':>6s} {'GB read':>8s} {'of bw':>6s} {'peak+GB':>7s} "
             f"{'graph ms':>8s} {'splits':>6s}   (graph ms: the kernel's decode step replayed "
             "from a CUDA graph)"]
    for c in cells:
        head = (f"{c['scope']:5s} {c['phase']:7s} {c['context']:6d} {c['batch']:5d} "
                f"{c['kind']:25s}")
        if c.get("ms") is None:
            lines.append(f"{head} {c['status']}")
            continue
        peak = "" if c.get("peak_extra_bytes") is None else f"{c['peak_extra_bytes'] / 1e9:7.2f}"
        graph = "" if c.get("graph_ms") is None else f"{c['graph_ms']:8.3f}"
        lines.append(f"{head} {c['ms']:9.3f} {c.get('vs_sdpa', 0):6.2f} "
                     f"{c.get('vs_flex_dense', 0):6.2f} {c['bytes'] / 1e9:8.3f} "
                     f"{c['bandwidth_share']:6.1%} {peak:>7s} {graph:>8s} "
                     f"{c.get('splits', ''):>6}")
    return "\n".join(lines)


# issue 86's targets for the kernel (bfloat16, layer scope): (phase, context, batch, kind,
# at most this many times SDPA's time); and the dense decode cells' share of the bandwidth
KERNEL_TARGETS = [("decode", 32768, 8, "kernel-dense", 1.15),
                  ("decode", 131072, 8, "kernel-dense", 1.15),
                  ("decode", 32768, 8, "kernel-prulong-0.7", 0.45),
                  ("decode", 32768, 8, "kernel-snapkv-0.7", 0.40),
                  ("decode", 32768, 8, "kernel-streaming", 0.10),
                  ("prefill", 8192, 8, "kernel-dense", 1.5),
                  ("prefill", 32768, 8, "kernel-dense", 1.5),
                  ("prefill", 32768, 8, "kernel-prulong-0.7", 0.6)]
BANDWIDTH_TARGET = 0.70


def kernel_targets(cells: list[dict]) -> list[str]:
    """One line per target of KERNEL_TARGETS: the layer cell's time over SDPA's (eager; the
    CUDA-graph replay's too where timed), met or not, or not run."""
    lines = ["kernel targets (issue 86; layer scope, time over SDPA's in this run):"]
    for phase, context, batch, kind, limit in KERNEL_TARGETS:
        name = f"  {phase:7s} {context // 1024:4d}K batch {batch:2d} {kind:20s} <= {limit:.2f}x"
        cell = next((c for c in cells if (c.get("scope"), c.get("phase"), c.get("context"),
                                          c.get("batch"), c.get("kind")) ==
                     ("layer", phase, context, batch, kind)), None)
        if cell is None or cell.get("vs_sdpa") is None:
            lines.append(f"{name}: not run ({(cell or {}).get('status', 'not in this grid')})")
            continue
        ratio, sdpa_ms = cell["vs_sdpa"], cell["ms"] / cell["vs_sdpa"]
        graph = (f", graph {cell['graph_ms'] / sdpa_ms:.2f}x" if cell.get("graph_ms")
                 else "")
        bandwidth = (f", {cell['bandwidth_share']:.0%} of the copy bandwidth (target "
                     f">= {BANDWIDTH_TARGET:.0%})" if kind == "kernel-dense" and
                     phase == "decode" else "")
        verdict = "met" if min(ratio, cell.get("graph_ms", 1e30) / sdpa_ms) <= limit else \
            "NOT met"
        lines.append(f"{name}: {ratio:.2f}x{graph}{bandwidth} -> {verdict}")
    return lines


def graph_word(got: dict | None) -> str:
    if not got:
        return "not run"
    return {True: "replay equal", False: "FAILED", None: "skipped"}[got.get("passed")]


def graph_line(got: dict) -> str:
    """The CUDA-graph check's one line."""
    if got.get("passed") is None or "max_diff" not in got:
        return f"CUDA graph (kernel decode step): {got.get('status')}"
    return (f"CUDA graph (kernel decode step, batch {got['batch']}, {got['context']} tokens, "
            f"{got['splits']} splits, no host sync): replay vs eager max |diff| "
            f"{got['max_diff']:.3g}, inputs changed the output: {got['inputs_changed_output']}"
            f" -> {'ok' if got['passed'] else 'FAIL'}")


class _Tee:
    def __init__(self, *streams):
        self.streams = streams

    def write(self, text: str) -> int:
        for stream in self.streams:
            stream.write(text)
        return len(text)

    def flush(self) -> None:
        for stream in self.streams:
            stream.flush()


@contextlib.contextmanager
def tee(path: Path):
    """Everything printed to stdout meanwhile also goes to `path` (the run's log)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        saved, sys.stdout = sys.stdout, _Tee(sys.stdout, f)
        try:
            yield path
        finally:
            sys.stdout = saved


def write(out: Path, results: dict) -> list[str]:
    """results.json and timing.png under `out`; returns what was written or why not (the log,
    gpu_check.log, is written as the run prints)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    return [str(out / "results.json"), plot(results, out / "timing.png")]


def plot(results: dict, path: Path) -> str:
    """Per scope and phase: ms per kind over context, one line per (kind, batch)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return (f"{path}: not drawn (no matplotlib in this environment); draw it where it is: "
                f"python -m vllm_kvevict.gpu_check --plot RESULTS.json --out DIR")
    cells = [c for c in results.get("timing", {}).get("cells", []) if c.get("ms")]
    panels = sorted({(c["scope"], c["phase"]) for c in cells})
    if not panels:
        return f"{path}: not drawn (no timing cell ran)"
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (scope, phase) in zip(axes[0], panels):
        mine = [c for c in cells if (c["scope"], c["phase"]) == (scope, phase)]
        for kind, batch in sorted({(c["kind"], c["batch"]) for c in mine}):
            line = sorted((c["context"], c["ms"]) for c in mine
                          if (c["kind"], c["batch"]) == (kind, batch))
            ax.plot(*zip(*line), marker="o", label=f"{kind} b{batch}")
        ax.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="ms per step",
               title=f"{scope} {phase}")
        ax.legend(fontsize=6)
    fig.suptitle(f"{results.get('environment', {}).get('device_name', '')}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
