"""Turn per-request results into the numbers of a run: counts, throughput, latency percentiles,
mean kv_stats.

Throughput follows `vllm bench serve` (tokens of successful requests divided by the wall time
of the run) so the two tools can be cross-checked; percentiles use numpy's linear
interpolation, also as vllm bench does.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Iterable, Mapping

import numpy as np

from loadtest.client import OUTCOMES, RequestResult

PERCENTILES = (50, 90, 99)


def latency_stats_ms(values_s: Iterable[float | None]) -> dict[str, float | None]:
    """mean and p50/p90/p99 in milliseconds of the non-missing values (None when empty)."""
    arr = np.array([v for v in values_s if v is not None], dtype=float) * 1000.0
    keys = ["mean"] + [f"p{p}" for p in PERCENTILES]
    if arr.size == 0:
        return {k: None for k in keys}
    out = {"mean": float(arr.mean())}
    out.update({f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES})
    return out


def numeric_leaves(obj: Any, prefix: str = "") -> dict[str, float]:
    """Flatten nested dicts/lists to {dotted.path: number}; bools and strings are not numbers."""
    out: dict[str, float] = {}
    if isinstance(obj, Mapping):
        for key, value in obj.items():
            out.update(numeric_leaves(value, f"{prefix}{key}."))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            out.update(numeric_leaves(value, f"{prefix}{i}."))
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool) and np.isfinite(obj):
        out[prefix.rstrip(".")] = float(obj)
    return out


def aggregate_kv_stats(stats: Iterable[Mapping[str, Any] | None]) -> dict[str, Any]:
    """Mean of every numeric leaf over the requests that reported it.

    Generic on purpose: the plugin's kv_stats fields (footprint, kv_bytes_peak, kv_bytes_saved,
    ...) may change, and whatever is numeric gets averaged.
    """
    sums: dict[str, float] = {}
    counts: Counter[str] = Counter()
    n = 0
    for s in stats:
        if not s:
            continue
        n += 1
        for path, value in numeric_leaves(s).items():
            sums[path] = sums.get(path, 0.0) + value
            counts[path] += 1
    return {"requests": n,
            "mean": {path: sums[path] / counts[path] for path in sorted(sums)},
            "count": {path: counts[path] for path in sorted(counts)}}


def summarize(results: list[RequestResult], duration_s: float, num_requests: int) -> dict[str, Any]:
    """Counts, throughput, latencies, kv_stats and error breakdown of one run."""
    outcomes = Counter(r.outcome for r in results)
    ok = [r for r in results if r.ok]
    input_tokens = sum(r.input_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: 0.0)
    return {
        "duration_s": duration_s,
        "requests": {"total": num_requests, "sent": len(results),
                     **{o: outcomes.get(o, 0) for o in OUTCOMES},
                     "not_sent": num_requests - len(results)},
        "tokens": {"input": input_tokens, "output": output_tokens},
        "throughput": {
            "requests_per_s": per_s(len(ok)),
            "input_tokens_per_s": per_s(input_tokens),
            "output_tokens_per_s": per_s(output_tokens),
            "total_tokens_per_s": per_s(input_tokens + output_tokens),
        },
        "latency_ms": {
            "ttft": latency_stats_ms(r.ttft_s for r in ok),
            "tpot": latency_stats_ms(r.tpot_s for r in ok),
            "e2e": latency_stats_ms(r.e2e_s for r in ok),
            "itl": latency_stats_ms(gap for r in ok for gap in r.itl_s),
        },
        "kv_stats": aggregate_kv_stats(r.kv_stats for r in ok),
        "errors": dict(Counter(r.error_type for r in results if not r.ok)),
    }


def request_record(r: RequestResult) -> dict[str, Any]:
    """JSON form of one request (inter-token gaps left out: they are in the ITL summary)."""
    ms = lambda s: None if s is None else s * 1000.0  # noqa: E731
    return {"index": r.index, "kind": r.kind, "outcome": r.outcome,
            "http_status": r.http_status, "error_type": r.error_type, "error": r.error,
            "input_tokens": r.input_tokens, "output_tokens": r.output_tokens,
            "start_s": r.start_s, "ttft_ms": ms(r.ttft_s), "tpot_ms": ms(r.tpot_s),
            "e2e_ms": ms(r.e2e_s), "kv_stats": r.kv_stats}
