"""Put a run's numbers into their outputs: the JSON result, the human table on stdout, and the
side-by-side Markdown table of a policy comparison.

The JSON layout is documented in loadtest/README.md ("Run result JSON"); SCHEMA names its
version so that later readers can tell layouts apart.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from loadtest.metrics import request_record, summarize
from loadtest.runner import RunData

SCHEMA = "loadtest.run/1"


def build_result(config: dict[str, Any], run: RunData) -> dict[str, Any]:
    summary = summarize(run.results, run.duration_s, run.num_requests)
    metrics, memory = run.metrics or {}, run.memory or {}
    server = {
        "peak_rss_bytes": memory.get("peak_rss_bytes"),
        "kv_cache_usage_peak": metrics.get("kv_cache_usage_peak"),
        "kv_cache_usage_mean": metrics.get("kv_cache_usage_mean"),
        "preemptions": metrics.get("preemptions"),
        "metrics_timeline": metrics.get("timeline", []),
        "rss_timeline": memory.get("timeline", []),
    }
    return {"schema": SCHEMA, "config": config, "started_at": run.started_at, **summary,
            "server": server, "per_request": [request_record(r) for r in run.results]}


def write_json(result: dict[str, Any], path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")


def _num(value: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def _bytes(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**30:.2f} GiB"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f} %"


def format_table(result: dict[str, Any]) -> str:
    """A compact human summary of one run."""
    cfg, req, thr, srv = result["config"], result["requests"], result["throughput"], \
        result["server"]
    load = f"rate={cfg['rate']}/s" if cfg.get("rate") else f"concurrency={cfg.get('concurrency')}"
    lines = [
        f"workload {cfg.get('workload')}  {load}  model {cfg.get('model')}  "
        f"duration {result['duration_s']:.2f} s",
        f"requests    ok {req['ok']}  rejected {req['rejected']}  failed {req['failed']}  "
        f"cancelled {req['cancelled']}  not sent {req['not_sent']}  (of {req['total']})",
        f"throughput  {thr['requests_per_s']:.3f} req/s  input {thr['input_tokens_per_s']:.1f}"
        f"  output {thr['output_tokens_per_s']:.1f}  total {thr['total_tokens_per_s']:.1f} tok/s",
        f"{'latency ms':<12}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}",
    ]
    for name, stats in result["latency_ms"].items():
        lines.append(f"  {name.upper():<10}" + "".join(
            f"{_num(stats[k]):>10}" for k in ("mean", "p50", "p90", "p99")))
    lines.append(f"server      peak RSS {_bytes(srv['peak_rss_bytes'])}  KV pool peak "
                 f"{_pct(srv['kv_cache_usage_peak'])} mean {_pct(srv['kv_cache_usage_mean'])}  "
                 f"preemptions {_num(srv['preemptions'], '{:.0f}')}")
    kv = result["kv_stats"]
    if kv["requests"]:
        means = "  ".join(f"{k}={v:.4g}" for k, v in kv["mean"].items())
        lines.append(f"kv_stats    mean over {kv['requests']} requests: {means}")
    if result["errors"]:
        lines.append("errors      " + "  ".join(f"{k}: {v}" for k, v in result["errors"].items()))
    return "\n".join(lines)


# (header, getter) of the comparison's full table; getters take one run result.
_DETAIL_COLUMNS = [
    ("ok/rej/fail", lambda r: f"{r['requests']['ok']}/{r['requests']['rejected']}/"
                              f"{r['requests']['failed'] + r['requests']['cancelled']}"),
    ("req/s", lambda r: _num(r["throughput"]["requests_per_s"], "{:.3f}")),
    ("out tok/s", lambda r: _num(r["throughput"]["output_tokens_per_s"])),
    ("total tok/s", lambda r: _num(r["throughput"]["total_tokens_per_s"])),
    ("TTFT p50/p99 ms", lambda r: f"{_num(r['latency_ms']['ttft']['p50'], '{:.0f}')} / "
                                  f"{_num(r['latency_ms']['ttft']['p99'], '{:.0f}')}"),
    ("TPOT p50/p99 ms", lambda r: f"{_num(r['latency_ms']['tpot']['p50'])} / "
                                  f"{_num(r['latency_ms']['tpot']['p99'])}"),
    ("E2E p50/p99 ms", lambda r: f"{_num(r['latency_ms']['e2e']['p50'], '{:.0f}')} / "
                                 f"{_num(r['latency_ms']['e2e']['p99'], '{:.0f}')}"),
    ("peak RSS", lambda r: _bytes(r["server"]["peak_rss_bytes"])),
    ("KV pool peak", lambda r: _pct(r["server"]["kv_cache_usage_peak"])),
    ("preempt.", lambda r: _num(r["server"]["preemptions"], "{:.0f}")),
]

# Metrics shown side by side (one column per policy).
_PIVOT_METRICS = [
    ("Total throughput (tok/s)", lambda r: _num(r["throughput"]["total_tokens_per_s"])),
    ("Output throughput (tok/s)", lambda r: _num(r["throughput"]["output_tokens_per_s"])),
    ("E2E latency p99 (ms)", lambda r: _num(r["latency_ms"]["e2e"]["p99"], "{:.0f}")),
    ("TTFT p99 (ms)", lambda r: _num(r["latency_ms"]["ttft"]["p99"], "{:.0f}")),
    ("KV pool usage peak", lambda r: _pct(r["server"]["kv_cache_usage_peak"])),
    ("Preemptions", lambda r: _num(r["server"]["preemptions"], "{:.0f}")),
]


def _md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(row) + " |" for row in rows)]


def comparison_markdown(runs: dict[str, dict[int, dict[str, Any]]], title: str,
                        notes: list[str] = ()) -> str:
    """runs[policy_label][concurrency] = run result. Pivot tables per metric, then details."""
    policies = list(runs)
    levels = sorted({c for per in runs.values() for c in per})
    out = [f"# {title}", "", *notes, ""] if notes else [f"# {title}", ""]
    for name, get in _PIVOT_METRICS:
        rows = [[str(c)] + [get(runs[p][c]) if c in runs[p] else "-" for p in policies]
                for c in levels]
        out += [f"## {name}", "", *_md_table(["concurrency", *policies], rows), ""]
    kv_rows = []
    for p in policies:
        for c in sorted(runs[p]):
            means = runs[p][c]["kv_stats"]["mean"]
            if means:
                kv_rows.append([p, str(c), ", ".join(f"{k}={v:.4g}" for k, v in means.items())])
    if kv_rows:
        out += ["## kv_stats (mean per request)", "",
                *_md_table(["policy", "concurrency", "means"], kv_rows), ""]
    rows = [[p, str(c), *(get(runs[p][c]) for _, get in _DETAIL_COLUMNS)]
            for p in policies for c in sorted(runs[p])]
    out += ["## All numbers", "",
            *_md_table(["policy", "concurrency", *(h for h, _ in _DETAIL_COLUMNS)], rows), ""]
    return "\n".join(out)
