"""Shared-context evaluation in the spirit of SCBench (Li et al., 2024): one long context,
several questions, per server setting: accuracy (95 % intervals) and TTFT.

A context is a RULER-style haystack (`vllm_kvevict.evaluation.tasks`: noise sentences) of about
`--length` tokens holding `--questions` needles "The special magic number for KEY is: NNNN.";
question i asks KEY i's number. Two variants, each example one question:
- shared: each question its own request, [context, question i] (SCBench's multi-request mode);
- multiturn: one conversation, turn i = turn i-1's prompt + its greedy answer + question i.
Per setting (a `loadtest.chat` policy label, one server each, run in order, requests one at a
time): `stock/pc`-like full attention with prefix caching, a token policy recomputing every
prompt (prefix caching off), the same with reuse (`/reuse`: prefix caching and `--kv-prefix-reuse
across-questions`, or `/pc` for naive eviction). Each answer is scored by whether it names the
asked number (`score_recall`); kv_stats gives TTFT (engine arrival -> first token) and the
tokens served from the prefix cache.

Resumable: records go to `records.jsonl` keyed by (setting, variant, context, question); rerun
the same command and only what is missing runs. `report` writes `table.md` and `shared.png`.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import httpx
import numpy as np

from loadtest.chat import add_server_args
from vllm_kvevict.evaluation import vocabulary as vocab
from vllm_kvevict.evaluation.tasks import (NIAH_INSTRUCTION, SENTINEL, PromptBuilder, distinct,
                                           insert_at_depths, noise, numbers, score_recall,
                                           spread_depths)

VARIANTS = ("shared", "multiturn")
MAX_TOKENS = 12  # "... is" + " NNNN." and a little more


@dataclass(frozen=True)
class Context:
    index: int
    keys: tuple[str, ...]
    values: tuple[str, ...]
    head_ids: tuple[int, ...]  # chat head, instruction and haystack: what every question shares

    def question(self, builder: PromptBuilder, i: int) -> tuple[list[int], list[int]]:
        """(ids of question i's user text, ids after it: the assistant turn's opening)."""
        key = self.keys[i]
        asked = builder.encode(f"What is the special magic number for {key} mentioned in the "
                               "provided text?")
        opening = builder.tail + builder.encode(f"The special magic number for {key} "
                                                "mentioned in the provided text is")
        return asked, opening


def make_context(builder: PromptBuilder, index: int, length: int, questions: int,
                 seed: int) -> Context:
    """A haystack of about `length` tokens with `questions` needles at spread depths."""
    rng = random.Random(seed * 1_000_003 + index)
    keys = distinct(rng, vocab.KEY_WORDS, questions)
    values = numbers(rng, 4, questions)
    needles = [f" The special magic number for {k} is: {v}." for k, v in zip(keys, values)]
    before = builder.head + builder.encode(NIAH_INSTRUCTION.format(kind="numbers"))
    items, ids = 8, []
    while True:  # the largest haystack that fits (noise items are one sentence each)
        segments = insert_at_depths(noise(items), needles,
                                    spread_depths(random.Random(index), questions))
        grown = before + [t for s in segments for t in builder.encode_segment(s)]
        if len(grown) > length:
            break
        ids, items = grown, items + 4
    if not ids:
        raise ValueError(f"--length {length} is too short for {questions} needles")
    return Context(index, tuple(keys), tuple(values),
                   tuple(ids + builder.encode("\n\n")))


def turn_separator(tokenizer) -> list[int]:
    """Ids between an assistant answer and the next user text in the chat template."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "u"}, {"role": "assistant", "content": SENTINEL},
         {"role": "user", "content": SENTINEL}], tokenize=False)
    between = text.split(SENTINEL)[1]
    return list(tokenizer.encode(between, add_special_tokens=False))


def record_key(setting: str, variant: str, context: "Context", question: int) -> str:
    """(the context's first ids and length stand for the run's --length, --seed, --questions)"""
    shape = f"{len(context.head_ids)}:{context.values[0]}:{len(context.keys)}"
    return f"{setting}|{variant}|{context.index}|{shape}|{question}"


def complete(client: httpx.Client, base_url: str, prompt: list[int]) -> tuple[str, list[int],
                                                                                dict]:
    body = {"model": "chat", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "logprobs": 0, "return_tokens_as_token_ids": True}
    r = client.post(f"{base_url}/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    out = r.json()
    choice = out["choices"][0]
    ids = [int(t.split(":")[1]) for t in (choice.get("logprobs") or {}).get("tokens", [])]
    stats = out.get("kv_stats") or {}
    cached = ((out.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
    stats.setdefault("cached_tokens", cached)
    return choice["text"], ids, stats


def run_setting(client: httpx.Client, base_url: str, setting: str, contexts: Sequence[Context],
                builder: PromptBuilder, separator: list[int], done: dict[str, dict],
                write) -> None:
    """Every missing record of `setting`: the shared variant, then the multi-turn one."""
    from tqdm import tqdm

    total = 2 * sum(len(c.keys) for c in contexts)
    bar = tqdm(total=total, desc=setting, file=sys.stdout)
    for variant in VARIANTS:
        for ctx in contexts:
            history = list(ctx.head_ids)  # the multi-turn conversation so far
            for i, value in enumerate(ctx.values):
                asked, opening = ctx.question(builder, i)
                if variant == "shared":
                    prompt = list(ctx.head_ids) + asked + opening
                else:
                    prompt = history + asked + opening
                key = record_key(setting, variant, ctx, i)
                record = done.get(key)
                if record is None:
                    text, ids, stats = complete(client, base_url, prompt)
                    record = {"key": key, "setting": setting, "variant": variant,
                              "context": ctx.index, "question": i, "prompt_tokens": len(prompt),
                              "answer": text, "answer_ids": ids, "gold": value,
                              "correct": score_recall(text, [value]),
                              "ttft_s": stats.get("ttft_s"),
                              "cached_tokens": stats.get("cached_tokens"),
                              "reused_chunks_other_question":
                                  stats.get("reused_chunks_other_question"),
                              "kv_bytes_peak": stats.get("kv_bytes_peak"),
                              "full_kv_bytes_peak": stats.get("full_kv_bytes_peak")}
                    write(record)
                    done[key] = record
                history = prompt + record["answer_ids"] + separator
                bar.update(1)
    bar.close()


# -- statistics --------------------------------------------------------------------------------

def wilson(successes: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a proportion (95 % by default)."""
    if n == 0:
        return (math.nan, math.nan)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def paired_interval(diffs: Sequence[float], seed: int = 0, n: int = 4000,
                    level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of paired differences (one per example,
    resampled independently)."""
    d = np.asarray(diffs, dtype=float)
    if d.size == 0:
        return (math.nan, math.nan)
    rng = np.random.default_rng(seed)
    means = d[rng.integers(0, d.size, size=(n, d.size))].mean(axis=1)
    lo, hi = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def summarize(records: Iterable[dict], settings: Sequence[str]) -> list[dict[str, Any]]:
    """One row per (setting, variant): n, accuracy and its Wilson interval, mean TTFT (all
    questions and the questions after a context's first), mean cached tokens, and against
    the first setting of the same policy family the paired accuracy difference."""
    by: dict[tuple[str, str], dict[tuple[int, int], dict]] = {}
    for r in records:
        by.setdefault((r["setting"], r["variant"]), {})[(r["context"], r["question"])] = r
    rows = []
    for variant in VARIANTS:
        for setting in settings:
            cell = by.get((setting, variant), {})
            if not cell:
                continue
            rs = list(cell.values())
            correct = sum(r["correct"] for r in rs)
            later = [r["ttft_s"] for r in rs if r["question"] > 0 and r["ttft_s"] is not None]
            rows.append({
                "setting": setting, "variant": variant, "n": len(rs),
                "accuracy": correct / len(rs), "interval": wilson(correct, len(rs)),
                "ttft_s": float(np.mean([r["ttft_s"] for r in rs if r["ttft_s"] is not None])),
                "ttft_later_s": float(np.mean(later)) if later else math.nan,
                "cached_tokens": float(np.mean([r["cached_tokens"] or 0 for r in rs])),
                "prompt_tokens": float(np.mean([r["prompt_tokens"] for r in rs])),
                "kv_bytes_peak": (float(np.mean([r["kv_bytes_peak"] for r in rs]))
                                  if all(r.get("kv_bytes_peak") for r in rs) else None),
                "cell": cell})
    return rows


def compare(rows: Sequence[dict], a: str, b: str, variant: str) -> dict | None:
    """Paired accuracy difference b - a over the examples both ran, with its interval."""
    ra = next((r for r in rows if r["setting"] == a and r["variant"] == variant), None)
    rb = next((r for r in rows if r["setting"] == b and r["variant"] == variant), None)
    if ra is None or rb is None:
        return None
    common = sorted(set(ra["cell"]) & set(rb["cell"]))
    diffs = [rb["cell"][k]["correct"] - ra["cell"][k]["correct"] for k in common]
    lo, hi = paired_interval(diffs)
    return {"a": a, "b": b, "variant": variant, "n": len(diffs),
            "diff": float(np.mean(diffs)) if diffs else math.nan, "interval": (lo, hi),
            "resolved": not (lo <= 0.0 <= hi),
            "ttft_ratio": rb["ttft_later_s"] / ra["ttft_later_s"]}


def report(records: list[dict], settings: Sequence[str], pairs: Sequence[tuple[str, str]],
           out_dir: Path, command: str) -> str:
    rows = summarize(records, settings)
    lines = [f"`{command}`", "",
             "| variant | setting | n | accuracy | 95 % interval (Wilson) | TTFT s (all) | "
             "TTFT s (questions 2+) | cached tokens (mean) | prompt tokens (mean) | "
             "KV bytes peak (MiB, mean) |", "|---|---|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        kv = "–" if r["kv_bytes_peak"] is None else f"{r['kv_bytes_peak'] / 2**20:.1f}"
        lines.append(f"| {r['variant']} | {r['setting']} | {r['n']} | {r['accuracy']:.1%} | "
                     f"{r['interval'][0]:.1%} - {r['interval'][1]:.1%} | {r['ttft_s']:.2f} | "
                     f"{r['ttft_later_s']:.2f} | {r['cached_tokens']:.0f} | "
                     f"{r['prompt_tokens']:.0f} | {kv} |")
    lines += ["", "Paired differences (same questions; bootstrap 95 % interval of the mean; "
              "resolved = the interval excludes 0):", "",
              "| variant | b - a | n | accuracy difference | 95 % interval | resolved | TTFT "
              "ratio b / a (questions 2+) |", "|---|---|---:|---:|---|---|---:|"]
    for variant in VARIANTS:
        for a, b in pairs:
            c = compare(rows, a, b, variant)
            if c is None:
                continue
            lines.append(f"| {variant} | {b} - {a} | {c['n']} | {c['diff']:+.1%} | "
                         f"{c['interval'][0]:+.1%} - {c['interval'][1]:+.1%} | "
                         f"{'yes' if c['resolved'] else 'no'} | {c['ttft_ratio']:.2f} |")
    text = "\n".join(lines) + "\n"
    (out_dir / "table.md").write_text(text)
    plot(rows, out_dir / "shared.png")
    return text


def plot(rows: Sequence[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, variant in zip(axes, VARIANTS):
        rs = [r for r in rows if r["variant"] == variant]
        for r in rs:
            lo, hi = r["interval"]
            ax.errorbar(r["ttft_later_s"], r["accuracy"],
                        yerr=[[r["accuracy"] - lo], [hi - r["accuracy"]]], fmt="o", capsize=3,
                        label=r["setting"])
        ax.set_title(f"{variant}: accuracy vs TTFT (questions 2+)")
        ax.set_xlabel("mean TTFT, s")
        ax.set_ylabel("accuracy (95 % Wilson)")
        ax.set_ylim(-0.05, 1.05)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


# -- command line --------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest.shared_context", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--settings", nargs="+", required=True,
                   help="loadtest.chat policy labels, e.g. full/pc snapkv:0.7 "
                        "snapkv:0.7/reuse snapkv:0.7:naive/pc")
    p.add_argument("--pairs", nargs="*", default=[],
                   help="A,B: report B - A (paired accuracy, TTFT ratio)")
    p.add_argument("--contexts", type=int, default=5)
    p.add_argument("--questions", type=int, default=4)
    p.add_argument("--length", type=int, default=1536, help="context tokens (about)")
    p.add_argument("--seed", type=int, default=0)
    add_server_args(p, chunk=256, port=8133)
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--report-only", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoTokenizer

    from loadtest.chat import label_server
    from vllm_kvevict.launch import ServerProcess
    from vllm_kvevict.model import ensure_bundled_model

    parser = build_parser()
    args = parser.parse_args(argv)
    pairs = [tuple(p.split(",")) for p in args.pairs]
    if any(len(p) != 2 or set(p) - set(args.settings) for p in pairs):
        parser.error("--pairs are A,B with A and B among --settings")
    model = args.model or str(ensure_bundled_model())
    tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
    builder = PromptBuilder(tokenizer)
    contexts = [make_context(builder, c, args.length, args.questions, args.seed)
                for c in range(args.contexts)]
    separator = turn_separator(tokenizer)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / "records.jsonl"
    done = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                done[r["key"]] = r
    command = "python -m loadtest.shared_context " + " ".join(
        sys.argv[1:] if argv is None else argv)
    (args.out_dir / "command.txt").write_text(command + "\n")
    base_url = f"http://127.0.0.1:{args.port}"
    with open(path, "a") as sink:
        def write(record: dict) -> None:
            sink.write(json.dumps(record) + "\n")
            sink.flush()

        for setting in [] if args.report_only else args.settings:
            if all(record_key(setting, v, c, i) in done for v in VARIANTS for c in contexts
                   for i in range(len(c.keys))):
                continue
            argv_serve, env = label_server(model, setting, args)
            slug = setting.replace(":", "-").replace("/", "-")
            print(f"== {setting}: {' '.join(argv_serve)}", flush=True)
            with ServerProcess(argv_serve, args.out_dir / "logs" / f"{slug}.log",
                               env=env) as server:
                server.wait_healthy(base_url)
                with httpx.Client() as client:
                    complete(client, base_url, builder.encode("warm up"))
                    run_setting(client, base_url, setting, contexts, builder, separator, done,
                                write)
    keys = {record_key(s, v, c, i) for s in args.settings for v in VARIANTS for c in contexts
            for i in range(len(c.keys))}
    records = [r for k, r in done.items() if k in keys]
    print(report(records, args.settings, pairs, args.out_dir, command))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
