"""Cross-check our throughput against `vllm bench serve` on the same server and load shape.

If both tools agree within a tolerance (10 % by default), our numbers measure the server rather
than the client. vllm bench's random dataset gives fixed-length prompts like our rag/cot
workloads, so only those (not mix) have an equivalent.
"""

from __future__ import annotations

import re
import subprocess
from typing import Any

from vllm_kvevict.launch import VLLM

# Anchored at line start: "Peak output token throughput" must not match the output line.
_PATTERNS = {
    "successful_requests": r"^\s*Successful requests:\s*([\d.]+)",
    "duration_s": r"^\s*Benchmark duration \(s\):\s*([\d.]+)",
    "requests_per_s": r"^\s*Request throughput \(req/s\):\s*([\d.]+)",
    "output_tokens_per_s": r"^\s*Output token throughput \(tok/s\):\s*([\d.]+)",
    "total_tokens_per_s": r"^\s*Total token throughput \(tok/s\):\s*([\d.]+)",
}
COMPARED = ("requests_per_s", "input_tokens_per_s", "output_tokens_per_s", "total_tokens_per_s")


def bench_serve_command(*, base_url: str, model: str, tokenizer: str, input_len: int,
                        output_len: int, num_prompts: int, concurrency: int | None = None,
                        rate: float | None = None, seed: int = 0, ignore_eos: bool = True,
                        executable: str = VLLM) -> list[str]:
    """argv of `vllm bench serve` matching one of our rag/cot runs."""
    argv = [executable, "bench", "serve", "--backend", "vllm", "--base-url", base_url,
            "--endpoint", "/v1/completions", "--model", model, "--tokenizer", tokenizer,
            "--dataset-name", "random", "--random-input-len", str(input_len),
            "--random-output-len", str(output_len), "--random-range-ratio", "0",
            "--num-prompts", str(num_prompts), "--seed", str(seed)]
    if rate is not None:
        argv += ["--request-rate", str(rate)]
    else:
        argv += ["--request-rate", "inf", "--max-concurrency", str(concurrency or 1)]
    if ignore_eos:
        argv.append("--ignore-eos")
    return argv


def parse_bench_output(text: str) -> dict[str, float]:
    """Throughput numbers from vllm bench serve's result block (input tok/s is derived)."""
    out: dict[str, float] = {}
    for key, pattern in _PATTERNS.items():
        match = re.search(pattern, text, flags=re.IGNORECASE | re.MULTILINE)
        if match:
            out[key] = float(match.group(1))
    if "requests_per_s" not in out:
        raise ValueError("no 'Request throughput' line in vllm bench serve output")
    if "total_tokens_per_s" in out and "output_tokens_per_s" in out:
        out["input_tokens_per_s"] = out["total_tokens_per_s"] - out["output_tokens_per_s"]
    return out


def run_bench_serve(argv: list[str], timeout_s: float = 1800.0) -> dict[str, float]:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:3])} exited {proc.returncode}: "
                           f"{(proc.stderr or proc.stdout)[-2000:]}")
    return parse_bench_output(proc.stdout)


def compare_throughput(ours: dict[str, float], bench: dict[str, float],
                       tolerance: float = 0.10) -> dict[str, Any]:
    """Relative difference |ours - bench| / bench per throughput metric both tools report."""
    metrics = {}
    for key in COMPARED:
        if key not in bench or key not in ours or bench[key] <= 0:
            continue
        rel = abs(ours[key] - bench[key]) / bench[key]
        metrics[key] = {"ours": ours[key], "bench": bench[key], "rel_diff": rel,
                        "within": rel <= tolerance}
    return {"tolerance": tolerance, "metrics": metrics,
            "within_tolerance": bool(metrics) and all(m["within"] for m in metrics.values())}


def format_comparison(check: dict[str, Any]) -> str:
    lines = [f"cross-check vs vllm bench serve (tolerance {100 * check['tolerance']:.0f} %)"]
    for key, m in check["metrics"].items():
        lines.append(f"  {key:<22} ours {m['ours']:>10.2f}  bench {m['bench']:>10.2f}  "
                     f"diff {100 * m['rel_diff']:5.1f} %  {'ok' if m['within'] else 'MISMATCH'}")
    return "\n".join(lines)
