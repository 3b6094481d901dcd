"""The longest context each policy serves in one fixed KV pool, against full attention.

    python -m loadtest.longest_context --pool-mib 128 --out-dir docs/results/longest-context

Each policy's server starts with vLLM's `--max-model-len -1` (auto-fit: the longest context for
which one request's worst case fits the pool, by the specs' `max_memory_usage_bytes`; for
token eviction with a decode budget that is the policy's own worst case,
`ledger.worst_case_by_length`), then answers one prompt that fills that context
(`--output-len` generated tokens, EOS ignored). The table gives the auto-fitted length, its
ratio to full attention's, and what the answered request held (kv_stats). Resumable: one JSON
per policy under `raw/`. One server at a time.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import httpx
import numpy as np

from vllm_kvevict.launch import ServerProcess, server_launch
from loadtest.workloads import exact_length_ids

DEFAULT_POLICIES = ["full", "prulong:0.7", "snapkv:0.7", "snapkv:0.7:patched:d256",
                    "pyramidkv:0.7:patched:d256"]


def measure(text: str, args, model: str, tok) -> dict:
    argv, env = server_launch(model, text, kv_cache_bytes=args.pool_mib << 20,
                              max_batched_tokens=args.chunk, port=args.port, eager=True,
                              extra_args=["--dtype", "float32", "--served-model-name", "bench",
                                          "--max-model-len", "-1"])
    env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "1"
    base = f"http://127.0.0.1:{args.port}"
    log = args.out_dir / "logs" / f"server_{text.replace(':', '-')}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with ServerProcess(argv, log, env=env) as server:
        server.wait_healthy(base)
        models = httpx.get(base + "/v1/models", timeout=30).json()["data"]
        longest = int(models[0]["max_model_len"])
        ids = exact_length_ids(tok, longest - args.output_len, np.random.default_rng(0))
        r = httpx.post(base + "/v1/completions", timeout=3600, json={
            "model": "bench", "prompt": ids, "max_tokens": args.output_len, "temperature": 0,
            "ignore_eos": True})
        body = r.json()
    stats = body.get("kv_stats") or {}
    return {"policy": text, "max_model_len": longest, "status": r.status_code,
            "prompt_tokens": len(ids),
            "completion_tokens": (body.get("usage") or {}).get("completion_tokens"),
            "kv_bytes_peak": stats.get("kv_bytes_peak"),
            "full_kv_bytes_peak": stats.get("full_kv_bytes_peak"),
            "preemptions": stats.get("preemptions")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policies", nargs="+", default=DEFAULT_POLICIES)
    ap.add_argument("--pool-mib", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--port", type=int, default=8127)
    ap.add_argument("--out-dir", type=Path, default=Path("docs/results/longest-context"))
    args = ap.parse_args()
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from vllm_kvevict.model import ensure_bundled_model

    model = str(ensure_bundled_model())
    tok = AutoTokenizer.from_pretrained(model)
    raw = args.out_dir / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    rows = []
    for text in tqdm(args.policies, desc="servers"):
        path = raw / f"{text.replace(':', '-')}.json"
        if not path.exists():
            path.write_text(json.dumps(measure(text, args, model, tok), indent=1))
        rows.append(json.loads(path.read_text()))
    full = next((r for r in rows if r["policy"] in ("full", "stock")), rows[0])
    mib = lambda b: "-" if b is None else f"{b / 2**20:.0f}"  # noqa: E731
    lines = [f"`python -m loadtest.longest_context --pool-mib {args.pool_mib} --chunk "
             f"{args.chunk} --output-len {args.output_len}` (bundled SmolLM2-135M, float32, "
             f"eager, vLLM's `--max-model-len -1` auto-fit; the model's own limit is 8192)", "",
             "| policy | longest context (auto-fit) | x full | answered (prompt + generated) | "
             "KV bytes peak MiB | full attention's MiB | preemptions |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        answered = (f"{r['prompt_tokens']} + {r['completion_tokens']}" if r["status"] == 200
                    else f"HTTP {r['status']}")
        lines.append(f"| {r['policy']} | {r['max_model_len']} | "
                     f"{r['max_model_len'] / full['max_model_len']:.2f} | {answered} | "
                     f"{mib(r['kv_bytes_peak'])} | {mib(r['full_kv_bytes_peak'])} | "
                     f"{r['preemptions']} |")
    (args.out_dir / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
