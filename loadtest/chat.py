"""Multi-turn chat: conversations that share a long system prompt, each turn sending the whole
history (system prompt, every earlier user text and answer) plus a new user text. This is the
traffic where vLLM's prefix cache wins most: from turn 2 on, all but the new user text was
already computed.

    python -m loadtest.chat --policies stock prulong:0.7 --conversations 8 --turns 6 \\
        --system-len 2048 --user-len 64 --output-len 64 --concurrency 4 \\
        --out-dir docs/results/chat

One server per policy (as `loadtest.compare`; `stock` is vLLM without our plugin), a warm-up
request, then the conversations: `--concurrency` of them in flight, each one's turns in order
(turn t+1 is sent when turn t's answer is back; its ids, from `return_token_ids`, are appended
exactly). A policy written `NAME/nopc` runs with `--no-enable-prefix-caching`, `NAME/pc` with
`--enable-prefix-caching` (token eviction runs without it unless asked), `NAME/reuse` with that
and `--kv-prefix-reuse across-questions` (patched eviction), `NAME/cN` with
`--kv-eviction-chunk N`. Every prompt is
token ids (`loadtest.workloads.exact_length_ids`), seeded by (seed, conversation, turn), the same
for every policy; answers are greedy, so they differ between policies only where the policies
compute differently.

Per turn: mean TTFT, prompt tokens, prompt tokens served from the prefix cache (vLLM's
`usage.prompt_tokens_details.cached_tokens`), KV bytes held at the request's peak (kv_stats;
not reported by stock vLLM). Per run: vLLM's own prefix-cache hit rate from /metrics
(`vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total` over the run), requests
running at once (peak and mean of `vllm:num_requests_running`), preemptions.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loadtest.client import RequestResult, make_http_client, send_request
from loadtest.monitors import MetricsSampler
from loadtest.workloads import Prompt, exact_length_ids

SYSTEM_STREAM = 2**20  # seed stream of the shared system prompt (conversations use 0, 1, ...)


@dataclass(frozen=True)
class ChatShape:
    conversations: int = 8
    turns: int = 6
    system_len: int = 2048
    user_len: int = 64
    output_len: int = 64

    def __post_init__(self) -> None:
        for key, value in asdict(self).items():
            if value < 1:
                raise ValueError(f"{key} must be >= 1, got {value}")


@dataclass
class Turn:
    conversation: int
    turn: int  # 1-based, as the report counts turns
    result: RequestResult


def system_ids(tokenizer, shape: ChatShape, seed: int) -> list[int]:
    return exact_length_ids(tokenizer, shape.system_len, np.random.default_rng([seed,
                                                                                 SYSTEM_STREAM]))


def user_ids(tokenizer, shape: ChatShape, seed: int, conversation: int, turn: int) -> list[int]:
    rng = np.random.default_rng([seed, conversation, turn])
    return exact_length_ids(tokenizer, shape.user_len, rng)


async def run_chat(tokenizer, shape: ChatShape, *, base_url: str, model: str, concurrency: int,
                   seed: int = 0, max_duration_s: float = 1800.0, scrape_metrics: bool = True
                   ) -> dict[str, Any]:
    """Every conversation's turns; a turn that does not come back ok ends its conversation."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    loop = asyncio.get_running_loop()
    system = system_ids(tokenizer, shape, seed)
    turns: list[Turn] = []
    async with make_http_client(max_duration_s) as client:
        sampler = MetricsSampler(client, base_url) if scrape_metrics else None
        t0 = time.perf_counter()
        if sampler is not None:
            await sampler.start(t0)
        deadline = loop.time() + max_duration_s
        pending = iter(range(shape.conversations))

        async def conversation(c: int) -> None:
            history = list(system)
            for t in range(1, shape.turns + 1):
                ids = history + user_ids(tokenizer, shape, seed, c, t)
                prompt = Prompt(c * shape.turns + t - 1, "chat", ids, shape.output_len, "")
                res = await send_request(client, base_url, model, prompt, t0, deadline,
                                         max_duration_s, ignore_eos=True,
                                         return_token_ids=True)
                if res.ok and len(res.token_ids) != res.output_tokens:
                    # without the answer's ids the next turn's history would be a guess
                    res.outcome, res.error_type = "failed", "NoTokenIds"
                    res.error = (f"{len(res.token_ids)} answer ids for {res.output_tokens} "
                                 "tokens (a server without vLLM's return_token_ids?)")
                turns.append(Turn(c, t, res))
                if not res.ok:
                    return
                history = ids + res.token_ids

        async def worker() -> None:
            for c in pending:  # one shared iterator: each conversation runs once
                await conversation(c)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        duration = time.perf_counter() - t0
        if sampler is not None:
            await sampler.stop()
    turns.sort(key=lambda x: (x.conversation, x.turn))
    metrics = sampler.summary() if sampler is not None else None
    return {"shape": asdict(shape), "concurrency": concurrency, "seed": seed,
            "duration_s": duration, "turns": [turn_record(x) for x in turns],
            "per_turn": per_turn(turns), "server": {k: v for k, v in (metrics or {}).items()
                                                    if k != "timeline"},
            "timeline": (metrics or {}).get("timeline", [])}


def turn_record(x: Turn) -> dict[str, Any]:
    r = x.result
    kv = r.kv_stats or {}
    return {"conversation": x.conversation, "turn": x.turn, "outcome": r.outcome,
            "error": r.error, "prompt_tokens": r.input_tokens, "cached_tokens": r.cached_tokens,
            "output_tokens": r.output_tokens, "ttft_s": r.ttft_s, "e2e_s": r.e2e_s,
            "kv_bytes_peak": kv.get("kv_bytes_peak"), "answer_ids": r.token_ids}


def per_turn(turns: list[Turn]) -> list[dict[str, Any]]:
    rows = []
    for t in sorted({x.turn for x in turns}):
        ok = [x.result for x in turns if x.turn == t and x.result.ok]
        cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
        kv = [r.kv_stats["kv_bytes_peak"] for r in ok
              if r.kv_stats and r.kv_stats.get("kv_bytes_peak") is not None]
        prompt = sum(r.input_tokens for r in ok)
        rows.append({
            "turn": t, "sent": sum(x.turn == t for x in turns), "ok": len(ok),
            "prompt_tokens_mean": prompt / len(ok) if ok else None,
            "cached_tokens_mean": float(np.mean(cached)) if cached else None,
            "hit_rate": sum(cached) / prompt if ok and len(cached) == len(ok) else None,
            "ttft_s_mean": float(np.mean([r.ttft_s for r in ok])) if ok else None,
            "kv_bytes_peak_mean": float(np.mean(kv)) if kv else None})
    return rows


def later_turns_ttft(run: dict[str, Any]) -> float | None:
    """Mean TTFT over every ok request of turns 2 and later (the issue's measure)."""
    values = [x["ttft_s"] for x in run["turns"] if x["turn"] >= 2 and x["outcome"] == "ok"]
    return float(np.mean(values)) if values else None


def summary_markdown(runs: dict[str, dict[str, Any]], command: str) -> str:
    """One row per policy (ratios to the first one), then each policy's per-turn table."""
    labels = list(runs)
    base = later_turns_ttft(runs[labels[0]])
    lines = [f"`{command}`", "", "| policy | ok turns | TTFT turns 2+ (s) | x "
             f"{labels[0]} | prefix-cache hit rate (vLLM) | running at once (peak / mean) | "
             "preemptions | KV bytes peak/request, mean (MiB) | wall s |",
             "|---|---:|---:|---:|---:|---|---:|---:|---:|"]
    for label, run in runs.items():
        ttft = later_turns_ttft(run)
        server = run["server"]
        kv = [x["kv_bytes_peak"] for x in run["turns"] if x["kv_bytes_peak"] is not None]
        hit = server.get("prefix_cache_hit_rate")
        cached = [x["cached_tokens"] for x in run["turns"] if x["outcome"] == "ok"]
        if hit is None and cached and not any(cached):
            hit = 0.0  # vLLM counts no lookups with prefix caching off; no token came cached
        peak, mean = server.get("running_peak"), server.get("running_mean")
        lines.append(
            f"| {label} | {sum(x['outcome'] == 'ok' for x in run['turns'])}/"
            f"{run['shape']['conversations'] * run['shape']['turns']} | "
            f"{'–' if ttft is None else f'{ttft:.2f}'} | "
            f"{'–' if ttft is None or not base else f'{ttft / base:.2f}'} | "
            f"{'–' if hit is None else f'{100 * hit:.1f} %'} | "
            f"{'–' if peak is None else f'{peak:g} / {mean:.2f}'} | "
            f"{server.get('preemptions', '–')} | "
            f"{f'{np.mean(kv) / 2**20:.1f}' if kv else '–'} | {run['duration_s']:.0f} |")
    for label, run in runs.items():
        lines += ["", f"**{label}** per turn", "", "| turn | ok | prompt tokens | cached tokens "
                  "| hit rate | TTFT s | KV bytes peak (MiB) |", "|---:|---:|---:|---:|---:|---:|"
                  "---:|"]
        for row in run["per_turn"]:
            hit, kv = row["hit_rate"], row["kv_bytes_peak_mean"]
            lines.append(f"| {row['turn']} | {row['ok']}/{row['sent']} | "
                         f"{_fmt(row['prompt_tokens_mean'], '{:.0f}')} | "
                         f"{_fmt(row['cached_tokens_mean'], '{:.0f}')} | "
                         f"{_fmt(None if hit is None else 100 * hit, '{:.1f} %')} | "
                         f"{_fmt(row['ttft_s_mean'], '{:.2f}')} | "
                         f"{_fmt(None if kv is None else kv / 2**20, '{:.1f}')} |")
    return "\n".join(lines) + "\n"


def _fmt(value: float | None, fmt: str) -> str:
    return "–" if value is None else fmt.format(value)


def plot_turns(runs: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    for label, run in runs.items():
        rows = [r for r in run["per_turn"] if r["ttft_s_mean"] is not None]
        ax1.plot([r["turn"] for r in rows], [r["ttft_s_mean"] for r in rows], marker="o",
                 label=label)
        hits = [r for r in rows if r["hit_rate"] is not None]
        ax2.plot([r["turn"] for r in hits], [100 * r["hit_rate"] for r in hits], marker="o",
                 label=label)
    ax1.set(xlabel="turn", ylabel="mean TTFT (s)", title="Time to first token per turn")
    ax2.set(xlabel="turn", ylabel="prompt tokens from the prefix cache (%)", ylim=(-3, 103),
            title="Prefix-cache hits per turn")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)


PC_OPTIONS = {"nopc": ["--no-enable-prefix-caching"], "pc": ["--enable-prefix-caching"],
              "reuse": ["--enable-prefix-caching", "--kv-prefix-reuse", "across-questions"]}


def server_argv(model: str, text: str, *, kv_cache_bytes: int, chunk: int, port: int,
                max_model_len: int) -> tuple[list[str], dict[str, str]]:
    """`vllm serve` argv and env of a policy label (`stock`, `full`, `prulong:0.7`), any of
    them with `/nopc`: --no-enable-prefix-caching, `/pc`: --enable-prefix-caching (which token
    eviction needs asked for), `/reuse`: that and --kv-prefix-reuse across-questions (patched
    token eviction), and `/cN`: --kv-eviction-chunk N, e.g. `snapkv:0.7/reuse/c128`."""
    from vllm_kvevict.launch import server_launch

    name, *options = text.split("/")
    caching = [o for o in options if o in PC_OPTIONS]
    chunks = [o for o in options if re.fullmatch(r"c[1-9]\d*", o)]
    if len(caching) > 1 or len(chunks) > 1 or len(caching) + len(chunks) != len(options):
        raise ValueError(f"policy {text!r}: the options after '/' are one of "
                         f"{', '.join(PC_OPTIONS)} and cN (--kv-eviction-chunk N)")
    extra = ["--dtype", "float32", "--served-model-name", "chat", "--max-model-len",
             str(max_model_len), "--enable-prompt-tokens-details"]
    for option in caching:
        extra += PC_OPTIONS[option]
    for option in chunks:
        extra += ["--kv-eviction-chunk", option[1:]]
    return server_launch(model, name, kv_cache_bytes=kv_cache_bytes, max_batched_tokens=chunk,
                         port=port, extra_args=extra)


def add_server_args(p: argparse.ArgumentParser, *, chunk: int, port: int) -> None:
    """The options of a CLI that starts one server per policy label (`label_server`)."""
    p.add_argument("--model", help="model directory (default: the bundled one)")
    p.add_argument("--chunk", type=int, default=chunk, help="--max-num-batched-tokens")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=800 * 2**20)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--port", type=int, default=port)
    p.add_argument("--reserved-cpus", default="1",
                   help="VLLM_CPU_NUM_OF_RESERVED_CPU for every server (as loadtest."
                        "bench_latency: the plugin's KV connector otherwise changes vLLM's "
                        "thread count on a 2-core machine); '' = vLLM's choice")


def label_server(model: str, text: str, args) -> tuple[list[str], dict[str, str]]:
    """`server_argv` of a label with `add_server_args`' options applied."""
    argv, env = server_argv(model, text, kv_cache_bytes=args.kv_cache_memory_bytes,
                            chunk=args.chunk, port=args.port, max_model_len=args.max_model_len)
    if args.reserved_cpus:
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = args.reserved_cpus
    return argv, env


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest.chat", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policies", nargs="+", default=["stock", "prulong:0.7",
                                                     "prulong:0.7/nopc"],
                   help="stock (vLLM without the plugin), full, or a policy as in "
                        "loadtest.compare; NAME/nopc adds --no-enable-prefix-caching, NAME/pc "
                        "--enable-prefix-caching (snapkv/pyramidkv naive), NAME/reuse that "
                        "and --kv-prefix-reuse across-questions, NAME/cN --kv-eviction-chunk "
                        "N. The first is the baseline of the ratios")
    defaults = ChatShape()
    for key, value in asdict(defaults).items():
        p.add_argument(f"--{key.replace('_', '-')}", type=int, default=value)
    p.add_argument("--concurrency", type=int, default=4, help="conversations in flight")
    p.add_argument("--seed", type=int, default=0)
    add_server_args(p, chunk=512, port=8131)
    p.add_argument("--max-duration", type=float, default=1800.0, help="seconds per policy")
    p.add_argument("--out-dir", type=Path, default=Path("docs/results/chat"))
    p.add_argument("--rerun", action="store_true",
                   help="run policies whose result file already exists (default: reuse it when "
                        "it has the same shape, concurrency and seed)")
    return p


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoTokenizer

    from vllm_kvevict.launch import ServerProcess
    from vllm_kvevict.model import ensure_bundled_model

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        shape = ChatShape(**{k: getattr(args, k) for k in asdict(ChatShape())})
        for text in args.policies:  # every label checked before the first server starts
            server_argv("MODEL", text, kv_cache_bytes=args.kv_cache_memory_bytes,
                        chunk=args.chunk, port=args.port, max_model_len=args.max_model_len)
    except ValueError as exc:
        parser.error(str(exc))
    if args.concurrency < 1:
        parser.error("--concurrency must be >= 1")
    model = args.model or str(ensure_bundled_model())
    tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
    base_url = f"http://127.0.0.1:{args.port}"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    runs: dict[str, dict[str, Any]] = {}
    for text in args.policies:
        slug = text.replace(":", "-").replace("/", "-")
        out = args.out_dir / f"run_{slug}.json"
        if out.exists() and not args.rerun:
            stored = json.loads(out.read_text())
            same = (stored.get("shape"), stored.get("concurrency"), stored.get("seed")) == (
                asdict(shape), args.concurrency, args.seed)
            if same:
                runs[text] = stored
                print(f"== {text}: reusing {out}", flush=True)
                continue
            print(f"== {text}: {out} is a run of another shape, concurrency or seed; rerunning",
                  flush=True)
        argv_serve, env = label_server(model, text, args)
        print(f"== {text}: {' '.join(argv_serve)}", flush=True)
        with ServerProcess(argv_serve, args.out_dir / f"server_{slug}.log", env=env) as server:
            server.wait_healthy(base_url)
            warm = ChatShape(conversations=1, turns=1, system_len=16, user_len=8,
                             output_len=4)
            asyncio.run(run_chat(tokenizer, warm, base_url=base_url, model="chat",
                                 concurrency=1, seed=2**31 - 1, scrape_metrics=False))
            run = asyncio.run(run_chat(tokenizer, shape, base_url=base_url, model="chat",
                                       concurrency=args.concurrency, seed=args.seed,
                                       max_duration_s=args.max_duration))
        run["policy"], run["server_argv"] = text, argv_serve
        out.write_text(json.dumps(run, indent=1))
        runs[text] = run
        print(summary_markdown({text: run}, text), flush=True)
    command = "python -m loadtest.chat " + " ".join(sys.argv[1:] if argv is None else argv)
    text = summary_markdown(runs, command)
    (args.out_dir / "summary.md").write_text(text)
    plot_turns(runs, args.out_dir / "turns.png")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
