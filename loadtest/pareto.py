"""Does a policy pay on my workload? Accuracy, throughput and output length, one run, stock beside.

    python -m loadtest.pareto --points stock prulong:0.7 snapkv:0.7:patched \\
        --pools 0.25 1 --tasks niah_single niah_multikey passkey --length 2048 \\
        --per-category 4 --out-dir docs/results/pareto        # resumable: a JSON line per point
    python -m loadtest.pareto --prompts my_prompts.jsonl --model /path/to/model ...
    python -m loadtest.pareto --report-only --out-dir docs/results/pareto

A point is one server (a policy text as `launch.parse_policy` reads it, or `stock`: vLLM without
the plugin) at one pool size, and one burst: every prompt sent at once, greedy, each ending at
its own EOS or budget. `--pools F` gives the pool as a fraction of the burst's full-attention
KV (every prompt and its budget in 128-token blocks, plus vLLM's null block): below 1 the pool
is the bottleneck and a policy that frees memory can run more requests at once; at 1 or above
it is not, and the point shows what eviction costs when memory is ample.

The prompts: the evaluation's generated tasks (`vllm_kvevict.evaluation.tasks`, scored by their
own scorers), or `--prompts FILE.jsonl`, one `{"prompt": "...", "answers": ["..."],
"max_tokens": 32}` per line (score 1 when the answer mentions one of `answers`, the
evaluation's recall scorer; without `answers`, throughput only).

Each point records: accuracy (mean score, a 95 % bootstrap interval over the prompts), output
tokens/s and requests at once (peak: vLLM's gauge; mean: vLLM's per-request scheduled-to-last-
token times summed, over the burst's wall time), TTFT / TPOT p50 / p99, the mean
output length, vLLM's preemptions, and the proof that eviction ran: kv_stats' KV bytes held
(each request's peak, summed) against full attention's. The report (`table.md`, `points.json`,
`pareto.png`) puts each point beside stock's at the same pool and flags a policy whose kv_stats
show no byte saved: it is not silently counted as a win.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from loadtest.client import make_http_client, send_request
from loadtest.limits import MODEL_NAME, model_bytes
from loadtest.metrics import latency_stats_ms
from loadtest.monitors import MetricsSampler
from loadtest.workloads import Prompt

STOCK = "stock"
BLOCK = 128  # vLLM's default block size: the pool's unit
CI_LEVEL, BOOTSTRAP = 0.95, 1000


@dataclass(frozen=True)
class Item:
    """One prompt of the burst and how to score its answer."""
    prompt_ids: tuple[int, ...]
    max_tokens: int
    answers: tuple[str, ...] = ()
    scorer: str = "recall"  # a key of the evaluation's SCORERS

    def score(self, text: str) -> float | None:
        from vllm_kvevict.evaluation.tasks import SCORERS

        return SCORERS[self.scorer](text, self.answers) if self.answers else None


def task_items(tok, tasks: list[str], length: int, per_category: int, seed: int) -> list[Item]:
    from vllm_kvevict.evaluation.tasks import TASKS, PromptBuilder, make_examples

    chosen = [t for t in tasks if TASKS[t].choices]
    if chosen:  # (their label restriction is a request field the burst does not send)
        raise SystemExit(f"--tasks: {chosen} restrict generation to labels, not served here; "
                         f"choose among {[t for t in TASKS if not TASKS[t].choices]}")
    return [Item(ex.prompt_ids, ex.max_tokens, ex.answers, ex.scorer)
            for ex in make_examples(PromptBuilder(tok), tasks, [length], per_category, seed)]


def jsonl_items(tok, path: Path, default_max_tokens: int) -> list[Item]:
    items = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if not isinstance(row.get("prompt"), str):
            raise SystemExit(f"--prompts {path}:{n}: each line needs a string \"prompt\"")
        answers = row.get("answers") or ()
        items.append(Item(tuple(tok.encode(row["prompt"])),
                          int(row.get("max_tokens", default_max_tokens)),
                          tuple(answers) if isinstance(answers, list) else (str(answers),)))
    if not items:
        raise SystemExit(f"--prompts {path}: no prompt in the file")
    return items


def items_digest(items: list[Item]) -> str:
    h = hashlib.sha256()
    for it in items:
        h.update(json.dumps([it.prompt_ids, it.max_tokens, it.answers, it.scorer]).encode())
    return h.hexdigest()[:12]


def burst_full_bytes(items: list[Item], per_token: int) -> int:
    """Full attention's KV for the whole burst in BLOCK-token blocks (stock vLLM's holding)."""
    return sum(-(-(len(it.prompt_ids) + it.max_tokens) // BLOCK) for it in items) * BLOCK * per_token


def pool_bytes(fraction: float, items: list[Item], per_token: int) -> int:
    """`--kv-cache-memory-bytes` of a point: the fraction of the burst's full-attention KV, never
    below one request's worst case (vLLM refuses to start under it), plus the null block."""
    one = max(-(-(len(it.prompt_ids) + it.max_tokens) // BLOCK) for it in items) * BLOCK * per_token
    return max(int(fraction * burst_full_bytes(items, per_token)), one) + BLOCK * per_token


def bootstrap_interval(scores: list[float], seed: int = 0) -> tuple[float, float] | None:
    if len(scores) < 2:
        return None
    rng = np.random.default_rng(seed)
    arr = np.asarray(scores, dtype=float)
    means = arr[rng.integers(0, len(arr), (BOOTSTRAP, len(arr)))].mean(axis=1)
    lo, hi = np.percentile(means, [50 * (1 - CI_LEVEL), 50 * (1 + CI_LEVEL)])
    return float(lo), float(hi)


def summarize(point: str, fraction: float, pool: int, items: list[Item], results, texts,
              gauges: dict, wall: float) -> dict:
    """One point's record from its burst's results (`loadtest.client.RequestResult`s, in item
    order) and answers."""
    ok = [i for i, r in enumerate(results) if r.ok]
    scores = [s for i in ok if (s := items[i].score(texts[i])) is not None]
    stats = [results[i].kv_stats for i in ok]
    complete = bool(ok) and all(stats)
    held = sum(s["kv_bytes_peak"] for s in stats) if complete else None
    full = sum(s["full_kv_bytes_peak"] for s in stats) if complete else None
    # without the pool plan's padding: what the heads hold (proof eviction ran even where a
    # short request's reserved pages equal full attention's)
    heads = sum(s["kv_bytes_peak_in_heads"] for s in stats) if complete else None
    tpot = [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in (results[i] for i in ok)
            if r.ttft_s is not None and r.e2e_s is not None and r.output_tokens > 1]
    return {
        "point": point, "pool_fraction": fraction, "pool_bytes": pool, "requests": len(items),
        "ok": len(ok), "failed": [f"{r.outcome}: {r.error}" for r in results if not r.ok],
        "accuracy": float(np.mean(scores)) if scores else None,
        "accuracy_ci": bootstrap_interval(scores), "scores": scores,
        "wall_s": wall, "out_tok_s": sum(results[i].output_tokens for i in ok) / wall,
        # prompt and output: what a prefill-heavy burst (short answers) is bound by
        "tok_s": sum(results[i].input_tokens + results[i].output_tokens for i in ok) / wall,
        "mean_output_tokens": float(np.mean([results[i].output_tokens for i in ok])) if ok
        else None,
        "ttft_ms": latency_stats_ms(results[i].ttft_s for i in ok),
        "tpot_ms": latency_stats_ms(tpot),
        "running_peak": gauges.get("running_peak"),
        # vLLM's per-request scheduled time summed over the burst, divided by its wall time;
        # the gauge's mean over 1 s samples beside it (it read 0.1-0.2 where one request at a
        # time ran for the whole burst: docs/results/pareto/README.md)
        "running_mean": gauges.get("running_time_mean"),
        "running_gauge_mean": gauges.get("running_mean"),
        "scrapes": gauges.get("scrapes"), "scrape_errors": gauges.get("scrape_errors"),
        "preemptions": gauges.get("preemptions"),
        "kv_bytes_peak_sum": held, "full_kv_bytes_peak_sum": full,
        "kv_bytes_vs_full": held / full if held and full else None,
        "kv_bytes_in_heads_sum": heads,
        "kv_heads_vs_full": heads / full if heads and full else None,
    }


async def burst(base: str, items: list[Item]) -> tuple[list, dict, float]:
    """Every prompt at once (greedy, each to its EOS or budget), vLLM's gauges sampled."""
    prompts = [Prompt(i, "pareto", list(it.prompt_ids), it.max_tokens, "")
               for i, it in enumerate(items)]
    async with make_http_client(3600.0) as client:
        sampler = MetricsSampler(client, base, interval=1.0)
        t0 = time.perf_counter()
        await sampler.start(t0)
        loop = asyncio.get_running_loop()
        results = await asyncio.gather(*(send_request(
            client, base, MODEL_NAME, p, t0, loop.time() + 3600.0, 3600.0, ignore_eos=False,
            return_token_ids=True) for p in prompts))
        wall = time.perf_counter() - t0
        await sampler.stop()
    return results, sampler.summary(), wall


def measure(point: str, fraction: float, items: list[Item], args, tok, per_token: int) -> dict:
    """One point: `point`'s server at `fraction` of the burst's full-attention KV."""
    from vllm_kvevict.launch import ServerProcess, server_launch

    pool = pool_bytes(fraction, items, per_token)
    longest = max(len(it.prompt_ids) + it.max_tokens for it in items)
    mask = args.masks.get(point.split(":")[0]) if point != STOCK else None
    argv, env = server_launch(
        args.model, point, kv_cache_bytes=pool, max_batched_tokens=args.chunk, port=args.port,
        eager=not args.compiled, extra_args=[
            "--dtype", args.dtype, "--served-model-name", MODEL_NAME,
            "--max-model-len", str(-(-longest // BLOCK) * BLOCK),
            "--max-num-seqs", str(len(items)), *(["--kv-mask", mask] if mask else []),
            *args.vllm_args])
    env.update(args.env)
    log = args.out_dir / "logs" / f"{point.replace(':', '-').replace('+', '_')}_pool{fraction:g}.log"
    base = f"http://127.0.0.1:{args.port}"
    with ServerProcess(argv, log, env=env) as server:
        server.wait_healthy(base)
        results, gauges, wall = asyncio.run(burst(base, items))
    texts = [tok.decode(r.token_ids, skip_special_tokens=True) for r in results]
    return summarize(point, fraction, pool, items, results, texts, gauges, wall)


# -- the report -----------------------------------------------------------------------------------

def load(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def frontier(rows: list[dict]) -> list[dict]:
    """The points no other beats on both throughput and accuracy (ties kept), by throughput."""
    scored = [r for r in rows if r["accuracy"] is not None]
    best = [r for r in scored if not any(
        o["out_tok_s"] >= r["out_tok_s"] and o["accuracy"] >= r["accuracy"]
        and (o["out_tok_s"] > r["out_tok_s"] or o["accuracy"] > r["accuracy"]) for o in scored)]
    return sorted(best, key=lambda r: r["out_tok_s"])


def evicted_nothing(row: dict) -> bool:
    """A policy whose kv_stats held as much pool as full attention's (or said nothing)."""
    if row["point"] in (STOCK, "full"):
        return False
    return row["kv_bytes_vs_full"] is None or row["kv_bytes_vs_full"] >= 1.0 - 1e-9


def eviction_ran(row: dict) -> bool:
    """The heads held fewer bytes than full attention's: tokens were evicted, whatever the
    pool's page rounding made of it."""
    heads = row.get("kv_heads_vs_full")
    return heads is not None and heads < 1.0 - 1e-9


def _eviction_cell(row: dict) -> str:
    if row["point"] in (STOCK, "full"):
        return "stock"
    if not eviction_ran(row):
        return "no: **no bytes saved**"
    return "yes, but **no bytes saved** (page rounding)" if evicted_nothing(row) else "yes"


def _ratio(a, b) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "n/a"


def _tok_s(row: dict, stock: dict | None) -> str:
    if row.get("tok_s") is None:  # (a point measured before the column)
        return "n/a"
    return f"{row['tok_s']:.0f} ({_ratio(row['tok_s'], stock and stock.get('tok_s'))})"


def _ms(stats: dict) -> str:
    return "/".join(f"{stats[k]:.0f}" if stats.get(k) is not None else "-" for k in ("p50", "p99"))


def table(rows: list[dict]) -> str:
    lines = []
    for fraction in sorted({r["pool_fraction"] for r in rows}):
        here = [r for r in rows if r["pool_fraction"] == fraction]
        stock = next((r for r in here if r["point"] == STOCK), None)
        lines += [f"### Pool: {fraction:g} x the burst's full-attention KV", "",
                  "| point | accuracy [95 % CI] | vs stock | output tok/s | x stock | "
                  "prompt + output tok/s (x stock) | requests at "
                  "once (peak / mean) | mean output tokens | x stock | TTFT ms p50/p99 | "
                  "TPOT ms p50/p99 | preemptions | KV held / full's (in heads) | eviction ran |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in sorted(here, key=lambda r: (r["point"] != STOCK, r["point"])):
            acc = "n/a" if r["accuracy"] is None else f"{r['accuracy']:.3f}" + (
                f" [{r['accuracy_ci'][0]:.2f}, {r['accuracy_ci'][1]:.2f}]"
                if r["accuracy_ci"] else "")
            delta = ("n/a" if stock is None or r["accuracy"] is None or stock["accuracy"] is None
                     else f"{r['accuracy'] - stock['accuracy']:+.3f}")
            held, heads = r["kv_bytes_vs_full"], r.get("kv_heads_vs_full")
            failed = f" ({len(r['failed'])} failed)" if r["failed"] else ""
            lines.append(
                f"| {r['point']}{failed} | {acc} | {delta} | {r['out_tok_s']:.1f} | "
                f"{_ratio(r['out_tok_s'], stock and stock['out_tok_s'])} | "
                f"{_tok_s(r, stock)} | "
                f"{r['running_peak']} / {r['running_mean'] or 0:.1f} | "
                f"{r['mean_output_tokens'] or 0:.1f} | "
                f"{_ratio(r['mean_output_tokens'], stock and stock['mean_output_tokens'])} | "
                f"{_ms(r['ttft_ms'])} | {_ms(r['tpot_ms'])} | {r['preemptions']} | "
                f"{'n/a' if held is None else f'{held:.2f}'}"
                f"{'' if heads is None else f' ({heads:.2f})'} | {_eviction_cell(r)} |")
        lines.append("")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pools = sorted({r["pool_fraction"] for r in rows})
    fig, axes = plt.subplots(1, len(pools), figsize=(6 * len(pools), 4.5), squeeze=False)
    for ax, fraction in zip(axes[0], pools):
        here = [r for r in rows if r["pool_fraction"] == fraction and r["accuracy"] is not None]
        for r in here:
            stock = r["point"] == STOCK
            ax.scatter(r["out_tok_s"], r["accuracy"], marker="*" if stock else "o",
                       s=160 if stock else 40, color="black" if stock else None,
                       facecolors="none" if evicted_nothing(r) else None)
            ax.annotate(r["point"], (r["out_tok_s"], r["accuracy"]), fontsize=7,
                        xytext=(3, 3), textcoords="offset points")
        best = frontier(here)
        ax.plot([r["out_tok_s"] for r in best], [r["accuracy"] for r in best], "--",
                color="grey", linewidth=1, label="frontier")
        ax.set(title=f"pool {fraction:g} x the burst's full-attention KV",
               xlabel="output tokens/s", ylabel="accuracy")
        ax.legend(loc="lower left", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(rows: list[dict], out_dir: Path, header: str) -> str:
    text = header + "\n\n" + table(rows)
    (out_dir / "table.md").write_text(text)
    (out_dir / "points.json").write_text(json.dumps(rows, indent=1) + "\n")
    if rows:
        plot(rows, out_dir / "pareto.png")
    return text


def header(args, items_id: str, commit: str) -> str:
    source = f"`{args.prompts}`" if args.prompts else (
        f"tasks {', '.join(args.tasks)} at {args.length} tokens, {args.per_category} per "
        f"category (seed {args.seed})")
    return (f"# Pareto: accuracy against throughput, stock beside each point\n\n"
            f"Command: `python -m loadtest.pareto {' '.join(args.argv)}`\n\n"
            f"Commit: {commit}. Prompts: {source} (digest {items_id}); every prompt of the "
            f"burst sent at once, greedy; model `{args.model}`.")


def _commit() -> str:
    import subprocess

    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1]).stdout.strip() or "unknown"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--points", nargs="+", default=[STOCK, "prulong:0.7", "snapkv:0.7:patched"],
                    help="stock, or a policy text: prulong:0.7, snapkv:0.7:patched, "
                         "prulong:0.5+snapkv:0.5:patched (launch.parse_policy)")
    ap.add_argument("--pools", type=float, nargs="+", default=[0.25, 1.0],
                    help="pool sizes as fractions of the burst's full-attention KV")
    ap.add_argument("--model", default=None, help="model directory (default: the bundled one)")
    ap.add_argument("--tasks", nargs="+", default=None,
                    help="the evaluation's generated tasks (default: its DEFAULT_TASKS)")
    ap.add_argument("--length", type=int, default=2048, help="prompt tokens of each task")
    ap.add_argument("--per-category", type=int, default=4)
    ap.add_argument("--prompts", type=Path, default=None,
                    help="JSONL of {prompt, answers, max_tokens} instead of the tasks")
    ap.add_argument("--max-tokens", type=int, default=32, help="--prompts lines without one")
    ap.add_argument("--chunk", type=int, default=1024, help="--max-num-batched-tokens")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--compiled", action="store_true",
                    help="serve without --enforce-eager (a GPU's compile and CUDA graphs)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--port", type=int, default=8150)
    ap.add_argument("--reserved-cpus", default="1",
                    help="VLLM_CPU_NUM_OF_RESERVED_CPU (vLLM CPU; ignored elsewhere)")
    ap.add_argument("--vllm-arg", dest="vllm_args", action="append", default=[],
                    help="one more `vllm serve` argument for every point (repeatable)")
    ap.add_argument("--mask", action="append", default=[], metavar="POLICY=PATH",
                    help="the head mask of a head-mask policy's points (--kv-mask), e.g. "
                         "duo=head_masks/SmolLM2-135M-Instruct/duo.json (repeatable)")
    ap.add_argument("--out-dir", type=Path, default=Path("docs/results/pareto"))
    ap.add_argument("--report-only", action="store_true")
    args = ap.parse_args(argv)
    for fraction in args.pools:
        if fraction <= 0:
            raise SystemExit(f"--pools: {fraction} is not a positive fraction")
    args.argv = list(argv) if argv is not None else sys.argv[1:]
    args.masks = {}
    for text in args.mask:
        policy, _, path = text.partition("=")
        if not path or not Path(path).is_file():
            raise SystemExit(f"--mask {text!r}: expected POLICY=PATH of an existing mask file")
        args.masks[policy] = path
    args.env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": args.reserved_cpus}
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / "points.jsonl"
    top_path = args.out_dir / "header.md"  # (the measuring run's command and commit)
    if args.report_only:
        top = top_path.read_text() if top_path.exists() else "# Pareto"
        print(report(load(path), args.out_dir, top))
        return 0
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from vllm_kvevict.launch import parse_policy
    from vllm_kvevict.model import ensure_bundled_model

    for point in args.points:  # a bad point text stops here, before any server starts
        if point != STOCK:
            try:
                parse_policy(point)
            except ValueError as exc:
                raise SystemExit(f"--points {point!r}: {exc}")
    args.model = args.model or str(ensure_bundled_model())
    tok = AutoTokenizer.from_pretrained(args.model)
    if args.prompts:
        items = jsonl_items(tok, args.prompts, args.max_tokens)
    else:
        from vllm_kvevict.evaluation.tasks import DEFAULT_TASKS

        args.tasks = args.tasks or list(DEFAULT_TASKS)
        items = task_items(tok, args.tasks, args.length, args.per_category, args.seed)
    items_id, per_token = items_digest(items), model_bytes(args.model)[1]
    done = {(r["point"], r["pool_fraction"]) for r in load(path) if r.get("items") == items_id}
    todo = [(p, f) for f in args.pools for p in args.points if (p, f) not in done]
    top = header(args, items_id, _commit())
    top_path.write_text(top)
    for point, fraction in tqdm(todo, desc="pareto points", unit="server"):
        row = {**measure(point, fraction, items, args, tok, per_token), "items": items_id}
        with path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        report([r for r in load(path) if r.get("items") == items_id], args.out_dir, top)
    print(report([r for r in load(path) if r.get("items") == items_id], args.out_dir, top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
