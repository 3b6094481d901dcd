"""Every headline ratio against its physical limit on this machine, measured in one run.

    python -m loadtest.limits --out-dir docs/results/limits          # resumable: one JSON per server
    python -m loadtest.limits --out-dir docs/results/limits --report-only

One server at a time (stock vLLM first, then each policy), each measured the same way:
- prefill: time to first token of a lone `--input-len` prompt (max_tokens 1, `--repeats`
  distinct prompts, and the batch-1 request's, median); the first one's kv_stats `footprint`
  (no decode step) is the fraction of
  full attention's causal keys the policy's queries visit, by the paper's definition;
- decode, batch 1: one `--input-len` prompt generating `--output-len` tokens, TPOT;
- decode, batch B: B distinct `--batch-input-len` prompts sent at once, `--output-len` tokens
  each; the step time is the median inter-token gap while all B requests decode (after the
  last first token, before the first request ends), output tok/s the tokens streamed in that
  window over its length.
Stock also runs the components: prefill at several lengths (t(n) = a n + b n^2: the linear
share is weights and MLPs, the quadratic one attention) and both decode batches at a
`--short-input-len` prompt (so TPOT(KV bytes) = c0 + k x bytes separates the fixed cost from
the per-KV-byte cost), and a one-thread memory-read probe (no server running) prices the
weights' bytes inside c0.

Limits (the best the policy can do on this machine given what it keeps):
- prefill: a n + b n^2 x footprint over a n + b n^2 (stock's fit at n = input-len);
- decode: stock's c0 + k x (the KV bytes the policy's requests hold at their last step,
  `kv_bytes_end`), over stock's TPOT at its own bytes: what a step costs when it reads exactly
  the bytes the policy keeps, at stock's per-byte cost.
Ratios > 1 are slower than stock; `measured / limit` 1.00 means at the limit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import numpy as np

from vllm_kvevict.launch import STOCK, ServerProcess, server_launch
from loadtest.client import make_http_client, send_request
from loadtest.workloads import Prompt, exact_length_ids

DEFAULT_POLICIES = ["stock", "full", "prulong:0.5", "prulong:0.7", "prulong:0.9",
                    "snapkv:0.7", "pyramidkv:0.7"]
MODEL_NAME = "bench"


def read_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes per second one thread reads (a sum over a buffer far larger than the caches)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32)
        x.sum()
        best = min(_timed(lambda: x.sum()) for _ in range(repeats))
        return x.numel() * 4 / best
    finally:
        torch.set_num_threads(threads)


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def model_bytes(model_dir: str) -> tuple[int, int]:
    """(weight bytes read per decode step in float32, full attention's KV bytes per token)."""
    from safetensors import safe_open
    from transformers import AutoConfig

    numel = 0
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                numel += int(np.prod(st.get_slice(name).get_shape()))
    cfg = AutoConfig.from_pretrained(model_dir)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return numel * 4, cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * 4


async def _send_all(base_url: str, prompts: list[Prompt], timeout_s: float = 3600.0):
    async with make_http_client(timeout_s) as client:
        t0 = time.perf_counter()
        loop = asyncio.get_running_loop()
        results = await asyncio.gather(*(send_request(
            client, base_url, MODEL_NAME, p, t0, loop.time() + timeout_s, timeout_s)
            for p in prompts))
    for r in results:
        if not r.ok:
            raise RuntimeError(f"request {r.index} {r.outcome}: {r.error_type} {r.error}")
    return results


def batch_window(results) -> dict:
    """Step time and output throughput while every request of the batch decodes."""
    times = []
    for r in results:
        first = r.start_s + r.ttft_s
        times.append(list(first + np.cumsum([0.0] + r.itl_s)))
    lo = max(t[0] for t in times)
    hi = min(t[-1] for t in times)
    gaps, tokens = [], 0
    for t in times:
        inside = [x for x in t if lo < x <= hi]
        tokens += len(inside)
        gaps += list(np.diff([x for x in t if lo <= x <= hi]))
    if hi <= lo or not gaps:
        raise RuntimeError("the batch never decoded all at once: the pool is too small "
                           "or the prompts too long for --batch")
    return {"step_s": float(np.median(gaps)), "out_tok_s": tokens / (hi - lo),
            "window_s": hi - lo, "window_tokens": tokens,
            "run_out_tok_s": sum(r.output_tokens for r in results) / (
                max(r.start_s + r.e2e_s for r in results) - min(r.start_s for r in results))}


def prompts_of(tok, rng, n: int, length: int, output_len: int, kind: str) -> list[Prompt]:
    return [Prompt(i, kind, exact_length_ids(tok, length, rng), output_len, "")
            for i in range(n)]


def launch(text: str, args, model: str, port: int, log: Path) -> ServerProcess:
    """The benchmark server of `text`: a policy (`launch.parse_policy`) or stock, with `@bN`
    for `--block-size N` (e.g. `prulong:0.7@b64`: the bundled masks' 64-token sink in whole
    blocks) and `fM` after it for `--kv-full-block-size M` (`prulong:0.7@b64f128`); eager,
    float32, `args`' pool, step budget, context and reserved CPUs."""
    policy, _, blocks = text.partition("@b")
    block, _, full = blocks.partition("f")
    argv, env = server_launch(
        model, policy, kv_cache_bytes=args.kv_cache_memory_bytes, max_batched_tokens=args.chunk,
        port=port, eager=True,
        extra_args=["--dtype", "float32", "--served-model-name", MODEL_NAME,
                    "--max-model-len", str(args.max_model_len),
                    *(["--block-size", block] if block else []),
                    *(["--kv-full-block-size", full] if full else [])])
    env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = args.reserved_cpus
    log.parent.mkdir(parents=True, exist_ok=True)
    return ServerProcess(argv, log, env=env)


def line_through(xs, ys) -> tuple[float, float]:
    """(c0, k) of the line y = c0 + k x through the two points: a decode step's fixed cost and
    its cost per KV byte, from stock at a short and a long context."""
    k = (ys[1] - ys[0]) / (xs[1] - xs[0])
    return ys[0] - k * xs[0], k


def measure_server(text: str, args, model: str, tok, seed: int) -> dict:
    """`text`: as `launch`'s."""
    stock = text.partition("@b")[0] == STOCK
    base = f"http://127.0.0.1:{args.port}"
    rng = np.random.default_rng(seed)  # the same prompts for every server
    out: dict = {"policy": text}
    log = args.out_dir / "logs" / f"server_{text.replace(':', '-')}.log"
    with launch(text, args, model, args.port, log) as server:
        out["ready_s"] = server.wait_healthy(base)
        run = lambda ps: asyncio.run(_send_all(base, ps))  # noqa: E731
        run(prompts_of(tok, rng, 1, 64, 4, "warmup"))
        pre = [run([p])[0] for p in prompts_of(tok, rng, args.repeats, args.input_len, 1, "prefill")]
        out["prefill_footprint"] = (pre[0].kv_stats or {}).get("footprint")
        b1 = run(prompts_of(tok, rng, 1, args.input_len, args.output_len, "b1"))[0]
        # the batch-1 request's prefill is one more sample (its prompt is as long)
        out["prefill_runs"] = [r.ttft_s for r in pre] + [b1.ttft_s]
        out["prefill_s"] = statistics.median(out["prefill_runs"])
        out["b1_tpot_s"] = float(np.median(b1.itl_s))
        out["b1_kv_bytes_end"] = (b1.kv_stats or {}).get("kv_bytes_end")
        out["block_size"] = (b1.kv_stats or {}).get("block_size")
        bb = run(prompts_of(tok, rng, args.batch, args.batch_input_len, args.output_len, "batch"))
        out["batch"] = batch_window(bb)
        out["batch_kv_bytes_end"] = ([r.kv_stats.get("kv_bytes_end") for r in bb]
                                     if all(r.kv_stats for r in bb) else None)
        out["batch_preemptions"] = [(r.kv_stats or {}).get("preemptions") for r in bb]
        if stock:
            out["prefill_curve"] = {}
            for n in args.curve_lengths:
                r = run(prompts_of(tok, rng, 1, n, 1, "curve"))[0]
                out["prefill_curve"][str(n)] = r.ttft_s
            s1 = run(prompts_of(tok, rng, 1, args.short_input_len, args.output_len, "short"))[0]
            out["short_b1_tpot_s"] = float(np.median(s1.itl_s))
            sb = run(prompts_of(tok, rng, args.batch, args.short_input_len, args.output_len,
                                "short-batch"))
            out["short_batch"] = batch_window(sb)
    return out


def full_bytes(tokens: int, block: int, per_token: int) -> int:
    return -(-tokens // block) * block * per_token


def analyse(rows: dict, probe: dict, args) -> tuple[list[str], dict]:
    s = rows["stock"]
    block = next((r["block_size"] for r in rows.values() if r.get("block_size")), 128)
    per_tok, wbytes, bw = probe["kv_bytes_per_token"], probe["weight_bytes"], probe["read_Bps"]
    # prefill: t(n) = a n + b n^2 through stock's curve and its input-len median
    pts = {int(k): v for k, v in s["prefill_curve"].items()}
    pts[args.input_len] = s["prefill_s"]
    n = np.array(sorted(pts), dtype=float)
    t = np.array([pts[int(x)] for x in n])
    (a, b), *_ = np.linalg.lstsq(np.stack([n, n * n], 1), t, rcond=None)
    N = args.input_len
    lin, quad = a * N, b * N * N
    # decode: TPOT = c0 + k x bytes at batch 1 and batch B, from stock's short and long runs
    end1, endB = N + args.output_len, args.batch_input_len + args.output_len
    short_end = args.short_input_len + args.output_len
    x1 = [full_bytes(short_end, block, per_tok), full_bytes(end1, block, per_tok)]
    y1 = [s["short_b1_tpot_s"], s["b1_tpot_s"]]
    xB = [args.batch * full_bytes(short_end, block, per_tok),
          args.batch * full_bytes(endB, block, per_tok)]
    yB = [s["short_batch"]["step_s"], s["batch"]["step_s"]]
    c01, k1 = line_through(x1, y1)
    c0B, kB = line_through(xB, yB)
    model = {"prefill_a_s_per_token": a, "prefill_b_s_per_token2": b,
             "attention_share_at_input_len": quad / (lin + quad),
             "b1_c0_s": c01, "b1_s_per_kv_byte": k1, "batch_c0_s": c0B,
             "batch_s_per_kv_byte": kB, "weights_read_s": wbytes / bw,
             "b1_overhead_s": c01 - wbytes / bw,
             "kv_read_Bps_b1": 1 / k1 if k1 > 0 else None, **probe}
    lines = [
        f"Stock vLLM's components on this machine (one run, {time.strftime('%Y-%m-%d')}):", "",
        f"- prefill of n tokens in {args.chunk}-token steps: t(n) = {a * 1e3:.3f} ms x n + "
        f"{b * 1e6:.4f} us x n^2; at n = {N} attention (the n^2 term) is "
        f"{quad / (lin + quad):.0%} of {lin + quad:.1f} s (measured {s['prefill_s']:.1f} s)",
        f"- decode, batch 1: TPOT = {c01 * 1e3:.1f} ms + {k1 * 1e12:.0f} ms per GB of KV "
        f"(a {N}-token context holds {x1[1] / 1e9:.2f} GB); the fixed {c01 * 1e3:.1f} ms hold "
        f"{wbytes / bw * 1e3:.1f} ms of reading the {wbytes / 1e9:.2f} GB of float32 weights at "
        f"{bw / 1e9:.1f} GB/s (one thread, `read_Bps`) and {(c01 - wbytes / bw) * 1e3:.1f} ms of "
        f"everything else (Python, scheduling, sampling, kernel launches); KV is read at "
        f"{(1 / k1) / 1e9 if k1 > 0 else float('nan'):.1f} GB/s",
        f"- decode, batch {args.batch}: step = {c0B * 1e3:.1f} ms + {kB * 1e12:.0f} ms per "
        f"GB of KV ({args.batch} x {args.batch_input_len}-token contexts hold "
        f"{xB[1] / 1e9:.2f} GB)", "",
        f"| policy | prefill {N} x stock | limit | meas./limit | TPOT b1 x stock | limit | "
        f"meas./limit | step b{args.batch} x stock | limit | meas./limit | out tok/s b{args.batch} "
        f"x stock | x full |", "|---|" + "---|" * 11]
    table = {}
    full = rows.get("full")
    for name, r in rows.items():
        fp = r.get("prefill_footprint") if name != "stock" else 1.0
        pre = r["prefill_s"] / s["prefill_s"]
        pre_lim = (lin + quad * fp) / (lin + quad) if fp is not None else None
        bytes1 = r.get("b1_kv_bytes_end") if name != "stock" else x1[1]
        bytesB = (sum(r["batch_kv_bytes_end"]) if r.get("batch_kv_bytes_end") else None) \
            if name != "stock" else xB[1]
        d1 = r["b1_tpot_s"] / s["b1_tpot_s"]
        d1_lim = (c01 + k1 * bytes1) / s["b1_tpot_s"] if bytes1 is not None else None
        dB = r["batch"]["step_s"] / s["batch"]["step_s"]
        dB_lim = (c0B + kB * bytesB) / s["batch"]["step_s"] if bytesB is not None else None
        thr = r["batch"]["out_tok_s"] / s["batch"]["out_tok_s"]
        thr_full = r["batch"]["out_tok_s"] / full["batch"]["out_tok_s"] if full else None
        table[name] = {"prefill": pre, "prefill_limit": pre_lim, "b1": d1, "b1_limit": d1_lim,
                       "batch": dB, "batch_limit": dB_lim, "out_tok_s": thr,
                       "out_tok_s_vs_full": thr_full, "prefill_footprint": fp,
                       "b1_kv_bytes_end": bytes1, "batch_kv_bytes_end": bytesB}
        f = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
        lines.append(
            f"| {name} | {pre:.2f} | {f(pre_lim)} | {f(pre / pre_lim if pre_lim else None)} | "
            f"{d1:.2f} | {f(d1_lim)} | {f(d1 / d1_lim if d1_lim else None)} | {dB:.2f} | "
            f"{f(dB_lim)} | {f(dB / dB_lim if dB_lim else None)} | {thr:.2f} | {f(thr_full)} |")
    # Load test (`docs/results/loadtest`: 6,500-token prompts, 64 generated tokens each): its
    # time is mostly prefill, whose share of the throughput gain is at most full's prefill
    # time over the policy's prefill limit (at this run's input length); the decodes gain
    # beyond it where more requests at once batch them.
    bound = {name: 1 / t["prefill_limit"] for name, t in table.items()
             if name not in ("stock", "full") and t["prefill_limit"]}
    lines += ["", "Under load (`docs/results/loadtest`: 6,500-token prompts, 64 generated, "
              "mostly prefill): token throughput x full from prefill alone at most 1 / the "
              f"prefill limit at {N} tokens: " + ", ".join(f"{n} {v:.2f}x"
                                                        for n, v in bound.items())
              + " (more requests at once batch the decodes: a load can pass it)"]
    return lines, {"model": model, "table": table, "load_throughput_limit_x_full": bound}


def plot(table: dict, path: Path, batch: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in table if n != "stock"]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4), sharey=True)
    for ax, (key, title) in zip(axes, [("prefill", "prefill time"), ("b1", "decode TPOT, batch 1"),
                                      ("batch", f"decode step, batch {batch}")]):
        x = np.arange(len(names))
        ax.bar(x - 0.2, [table[n][key] for n in names], 0.4, label="measured")
        ax.bar(x + 0.2, [table[n][key + "_limit"] or 0 for n in names], 0.4, label="limit")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(x, names, rotation=30, ha="right")
        ax.set_title(f"{title} (x stock vLLM)")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policies", nargs="+", default=DEFAULT_POLICIES)
    ap.add_argument("--input-len", type=int, default=7000)
    ap.add_argument("--batch-input-len", type=int, default=4000)
    ap.add_argument("--short-input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=1,
                    help="prefill-only requests (the batch-1 request adds one prefill sample)")
    ap.add_argument("--curve-lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=3 << 30)
    ap.add_argument("--port", type=int, default=8126)
    ap.add_argument("--reserved-cpus", default="1")
    ap.add_argument("--out-dir", type=Path, default=Path("docs/results/limits"))
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("--fresh", action="store_true", help="re-measure servers already on disk")
    args = ap.parse_args()
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from vllm_kvevict.model import ensure_bundled_model

    model = str(ensure_bundled_model())
    raw = args.out_dir / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    probe_path = raw / "probe.json"
    if not probe_path.exists() or (args.fresh and not args.report_only):
        wbytes, per_tok = model_bytes(model)
        probe_path.write_text(json.dumps({"read_Bps": read_bandwidth(), "weight_bytes": wbytes,
                                          "kv_bytes_per_token": per_tok}))
    probe = json.loads(probe_path.read_text())
    if not args.report_only:
        tok = AutoTokenizer.from_pretrained(model)
        for text in tqdm(args.policies, desc="servers"):
            path = raw / f"{text.replace(':', '-')}.json"
            if path.exists() and not args.fresh:
                continue
            path.write_text(json.dumps(measure_server(text, args, model, tok, seed=0), indent=1))
    rows = {}
    for text in args.policies:
        path = raw / f"{text.replace(':', '-')}.json"
        if path.exists():
            rows[text] = json.loads(path.read_text())
    lines, result = analyse(rows, probe, args)
    head = [f"`python -m loadtest.limits --input-len {args.input_len} --batch-input-len "
            f"{args.batch_input_len} --output-len {args.output_len} --batch {args.batch} "
            f"--chunk {args.chunk}` (eager, float32, {args.kv_cache_memory_bytes >> 20} MiB pool, "
            f"VLLM_CPU_NUM_OF_RESERVED_CPU={args.reserved_cpus}, one server at a time)", ""]
    (args.out_dir / "summary.md").write_text("\n".join(head + lines) + "\n")
    (args.out_dir / "results.json").write_text(json.dumps(result, indent=1))
    plot(result["table"], args.out_dir / "limits.png", args.batch)
    print("\n".join(head + lines))


if __name__ == "__main__":
    main()
