"""Start-up time of `vllm serve`: stock vLLM against the plugin, one server at a time, same run.

    python -m loadtest.startup --variants stock full prulong --repeats 3 [--compiled]

Readiness = seconds from launching `vllm serve` (bundled model, float32, eager unless
`--compiled`, 512 MiB pool) to its first HTTP 200 on /health. `stock` runs with our plugin not
loaded (VLLM_PLUGINS names none of ours); the others with `--kv-policy <variant>`. The variants
alternate within each repeat (stock, full, prulong, stock, ...) so that drift on this shared
machine hits them alike; the table gives medians and each variant's ratio to stock. Every
server gets VLLM_CPU_NUM_OF_RESERVED_CPU=1 (as the load tests: vLLM reserves a core more when
a KV connector is configured, ours carries kv_stats). vLLM's own phase timings are read from
each log (engine init: profile, KV-cache creation and warm-up).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

from vllm_kvevict.launch import STOCK, STOCK_ENV, VLLM

PHASES = {  # vLLM's own log lines -> seconds (the last match in a log)
    "weights": re.compile(r"Loading weights took ([\d.]+) seconds"),
    "engine_init": re.compile(r"init engine \(profile, create kv cache, warmup model\) took "
                              r"([\d.]+) s"),
}


def serve_argv(model: str, variant: str, port: int, compiled: bool) -> list[str]:
    from vllm_kvevict.launch import policy_flags

    argv = [VLLM, "serve", model, "--served-model-name",
            "m", "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
            "--max-model-len", "8192", "--kv-cache-memory-bytes", str(512 << 20)]
    argv += [] if compiled else ["--enforce-eager"]
    return argv + ([] if variant == "stock" else policy_flags({"policy": variant}))


def time_start(argv: list[str], env: dict, log: Path, port: int) -> dict:
    import httpx

    from vllm_kvevict.launch import ServerProcess

    t0 = time.monotonic()
    with ServerProcess(argv, log, env) as server:
        server.wait_healthy(f"http://127.0.0.1:{port}", timeout_s=900, poll_s=0.1)
        ready = time.monotonic() - t0
        with httpx.Client(trust_env=False) as client:  # it serves, too
            r = client.post(f"http://127.0.0.1:{port}/v1/completions",
                            json={"model": "m", "prompt": "Hello", "max_tokens": 2}, timeout=300)
            r.raise_for_status()
    text = log.read_text(errors="replace")
    phases = {k: float(m[-1]) for k, rx in PHASES.items() if (m := rx.findall(text))}
    return {"ready_s": ready, **phases}


def main(argv=None) -> int:
    from vllm_kvevict.model import ensure_bundled_model

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", nargs="+", default=["stock", "full", "prulong"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--compiled", action="store_true", help="without --enforce-eager")
    p.add_argument("--port", type=int, default=8730)
    p.add_argument("--out", type=Path, default=None, help="JSON of every start")
    args = p.parse_args(argv)
    model = str(ensure_bundled_model())
    runs: list[dict] = []
    for i in range(args.repeats):
        for variant in args.variants:
            env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1", **(STOCK_ENV if variant == STOCK else {})}
            log = Path(f"/tmp/startup_{variant}_{i}.log")
            run = {"variant": variant, "repeat": i,
                   **time_start(serve_argv(model, variant, args.port, args.compiled), env, log,
                                args.port)}
            runs.append(run)
            print(json.dumps(run), flush=True)
    if args.out:
        args.out.write_text(json.dumps(runs, indent=1))
    med = {v: {k: statistics.median(r[k] for r in runs if r["variant"] == v and k in r)
               for k in ("ready_s", *PHASES) if any(k in r for r in runs if r["variant"] == v)}
           for v in args.variants}
    base = med.get("stock", {}).get("ready_s")
    mode = "compiled" if args.compiled else "eager"
    print(f"\n| variant ({mode}) | ready (median of {args.repeats}) | vs stock | weights | "
          f"engine init |")
    print("|---|---|---|---|---|")
    for v, m in med.items():
        ratio = f"{m['ready_s'] / base:.2f}x" if base else "-"
        print(f"| {v} | {m['ready_s']:.1f} s | {ratio} | {m.get('weights', float('nan')):.2f} s"
              f" | {m.get('engine_init', float('nan')):.1f} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
