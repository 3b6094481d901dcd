"""Real memory at a fixed KV pool: how many long requests run at once, and the measured KV
footprint next to the paper's idealized one, per policy.

    python -m loadtest.bench_memory --policies full prulong:0.7 snapkv:0.7:patched \\
        pyramidkv:0.7:patched --input-len 8000 --output-len 64 --num-requests 16 \\
        --kv-cache-memory-bytes 1610612736 --chunk 1024 --out-dir docs/results/memory

Long generations (decode-time eviction, `--kv-decode-budget`; policy `snapkv:0.7:naive:d256e128`):

    python -m loadtest.bench_memory --policies full snapkv:0.7:naive snapkv:0.7:naive:d256e128 \
        --input-len 256 --output-len 2048 --num-requests 8 --max-model-len 2560 \
        --kv-cache-memory-bytes 251658240 --out-dir docs/results/decode-eviction/load

For each policy it starts `vllm serve` on the bundled model with the same pool, sends
`--num-requests` long prompts at once, samples vLLM's /metrics every 0.25 s (requests running /
waiting, preemptions, pool usage) and keeps every response's `kv_stats`. Written: one JSON per
policy, `summary.md` (the table) and `running.png` (requests running over time).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx
import numpy as np

from loadtest.monitors import parse_vllm_metrics
from vllm_kvevict.launch import ServerProcess, build_server_command, parse_policy
from loadtest.workloads import exact_length_ids

SERVE_EXTRA = ["--dtype", "float32", "--served-model-name", "bench", "--max-num-seqs", "64"]


async def run_policy(base_url: str, prompts: list[list[int]], output_len: int) -> dict:
    timeline, stats, failures = [], [], []
    done = asyncio.Event()

    async def sample(client):
        start = time.monotonic()
        while not done.is_set():
            try:
                text = (await client.get(base_url + "/metrics")).text
                m = parse_vllm_metrics(text)
                m["kvevict_groups"] = text.count("vllm_kvevict_pool_blocks_used{")
                timeline.append({"t": time.monotonic() - start, **m})
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.25)

    async def one(client, ids):
        body = {"model": "bench", "prompt": ids, "max_tokens": output_len, "temperature": 0,
                "ignore_eos": True}
        r = await client.post(base_url + "/v1/completions", json=body, timeout=3600)
        if r.status_code != 200:
            failures.append(r.text[:300])
            return
        stats.append(r.json().get("kv_stats"))

    async with httpx.AsyncClient() as client:
        sampler = asyncio.create_task(sample(client))
        t0 = time.monotonic()
        await asyncio.gather(*(one(client, ids) for ids in prompts))
        elapsed = time.monotonic() - t0
        done.set()
        await sampler
    return {"timeline": timeline, "kv_stats": stats, "failures": failures, "elapsed_s": elapsed}


def summarize(label: str, result: dict) -> dict:
    tl = result["timeline"]
    running = [p.get("running", 0) for p in tl]
    preempt = [p.get("preemptions", 0) for p in tl]
    usage = [p.get("kv_cache_usage", 0) for p in tl]
    stats = [s for s in result["kv_stats"] if s]
    ratio = [s["measured_footprint"] / s["footprint"] for s in stats if s.get("footprint")]
    held = [s["measured_footprint"] / s["footprint_chunk_held"] for s in stats
            if s.get("footprint_chunk_held")]
    mean = lambda xs: statistics.fmean(xs) if xs else float("nan")
    # vLLM's pool usage against the blocks our per-request accounting says are held, both
    # read at the same engine step (vllm_kvevict_pool_usage_vllm)
    diffs, bounds = [], []
    for p in tl:
        if p.get("kvevict_pool_blocks") and "kvevict_blocks_used" in p \
                and "kvevict_vllm_usage" in p:
            used = round(p["kvevict_vllm_usage"] * (p["kvevict_pool_blocks"] - 1))
            diffs.append(used - p["kvevict_blocks_used"])
            bounds.append(max(p.get("running", 0), 1) * max(p.get("kvevict_groups", 1), 1))
    return {
        "policy": label,
        "ok": len(result["kv_stats"]), "failed": len(result["failures"]),
        "max_running": max(running, default=0),
        "preemptions": (max(preempt) - min(preempt)) if preempt else 0,
        "peak_pool_usage": max(usage, default=0),
        "footprint": mean([s["footprint"] for s in stats]),
        "measured_footprint": mean([s["measured_footprint"] for s in stats]),
        "measured_over_idealized": mean(ratio),
        "footprint_chunk_held": mean([s["footprint_chunk_held"] for s in stats
                                      if s.get("footprint_chunk_held")]),
        "measured_over_chunk_held": mean(held),
        "kv_bytes_peak_per_request": mean([s["kv_bytes_peak"] for s in stats]),
        "full_kv_bytes_peak_per_request": mean([s["full_kv_bytes_peak"] for s in stats]),
        "elapsed_s": result["elapsed_s"],
        "output_tokens_per_s": sum(s.get("completion_tokens", 0) for s in stats)
        / result["elapsed_s"] if result["elapsed_s"] else float("nan"),
        "decode_compressions": mean([s.get("decode_compressions", 0) for s in stats]),
        "usage_samples": len(diffs),
        "usage_max_abs_diff_blocks": max((abs(d) for d in diffs), default=None),
        "usage_samples_within_bound": sum(abs(d) <= b for d, b in zip(diffs, bounds)),
    }


def _agreement(row: dict) -> str:
    """'k/n samples, max |diff| d blocks': samples where vLLM's used blocks and the sum of the
    blocks requests hold differ by at most one per running request and KV-cache group."""
    if not row.get("usage_samples"):
        return "–"
    return (f"{row['usage_samples_within_bound']}/{row['usage_samples']} within 1 block/req/"
            f"group, max {row['usage_max_abs_diff_blocks']}")


def load_results(out_dir: Path) -> dict[str, dict]:
    """Every policy JSON in `out_dir`, full first, then in file name order."""
    results = {}
    for path in sorted(out_dir.glob("*.json"), key=lambda p: (p.stem != "full", p.stem)):
        result = json.loads(path.read_text())
        if "kv_stats" in result and "timeline" in result:
            results[result.get("label", path.stem)] = result
    return results


def write_report(results: dict[str, dict], out_dir: Path) -> None:
    rows = [summarize(label, res) for label, res in results.items()]
    base = next((r for r in rows if r["policy"] == "full"), None)
    lines = ["Commands (one per run, as recorded in its JSON):", ""]
    for label, res in results.items():
        lines.append(f"- {label}: `{res.get('command', 'not recorded')}`")
    lines += ["", "| policy | ok | failed | max running | x full | preemptions | peak pool use | "
              "footprint (paper) | footprint, chunk held | measured footprint | measured / "
              "paper | measured / chunk held | KV bytes peak/req | wall s | output tok/s | "
              "decode compressions/req | vLLM usage vs ours |",
              "|" + "---|" * 17]
    for r in rows:
        ratio = (r["max_running"] / base["max_running"]) if base and base["max_running"] else 0
        lines.append(
            f"| {r['policy']} | {r['ok']} | {r['failed']} | {r['max_running']:.0f} | {ratio:.2f} | "
            f"{r['preemptions']:.0f} | {r['peak_pool_usage'] * 100:.0f}% | {r['footprint']:.3f} | "
            f"{r['footprint_chunk_held']:.3f} | {r['measured_footprint']:.3f} | "
            f"{r['measured_over_idealized']:.3f} | {r['measured_over_chunk_held']:.3f} | "
            f"{r['kv_bytes_peak_per_request'] / 2**20:.0f} MiB | {r['elapsed_s']:.0f} | "
            f"{r['output_tokens_per_s']:.1f} | {r['decode_compressions']:.0f} | "
            f"{_agreement(r)} |")
    (out_dir / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, per) = plt.subplots(1, 2, figsize=(13, 4))
    for label, res in results.items():
        tl = res["timeline"]
        ax.plot([p["t"] for p in tl], [p.get("running", 0) for p in tl], label=label)
        # pool share per running request: flat where decode-time eviction bounds a request
        shares = [(p["t"], 100 * p.get("kv_cache_usage", 0) / p["running"]) for p in tl
                  if p.get("running")]
        per.plot([t for t, _ in shares], [v for _, v in shares], label=label)
    ax.set_xlabel("seconds since the burst")
    ax.set_ylabel("requests running")
    ax.set_title("Requests running at once, same KV pool")
    ax.legend()
    per.set_xlabel("seconds since the burst")
    per.set_ylabel("% of the pool per running request")
    per.set_title("KV pool held per running request")
    fig.tight_layout()
    fig.savefig(out_dir / "running.png", dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model dir (default: the bundled model)")
    ap.add_argument("--policies", nargs="+",
                    default=["full", "prulong:0.7", "snapkv:0.7:patched",
                             "pyramidkv:0.7:patched"])
    ap.add_argument("--input-len", type=int, default=8000)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=1536 << 20)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--max-model-len", type=int, default=8192,
                    help="vLLM's --max-model-len (the pool must hold one such request)")
    ap.add_argument("--block-size", type=int, default=None,
                    help="vLLM KV block size in tokens (CPU: a multiple of 32; default vLLM's 128)")
    ap.add_argument("--prefill-step", type=int, default=None,
                    help="vLLM's prefill step (--max-num-batched-tokens) when it differs "
                         "from --chunk: snapkv/pyramidkv still evict once per --chunk tokens "
                         "and streaming/duo/prulong chunk the prompt at multiples of --chunk "
                         "(--kv-eviction-chunk; a step above --chunk lets a chunk run in one "
                         "step beside the decodes sharing the budget); full's chunk is this "
                         "step")
    ap.add_argument("--admission", choices=("reserve", "vllm"), default=None,
                    help="--kv-admission of the evicting policies (default: the plugin's, reserve)")
    ap.add_argument("--no-prefix-caching", action="store_true",
                    help="serve with --no-enable-prefix-caching (vLLM's default is on)")
    ap.add_argument("--attention-backend", choices=("cpu", "flex"), default="cpu",
                    help="--kv-attention-backend of every server (full included)")
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", type=Path, default=Path("docs/results/memory"))
    ap.add_argument("--report-only", action="store_true",
                    help="rebuild summary.md and running.png from the JSONs in --out-dir")
    args = ap.parse_args()
    if args.report_only:
        write_report(load_results(args.out_dir), args.out_dir)
        return
    from transformers import AutoTokenizer

    from vllm_kvevict.model import ensure_bundled_model

    model = args.model or str(ensure_bundled_model())
    tokenizer = AutoTokenizer.from_pretrained(model)
    rng = np.random.default_rng(args.seed)
    prompts = [exact_length_ids(tokenizer, args.input_len, rng) for _ in range(args.num_requests)]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    base_url = f"http://127.0.0.1:{args.port}"
    command = "python -m loadtest.bench_memory " + " ".join(sys.argv[1:])
    serve_extra = ["--max-model-len", str(args.max_model_len)]
    serve_extra += ["--block-size", str(args.block_size)] if args.block_size else []
    serve_extra += ["--no-enable-prefix-caching"] if args.no_prefix_caching else []
    serve_extra += ["--kv-attention-backend", args.attention_backend]
    admission = ["--kv-admission", args.admission] if args.admission else []
    for text in args.policies:
        spec = parse_policy(text)
        decoupled = ["--kv-eviction-chunk", str(args.chunk)] if (
            args.prefill_step and spec.policy != "full" and spec.token_policy is None) else []
        argv = build_server_command(model, spec, kv_cache_bytes=args.kv_cache_memory_bytes,
                                    max_batched_tokens=args.prefill_step or args.chunk,
                                    port=args.port,
                                    extra_args=SERVE_EXTRA + serve_extra + decoupled + (
                                        admission if spec.policy != "full" else []))
        with ServerProcess(argv, args.out_dir / f"server_{spec.slug}.log") as server:
            server.wait_healthy(base_url)
            result = asyncio.run(run_policy(base_url, prompts, args.output_len))
        result = {"label": spec.label, "command": command, **result}
        (args.out_dir / f"{spec.slug}.json").write_text(json.dumps(result, indent=1))
        print(json.dumps(summarize(spec.label, result)))
    write_report(load_results(args.out_dir), args.out_dir)


if __name__ == "__main__":
    main()
