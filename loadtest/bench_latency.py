"""Prefill time and decode TPOT of one long prompt, per policy, as ratios to stock vLLM run on
the same machine in the same invocation.

    python -m loadtest.bench_latency --input-len 7000 --output-len 64 --repeats 3 \\
        --policies stock full prulong:0.7 pyramidkv:0.7:patched --out-dir docs/results/latency

`stock` is vLLM with our plugin not loaded (VLLM_PLUGINS names none of ours). Every server
gets VLLM_CPU_NUM_OF_RESERVED_CPU (default 1): vLLM's CPU worker reserves one core more when a
KV connector is configured (ours carries kv_stats), which on a 2-core machine silently changes
the worker from 1 to 2 OpenMP threads; pinning the reservation keeps the comparison fair. Each policy gets
its own server, one request at a time (after one warm-up request); prefill time is measured as
time to first token of a streamed request (its prompt fits one request's chunked prefill), TPOT
as (end - first token) / (tokens - 1). Median over --repeats. `ready s` is the time from
starting `vllm serve` to a healthy /health (with --compiled: vLLM's compile mode instead of
--enforce-eager; vLLM caches compiled graphs under ~/.cache/vllm, so a second start is warm).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import httpx
import numpy as np

from vllm_kvevict.launch import ServerProcess, server_launch
from loadtest.workloads import exact_length_ids

SERVE_EXTRA = ["--dtype", "float32", "--served-model-name", "bench", "--max-model-len", "8192"]


def timed_request(base_url: str, ids: list[int], output_len: int) -> tuple[float, float]:
    body = {"model": "bench", "prompt": ids, "max_tokens": output_len, "temperature": 0,
            "ignore_eos": True, "stream": True}
    start = time.perf_counter()
    first, tokens = None, 0
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=3600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                tokens += 1
                if first is None:
                    first = time.perf_counter()
    end = time.perf_counter()
    return first - start, (end - first) / max(tokens - 1, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policies", nargs="+",
                    default=["stock", "full", "prulong:0.7", "pyramidkv:0.7:patched"])
    ap.add_argument("--input-len", type=int, default=7000)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=1 << 30)
    ap.add_argument("--port", type=int, default=8124)
    ap.add_argument("--reserved-cpus", default="1",
                    help="VLLM_CPU_NUM_OF_RESERVED_CPU for every server ('' = vLLM's choice)")
    ap.add_argument("--compiled", action="store_true",
                    help="serve in vLLM's compile mode (no --enforce-eager)")
    ap.add_argument("--out-dir", type=Path, default=Path("docs/results/latency"))
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from vllm_kvevict.model import ensure_bundled_model

    model = str(ensure_bundled_model())
    tok = AutoTokenizer.from_pretrained(model)
    rng = np.random.default_rng(0)
    prompts = [exact_length_ids(tok, args.input_len, rng) for _ in range(args.repeats + 1)]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    base_url = f"http://127.0.0.1:{args.port}"
    rows = []
    for text in args.policies:
        argv, env = server_launch(model, text, kv_cache_bytes=args.kv_cache_memory_bytes,
                                  max_batched_tokens=args.chunk, port=args.port,
                                  extra_args=list(SERVE_EXTRA), eager=not args.compiled)
        if args.reserved_cpus:
            env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = args.reserved_cpus
        with ServerProcess(argv, args.out_dir / f"server_{text.replace(':', '-')}.log",
                           env=env) as server:
            ready = server.wait_healthy(base_url)
            timed_request(base_url, prompts[0], 4)  # warm-up
            runs = [timed_request(base_url, p, args.output_len) for p in prompts[1:]]
        prefill = statistics.median(r[0] for r in runs)
        tpot = statistics.median(r[1] for r in runs)
        rows.append({"policy": text, "ready_s": ready, "prefill_s": prefill, "tpot_s": tpot,
                     "runs": runs})
        print(json.dumps(rows[-1]))
    base = next((r for r in rows if r["policy"] == "stock"), rows[0])
    lines = [f"`python -m loadtest.bench_latency --input-len {args.input_len} --output-len "
             f"{args.output_len} --repeats {args.repeats} --chunk {args.chunk} "
             f"--reserved-cpus '{args.reserved_cpus}'{' --compiled' if args.compiled else ''}`",
             "", "| policy | ready s | prefill s (TTFT) | x stock | decode TPOT ms | x stock |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['policy']} | {r['ready_s']:.0f} | {r['prefill_s']:.2f} | "
                     f"{r['prefill_s'] / base['prefill_s']:.2f} | {r['tpot_s'] * 1000:.0f} | "
                     f"{r['tpot_s'] / base['tpot_s']:.2f} |")
    if len(set(args.policies)) < len(args.policies):
        # a policy named more than once (e.g. `stock full stock full`: alternating servers, so
        # drift of the machine hits both): every run of its servers pooled, median
        pooled = {}
        for r in rows:
            pooled.setdefault(r["policy"], []).extend(r["runs"])
        med = {p: (statistics.median(x[0] for x in runs), statistics.median(x[1] for x in runs))
               for p, runs in pooled.items()}
        b = med.get("stock", next(iter(med.values())))
        lines += ["", "Pooled over rounds (median of every run):", "",
                  "| policy | servers | runs | prefill s | x stock | decode TPOT ms | x stock |",
                  "|---|---|---|---|---|---|---|"]
        for p, (pre, tpot) in med.items():
            lines.append(f"| {p} | {args.policies.count(p)} | {len(pooled[p])} | {pre:.2f} | "
                         f"{pre / b[0]:.3f} | {tpot * 1000:.1f} | {tpot / b[1]:.3f} |")
    (args.out_dir / "summary.md").write_text("\n".join(lines) + "\n")
    (args.out_dir / "results.json").write_text(json.dumps(rows, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
