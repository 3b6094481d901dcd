"""Capacity curves: what each policy serves against the KV pool's size, stock vLLM beside it.

    python -m loadtest.capacity --policies stock prulong:0.7 snapkv:0.7:patched \
        --input-len 4000 --output-len 64 --requests 8 --pools 1 2 4 8 \
        --out-dir docs/results/capacity          # resumable: one JSON line per point

A point is one server (one policy, one pool) and one burst: `--requests` prompts of
`--input-len` random-word tokens sent at once, `--output-len` greedy tokens each
(`ignore_eos`). The pool is given in full-attention requests: `--pools 1` holds one request of
the burst as stock vLLM keeps it (every layer and KV head, 128-token blocks, plus vLLM's null block), and
`--pools R` (R = `--requests`) holds the whole burst, so nothing waits for memory. Each point
records the requests running at once (vLLM's own gauge, sampled every second: peak and mean),
output throughput over the burst, p50 / p99 of end-to-end latency and TTFT, vLLM's
preemptions, and the KV bytes every request held against full attention's (kv_stats' peaks,
summed), so a curve that stays flat cannot hide a policy that evicted nothing.

The report (`--report-only`, also written after every point): `table-<input-len>.md`,
`capacity-<input-len>.png`
(throughput and requests at once against the pool, a line per policy) and each policy's
crossover: the largest pool at which it serves more output tokens per second than stock (by
more than `NOISE`), i.e. up to which it pays (none: it never does in the measured range).

`--data-parallel-size N` serves each point with N engine cores sharing the same total pool,
N-th each, behind `--api-server-count` API servers (default 1, stock too); points of several
layouts in one directory are separate series ("prulong:0.7 DP2", "prulong:0.7 DP2 2 API"),
each against stock at its own layout, and the report adds each layout against DP 1 (several
API servers: against one at the same DP size) at each pool (`--omp-bind` pins the engines:
"0-1" one engine on both cores, "0|1" one core each).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import numpy as np

from loadtest.client import make_http_client, send_request
from loadtest.limits import MODEL_NAME, model_bytes, prompts_of
from loadtest.metrics import latency_stats_ms
from loadtest.monitors import MetricsSampler
from vllm_kvevict.launch import ServerProcess, server_launch

STOCK_BLOCK = 128  # vLLM's CPU default block size


def full_request_bytes(tokens: int, per_token: int) -> int:
    """Stock vLLM's KV bytes for one request of `tokens` tokens, in 128-token blocks."""
    return -(-tokens // STOCK_BLOCK) * STOCK_BLOCK * per_token


async def burst(base: str, prompts) -> tuple[list, dict, float]:
    """Every prompt at once, vLLM's gauges sampled meanwhile: (results, metrics, wall s)."""
    async with make_http_client(3600.0) as client:
        sampler = MetricsSampler(client, base, interval=1.0)
        t0 = time.perf_counter()
        await sampler.start(t0)
        loop = asyncio.get_running_loop()
        results = await asyncio.gather(*(send_request(
            client, base, MODEL_NAME, p, t0, loop.time() + 3600.0, 3600.0) for p in prompts))
        wall = time.perf_counter() - t0
        await sampler.stop()
    return results, sampler.summary(), wall


def engine_pool_bytes(pool_requests: float, tokens: int, per_token: int, dp: int) -> int:
    """Each engine's `--kv-cache-memory-bytes`: its share of `pool_requests` full-attention
    requests, plus vLLM's null block (every engine has one, holding no request)."""
    return int(pool_requests * full_request_bytes(tokens, per_token) / dp) + STOCK_BLOCK * per_token


def measure(policy: str, pool_requests: float, args, model: str, tok, per_token: int) -> dict:
    """One point: `policy`'s server with a pool of `pool_requests` full-attention requests."""
    tokens = args.input_len + args.output_len
    dp = args.data_parallel_size
    pool = engine_pool_bytes(pool_requests, tokens, per_token, dp)
    port = args.port
    api = args.api_server_count
    parallel = (["--data-parallel-size", str(dp)] if dp > 1 else []) + [
        "--api-server-count", str(api)]
    argv, env = server_launch(
        model, policy, kv_cache_bytes=pool, max_batched_tokens=args.chunk, port=port, eager=True,
        extra_args=["--dtype", "float32", "--served-model-name", MODEL_NAME,
                    "--max-model-len", str(-(-tokens // STOCK_BLOCK) * STOCK_BLOCK),
                    "--max-num-seqs", str(args.requests), *parallel])
    env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = args.reserved_cpus
    if args.omp_bind:
        env["VLLM_CPU_OMP_THREADS_BIND"] = args.omp_bind
    name = (f"{policy.replace(':', '-')}_pool{pool_requests:g}" + (f"_dp{dp}" if dp > 1 else "")
            + (f"_api{api}" if api > 1 else ""))
    log = args.out_dir / "logs" / f"{name}.log"
    base = f"http://127.0.0.1:{port}"
    rng = np.random.default_rng(args.seed)  # the same prompts for every point
    prompts = prompts_of(tok, rng, args.requests, args.input_len, args.output_len, "burst")
    with ServerProcess(argv, log, env=env) as server:
        ready = server.wait_healthy(base)
        asyncio.run(burst(base, prompts_of(tok, np.random.default_rng(1), 1, 32, 2, "warmup")))
        results, gauges, wall = asyncio.run(burst(base, prompts))
    ok = [r for r in results if r.ok]
    stats = [r.kv_stats for r in ok if r.kv_stats]
    held = sum(s["kv_bytes_peak"] for s in stats) if len(stats) == len(ok) else None
    full = sum(s["full_kv_bytes_peak"] for s in stats) if len(stats) == len(ok) else None
    return {
        "policy": policy, "pool_requests": pool_requests, "pool_bytes": pool * dp, "dp": dp,
        "api_servers": api,
        "input_len": args.input_len, "output_len": args.output_len, "requests": args.requests,
        "ok": len(ok), "failed": [f"{r.outcome}: {r.error}" for r in results if not r.ok],
        "ready_s": ready, "wall_s": wall,
        "out_tok_s": sum(r.output_tokens for r in ok) / wall,
        "e2e_ms": latency_stats_ms(r.e2e_s for r in ok),
        "ttft_ms": latency_stats_ms(r.ttft_s for r in ok),
        "running_peak": gauges["running_peak"], "running_mean": gauges["running_mean"],
        "preemptions": gauges["preemptions"],
        "kv_bytes_peak_sum": held, "full_kv_bytes_peak_sum": full,
        "kv_bytes_vs_full": held / full if held and full else None,
    }


def load(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


# a win is more than this over stock: `full` (the plugin evicting nothing) measured 0.96-1.04x
# stock here, points taken ~40 minutes apart (docs/results/capacity/README.md)
NOISE = 0.05


def layout(row: dict) -> tuple[int, int]:
    """(data-parallel size, API servers) of a point (points from before either was recorded
    ran one engine behind one API server)."""
    return row.get("dp", 1), row.get("api_servers", 1)


def series(row: dict) -> str:
    """A point's curve: its policy, and its layout where that is not one engine, one API
    server."""
    dp, api = layout(row)
    return row["policy"] + (f" DP{dp}" if dp > 1 else "") + (f" {api} API" if api > 1 else "")


def stock_of(rows: list[dict]) -> dict:
    """Stock's point at each (pool, layout)."""
    return {(r["pool_requests"], layout(r)): r for r in rows if r["policy"] == "stock"}


def crossover(rows: list[dict], curve: str) -> float | None:
    """The largest measured pool at which `curve` (a `series`) serves more output tokens/s than
    stock at the same layout by more than NOISE."""
    stock = stock_of(rows)
    wins = [r["pool_requests"] for r in rows if series(r) == curve
            and (key := (r["pool_requests"], layout(r))) in stock
            and r["out_tok_s"] > (1 + NOISE) * stock[key]["out_tok_s"]]
    return max(wins) if wins else None


def baseline(dp: int, api: int) -> tuple[int, int]:
    """What a layout is set beside: several API servers beside one at the same DP size, DP N
    beside DP 1."""
    return (dp, 1) if api > 1 else (1, 1)


def dp_lines(rows: list[dict]) -> list[str]:
    """Each layout against its baseline for each policy and pool measured at both: output
    tokens/s, requests at once and p99 end-to-end latency."""
    at = {(r["policy"], r["pool_requests"], layout(r)): r for r in rows}
    pairs = [(at[key], r) for r in rows if layout(r) != (1, 1)
             and (key := (r["policy"], r["pool_requests"], baseline(*layout(r)))) in at]
    if not pairs:
        return []
    lines = ["", "| policy | pool (full requests, in all) | layout (DP / API servers) | out "
             "tok/s before -> after | x | at once (mean) | e2e p99 (s) |",
             "|---|---:|---|---|---:|---|---|"]
    for a, b in sorted(pairs, key=lambda p: (p[1]["policy"], p[1]["pool_requests"],
                                             layout(p[1]))):
        p99 = lambda r: f"{(r['e2e_ms'].get('p99') or 0) / 1e3:.1f}"  # noqa: E731
        shown = lambda r: "{} / {}".format(*layout(r))  # noqa: E731
        lines.append(f"| {a['policy']} | {a['pool_requests']:g} | {shown(a)} -> {shown(b)} | "
                     f"{a['out_tok_s']:.1f} -> {b['out_tok_s']:.1f} | "
                     f"{b['out_tok_s'] / a['out_tok_s']:.2f} | {a['running_mean']:.1f} -> "
                     f"{b['running_mean']:.1f} | {p99(a)} -> {p99(b)} |")
    return lines


def report(rows: list[dict], out_dir: Path, input_len: int) -> str:
    if not rows:
        return "no points yet\n"
    policies = list(dict.fromkeys(series(r) for r in rows))
    stock = stock_of(rows)
    lines = ["| policy | pool (full requests) | ok | at once, peak / mean | out tok/s | x stock "
             "| e2e p50 / p99 (s) | TTFT p50 / p99 (s) | preemptions | KV bytes vs full |",
             "|---|---:|---:|---|---:|---:|---|---|---:|---:|"]
    for r in sorted(rows, key=lambda r: (policies.index(series(r)), r["pool_requests"])):
        base = stock.get((r["pool_requests"], layout(r)))
        ratio = f"{r['out_tok_s'] / base['out_tok_s']:.2f}" if base else "-"
        ms = lambda d: f"{d['p50'] / 1e3:.1f} / {d['p99'] / 1e3:.1f}" if d.get("p50") else "-"  # noqa: E731
        kv = f"{r['kv_bytes_vs_full']:.2f}" if r.get("kv_bytes_vs_full") else "-"
        lines.append(f"| {series(r)} | {r['pool_requests']:g} | {r['ok']}/{r['requests']} | "
                     f"{r['running_peak']:g} / {r['running_mean']:.1f} | {r['out_tok_s']:.1f} | "
                     f"{ratio} | {ms(r['e2e_ms'])} | {ms(r['ttft_ms'])} | {r['preemptions']} | "
                     f"{kv} |")
    lines += ["", "| policy | crossover: pays at pools up to (full requests) |", "|---|---|"]
    largest = max(r["pool_requests"] for r in rows)
    for p in policies:
        if not p.startswith("stock"):
            c = crossover(rows, p)
            said = ("never, in the measured range" if c is None else f"{c:g}" + (
                " (the largest measured: it pays at every pool)" if c == largest else ""))
            lines.append(f"| {p} | {said} |")
    text = "\n".join(lines + dp_lines(rows)) + "\n"
    (out_dir / f"table-{input_len}.md").write_text(text)
    plot(rows, policies, out_dir / f"capacity-{input_len}.png")
    return text


def plot(rows: list[dict], policies: list[str], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for p in policies:
        pts = sorted((r for r in rows if series(r) == p), key=lambda r: r["pool_requests"])
        x = [r["pool_requests"] for r in pts]
        axes[0].plot(x, [r["out_tok_s"] for r in pts], marker="o", label=p)
        axes[1].plot(x, [r["running_mean"] for r in pts], marker="o", label=p)
        axes[2].plot(x, [(r["e2e_ms"].get("p99") or 0) / 1e3 for r in pts], marker="o", label=p)
    for ax, title in zip(axes, ("output tokens/s", "requests at once (mean)",
                                "end-to-end latency p99 (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("KV pool (full-attention requests)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    r0 = rows[0]
    fig.suptitle(f"{r0['requests']} requests at once, {r0['input_len']}-token prompts, "
                 f"{r0['output_len']} tokens each")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policies", nargs="+", default=["stock", "prulong:0.7",
                                                      "snapkv:0.7:patched"])
    ap.add_argument("--pools", type=float, nargs="+", default=[1, 2, 4, 8],
                    help="pool sizes in full-attention requests of the burst")
    ap.add_argument("--input-len", type=int, default=4000)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--port", type=int, default=8140)
    ap.add_argument("--reserved-cpus", default="1")
    ap.add_argument("--data-parallel-size", type=int, default=1,
                    help="engine cores per point, sharing the same total pool")
    ap.add_argument("--api-server-count", type=int, default=1,
                    help="vLLM's API servers per point (stock too)")
    ap.add_argument("--omp-bind", default=None,
                    help="VLLM_CPU_OMP_THREADS_BIND for the server (default: vLLM's auto)")
    ap.add_argument("--out-dir", type=Path, default=Path("docs/results/capacity"))
    ap.add_argument("--report-only", action="store_true")
    args = ap.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / f"points-{args.input_len}.jsonl"
    if not args.report_only:
        from tqdm import tqdm
        from transformers import AutoTokenizer

        from vllm_kvevict.model import ensure_bundled_model

        model = str(ensure_bundled_model())
        tok = AutoTokenizer.from_pretrained(model)
        per_token = model_bytes(model)[1]
        here = (args.data_parallel_size, args.api_server_count)
        done = {(r["policy"], r["pool_requests"], layout(r)) for r in load(path)}
        todo = [(p, k) for k in args.pools for p in args.policies if (p, k, here) not in done]
        for policy, k in tqdm(todo, desc="capacity points", unit="server"):
            row = measure(policy, k, args, model, tok, per_token)
            with path.open("a") as f:
                f.write(json.dumps(row) + "\n")
            report(load(path), args.out_dir, args.input_len)
    print(report(load(path), args.out_dir, args.input_len))


if __name__ == "__main__":
    main()
