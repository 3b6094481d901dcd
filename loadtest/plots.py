"""PNG plots of a policy comparison: throughput and p99 latency against concurrency (one line per
policy), and KV pool usage over time (one panel per concurrency).

Kept apart from report.py because matplotlib is slow to import and only the comparison needs it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; no display on servers
import matplotlib.pyplot as plt  # noqa: E402

Runs = dict[str, dict[int, dict[str, Any]]]  # runs[policy_label][concurrency] = run result


def _by_concurrency(ax, runs: Runs, get, ylabel: str, title: str) -> None:
    for policy, per in runs.items():
        levels = sorted(per)
        values = [get(per[c]) for c in levels]
        ax.plot(levels, [float("nan") if v is None else v for v in values], marker="o",
                label=policy)
    ax.set_xscale("log", base=2)
    all_levels = sorted({c for per in runs.values() for c in per})
    ax.set_xticks(all_levels, [str(c) for c in all_levels])
    ax.set_xlabel("concurrency")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")


def plot_throughput(runs: Runs, path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    _by_concurrency(axes[0], runs, lambda r: r["throughput"]["total_tokens_per_s"],
                    "tokens/s", "Total token throughput")
    _by_concurrency(axes[1], runs, lambda r: r["throughput"]["output_tokens_per_s"],
                    "tokens/s", "Output token throughput")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_latency_p99(runs: Runs, path: Path) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, key, title in zip(axes, ("e2e", "ttft", "tpot"),
                              ("End-to-end latency p99", "TTFT p99", "TPOT p99")):
        _by_concurrency(ax, runs, lambda r, k=key: r["latency_ms"][k]["p99"], "ms", title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_kv_usage(runs: Runs, path: Path) -> None:
    levels = sorted({c for per in runs.values() for c in per})
    fig, axes = plt.subplots(1, max(1, len(levels)), figsize=(4.5 * max(1, len(levels)), 3.8),
                             squeeze=False, sharey=True)
    for ax, c in zip(axes[0], levels):
        for policy, per in runs.items():
            timeline = per.get(c, {}).get("server", {}).get("metrics_timeline", [])
            points = [(row["t"], 100 * row["kv_cache_usage"]) for row in timeline
                      if "kv_cache_usage" in row]
            if points:
                ax.plot(*zip(*points), label=policy)
        ax.set_title(f"KV pool usage, concurrency {c}")
        ax.set_xlabel("time since run start (s)")
        ax.set_ylim(0, 105)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    axes[0][0].set_ylabel("KV cache usage (%)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_all(runs: Runs, out_dir: Path) -> list[Path]:
    paths = [out_dir / "throughput.png", out_dir / "latency_p99.png", out_dir / "kv_usage.png"]
    plot_throughput(runs, paths[0])
    plot_latency_p99(runs, paths[1])
    plot_kv_usage(runs, paths[2])
    return paths
