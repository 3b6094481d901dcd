"""Prefill and decode time of the FlexAttention path against the CPU-kernel path and stock vLLM,
one server at a time, same prompt, same run (issue 45's measurement; warm servers: two requests
first).

    python scripts/flex_timing.py --policies full prulong snapkv --stock --out FILE.json

Per (policy, path): prefill = a request with max_tokens 1, decode = (a request with
max_tokens 1 + N) - prefill, per generated token; the median of --repeats runs. `--stock`:
first a server with our plugin not loaded (VLLM_PLUGINS names none of ours), every ratio also
against it. Every server gets VLLM_CPU_NUM_OF_RESERVED_CPU (default 1): vLLM's CPU worker
reserves one core more when a KV connector is configured (ours carries kv_stats), which on a
2-core machine gives the plugin's worker both cores and stock's one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main(argv=None) -> int:
    import httpx
    from transformers import AutoTokenizer

    from vllm_kvevict.launch import VLLM, ServerProcess, policy_flags
    from vllm_kvevict.model import ensure_bundled_model

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policies", nargs="+", default=["full", "prulong"])
    p.add_argument("--paths", nargs="+", default=["cpu", "flex"])
    p.add_argument("--prompt-tokens", type=int, default=4000)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--port", type=int, default=8720)
    p.add_argument("--stock", action="store_true", help="also stock vLLM (plugin not loaded)")
    p.add_argument("--reserved-cpus", default="1",
                   help="VLLM_CPU_NUM_OF_RESERVED_CPU for every server ('' = vLLM's choice)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    model = str(ensure_bundled_model())
    tok = AutoTokenizer.from_pretrained(model)
    text = Path(sys.base_prefix, "lib", "python3.11", "argparse.py").read_text()
    ids = tok(text)["input_ids"]
    while len(ids) < args.prompt_tokens + 200:
        ids += ids
    results = []
    runs = [(policy, path) for policy in args.policies for path in args.paths]
    for policy, path in ([("stock", "cpu")] if args.stock else []) + runs:
        kv = {} if policy == "stock" else {"policy": policy, "attention_backend": path}
        env = {"VLLM_PLUGINS": "no-such-plugin"} if policy == "stock" else {}
        if args.reserved_cpus != "":
            env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = args.reserved_cpus
        argv_ = [VLLM, "serve", model,
                 "--served-model-name", "m", "--host", "127.0.0.1", "--port", str(args.port),
                 "--enforce-eager", "--dtype", "float32", "--max-model-len", "8192",
                 "--seed", "0", "--kv-cache-memory-bytes", str(512 << 20),
                 "--max-num-batched-tokens", str(args.chunk), "--no-enable-prefix-caching",
                 *policy_flags(kv)]
        log = Path(f"/tmp/flex_timing_{policy}_{path}.log")
        with ServerProcess(argv_, log, env) as server:
            base = f"http://127.0.0.1:{args.port}"
            server.wait_healthy(base, timeout_s=600)
            with httpx.Client(base_url=base, timeout=900, trust_env=False) as client:
                def run(prompt, n):
                    t0 = time.perf_counter()
                    r = client.post("/v1/completions", json={
                        "model": "m", "prompt": prompt, "max_tokens": n, "temperature": 0,
                        "ignore_eos": True})
                    r.raise_for_status()
                    return time.perf_counter() - t0

                for w in range(2):  # warm-up: compile every shape a step takes
                    run(ids[w:w + args.prompt_tokens], 1 + args.decode_tokens)
                prefill, total = [], []
                for i in range(args.repeats):
                    prompt = ids[100 + i:100 + i + args.prompt_tokens]
                    prefill.append(run(prompt, 1))
                    total.append(run(prompt, 1 + args.decode_tokens))
        pf = statistics.median(prefill)
        dec = (statistics.median(total) - pf) / args.decode_tokens
        results.append({"policy": policy, "path": path, "prefill_s": pf,
                        "decode_s_per_token": dec})
        print(f"{policy:9s} {path:5s} prefill {pf:7.3f} s  decode {dec * 1e3:7.1f} ms/token",
              flush=True)
    by = {(r["policy"], r["path"]): r for r in results}
    stock = by.get(("stock", "cpu"))
    for policy in args.policies:
        if (policy, "cpu") in by and (policy, "flex") in by:
            c, f = by[policy, "cpu"], by[policy, "flex"]
            print(f"{policy:9s} flex/cpu: prefill {f['prefill_s'] / c['prefill_s']:.2f}x, "
                  f"decode {f['decode_s_per_token'] / c['decode_s_per_token']:.2f}x")
        for path in args.paths if stock else ():
            if (policy, path) in by:
                r = by[policy, path]
                print(f"{policy:9s} {path}/stock: prefill "
                      f"{r['prefill_s'] / stock['prefill_s']:.2f}x, decode "
                      f"{r['decode_s_per_token'] / stock['decode_s_per_token']:.2f}x")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
