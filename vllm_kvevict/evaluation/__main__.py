"""python -m vllm_kvevict.evaluation {run,report,baseline,show} ... (README.md in this folder)."""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
import time
from pathlib import Path

from vllm_kvevict.evaluation.grid import CostModel, estimate, preset, with_masks
from vllm_kvevict.evaluation.hf_baseline import load_model, score_examples
from vllm_kvevict.evaluation.report import report
from vllm_kvevict.evaluation.runner import ResultStore, Runner
from vllm_kvevict.evaluation.tasks import (DEFAULT_TASKS, TASKS, PromptBuilder, load_tokenizer,
                                           make_example, make_examples)
from vllm_kvevict.model import ensure_bundled_model

DEFAULT_OUT = Path("docs/results/evaluation")


def floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x)


def ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def words(text: str) -> tuple[str, ...]:
    return tuple(x for x in text.split(",") if x)


def hybrid_token_sparsities(text: str) -> tuple[float | None, ...]:
    """`s,0.25`: one hybrid curve per entry, `s` for token sparsity = head sparsity."""
    out: list[float | None] = []
    for x in (x.strip() for x in text.split(",") if x.strip()):
        error = argparse.ArgumentTypeError(
            f"--hybrid-token-sparsities takes 's' or numbers in [0, 1], got {x!r}")
        try:
            value = None if x == "s" else float(x)
        except ValueError:
            raise error from None
        if value is not None and not 0.0 <= value <= 1.0:
            raise error
        out.append(value)
    if not out:
        raise argparse.ArgumentTypeError("--hybrid-token-sparsities is empty")
    return tuple(out)


def mask_arg(text: str) -> tuple[str, str]:
    policy, sep, path = text.partition("=")
    if not sep or not path:
        raise argparse.ArgumentTypeError(f"--mask wants POLICY=PATH, got {text!r}")
    if not Path(path).is_file():
        raise argparse.ArgumentTypeError(f"mask file {path} does not exist")
    return policy, path


def add_example_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tasks", type=words, default=None,
                   help=f"comma list (default {','.join(DEFAULT_TASKS)}; all: "
                        f"{','.join(TASKS)})")
    p.add_argument("--lengths", type=ints, default=None, help="prompt lengths in tokens")
    p.add_argument("--per-category", type=int, default=None,
                   help="examples per task category and length (dealt over its tasks)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="model directory (default: the bundled one)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m vllm_kvevict.evaluation", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run the grid through live vllm serve processes")
    run.add_argument("--preset", default="default", choices=("default", "smoke"))
    add_example_args(run)
    run.add_argument("--chunks", type=ints, default=None, help="prefill chunk sizes")
    run.add_argument("--methods", type=words, default=None,
                     help="subset of full,streaming,duo,prulong,snapkv,pyramidkv and the "
                          "hybrids prulong+snapkv, prulong+pyramidkv, duo+snapkv, "
                          "duo+pyramidkv (a head mask at s with token eviction on its full "
                          "heads, see --hybrid-token-sparsities), and full@fp8, prulong@fp8 "
                          "(--kv-cache-dtype fp8)")
    run.add_argument("--evictions", type=words, default=None, help="naive,patched")
    run.add_argument("--head-sparsities", type=floats, default=None)
    run.add_argument("--token-sparsities", type=floats, default=None)
    run.add_argument("--hybrid-token-sparsities", type=hybrid_token_sparsities, default=None,
                     help="the hybrids' token sparsity p on their full heads, one curve per "
                          "entry along the head sparsities: 's' (p = s, the default) or a "
                          "fixed p in [0, 1], e.g. s,0.25")
    run.add_argument("--no-bisect", dest="bisect", action="store_false", default=None,
                     help="run every candidate sparsity instead of bisecting the 90 %% crossing")
    run.add_argument("--mask", type=mask_arg, action="append", default=[],
                     metavar="POLICY=PATH", help="head mask for duo or prulong (repeatable); "
                     "default: the server's choice for each sparsity, recorded by digest")
    run.add_argument("--out-dir", type=Path, default=None,
                     help=f"results.jsonl and server logs (default {DEFAULT_OUT}, smoke: "
                          f"/tmp/kvevict-eval-smoke)")
    run.add_argument("--concurrency", type=int, default=1,
                     help="requests in flight per server (1 keeps chunk boundaries exact)")
    run.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    run.add_argument("--no-logprobs", dest="logprobs", action="store_false",
                     help="skip the second request per example that scores the gold answer's "
                          "mean log-prob (teacher-forced through the policy)")
    run.add_argument("--reserved-cpus", default="1",
                     help="VLLM_CPU_NUM_OF_RESERVED_CPU for each server ('' = vLLM's choice)")
    run.add_argument("--prefill-ms-per-token", type=float, default=3.5,
                     help="for the cost estimate")
    run.add_argument("--estimate-only", action="store_true",
                     help="print the plan and its cost estimate, run nothing")
    run.add_argument("--no-progress", action="store_true")

    rep = sub.add_parser("report", help="table.md and pareto.png from a results file")
    rep.add_argument("--results", type=Path, default=DEFAULT_OUT / "results.jsonl")
    rep.add_argument("--out-dir", type=Path, default=DEFAULT_OUT)
    rep.add_argument("--replicates", type=int, default=1000)
    rep.add_argument("--seed", type=int, default=0)

    base = sub.add_parser("baseline", help="full-attention scores with transformers (fp32)")
    add_example_args(base)
    base.add_argument("--threads", type=int, default=1)

    show = sub.add_parser("show", help="print one generated example")
    show.add_argument("task", choices=sorted(TASKS))
    show.add_argument("--length", type=int, default=2048)
    show.add_argument("--index", type=int, default=0)
    show.add_argument("--seed", type=int, default=0)
    show.add_argument("--model", default=None)
    return ap


def model_dir(arg: str | None) -> str:
    if arg:
        return arg

    return str(ensure_bundled_model())


def cmd_run(args) -> int:

    spec = preset(args.preset, args.tasks or DEFAULT_TASKS, lengths=args.lengths,
                  per_category=args.per_category, chunks=args.chunks, methods=args.methods,
                  evictions=args.evictions, head_sparsities=args.head_sparsities,
                  token_sparsities=args.token_sparsities,
                  hybrid_token_sparsities=args.hybrid_token_sparsities, bisect=args.bisect,
                  seed=args.seed)
    spec = with_masks(spec, args.mask)
    out_dir = args.out_dir or (Path("/tmp/kvevict-eval-smoke") if args.preset == "smoke"
                               else DEFAULT_OUT)
    model = model_dir(args.model)
    builder = PromptBuilder(load_tokenizer(model))
    examples = make_examples(builder, spec.tasks, spec.lengths, spec.per_category, spec.seed)
    categories = len({e.category for e in examples})
    cost = CostModel(prefill_s_per_token=args.prefill_ms_per_token / 1000)
    shapes = [(e.length, e.max_tokens) for e in examples]
    if args.logprobs:  # the gold answer's log-prob: one more prefill per example
        shapes += [(e.length + len(e.gold_ids), 1) for e in examples]
    full, worst = estimate(spec, shapes, categories, cost)
    print(f"grid: tasks {','.join(spec.tasks)}; lengths {spec.lengths}; {spec.per_category} "
          f"per category and length = {len(examples)} examples per setting; chunks {spec.chunks}; "
          f"methods {','.join(spec.methods)}; bisection {'on' if spec.bisect else 'off'}")
    print(f"estimate, every candidate: {full.servers} server starts, {full.requests} requests, "
          f"{full.prompt_tokens / 1e6:.2f} M prompt tokens, {full.seconds / 3600:.2f} h")
    if spec.bisect:
        print(f"estimate, bisection worst case: {worst.servers} server starts, {worst.requests} "
              f"requests, {worst.seconds / 3600:.2f} h")
    print(f"(cost model: {cost.prefill_s_per_token * 1000:.1f} ms per prompt token, "
          f"{cost.decode_s_per_token * 1000:.0f} ms per generated token, "
          f"{cost.server_start_s:.0f} s per server start)")
    if args.estimate_only:
        return 0
    store = ResultStore(out_dir / "results.jsonl")
    runner = Runner(spec, examples, store, model, out_dir / "logs",
                    concurrency=args.concurrency, kv_cache_bytes=args.kv_cache_memory_bytes,
                    reserved_cpus=args.reserved_cpus, progress=not args.no_progress,
                    logprobs=args.logprobs)
    (out_dir / "command.txt").write_text("python -m vllm_kvevict.evaluation "
                                         + shlex.join(sys.argv[1:]) + "\n")
    # `kill` unwinds as Ctrl-C does (a background run ignores Ctrl-C): the server this run
    # started is stopped, not orphaned; the results so far are already on disk.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    start = time.monotonic()
    runner.run()
    took = time.monotonic() - start
    print(f"done in {took / 60:.1f} min: {runner.requests_run} requests run, "
          f"{runner.server_starts} server starts; results {store.path}")
    for length, secs in sorted(runner.request_seconds.items()):
        print(f"  {length}-token prompts: {sum(secs) / len(secs):.1f} s per request "
              f"(mean of {len(secs)})")
    return 0


def cmd_report(args) -> int:

    command = None
    cmd_file = args.results.parent / "command.txt"
    if cmd_file.is_file():
        command = cmd_file.read_text().strip()
    table, plot = report(args.results, args.out_dir, args.replicates, args.seed, command)
    print(table.read_text())
    print(f"wrote {table} and {plot}")
    return 0


def cmd_baseline(args) -> int:

    model = model_dir(args.model)
    tokenizer = load_tokenizer(model)
    examples = make_examples(PromptBuilder(tokenizer), args.tasks or DEFAULT_TASKS,
                             args.lengths or (2048,), args.per_category or 8, args.seed)
    hf = load_model(model, args.threads)
    by_cell: dict[tuple[str, int], list[float]] = {}
    for row in score_examples(hf, tokenizer, examples):
        ex = row.example
        print(f"{ex.key}: {row.score:.2f} expected {list(ex.answers)} got {row.prediction!r} "
              f"({row.seconds:.1f} s)", flush=True)
        by_cell.setdefault((ex.task, ex.length), []).append(row.score)
    print("\n| task | length | examples | full-attention score (%) |\n|---|---:|---:|---:|")
    for (task, length), scores in by_cell.items():
        print(f"| {task} | {length} | {len(scores)} | {100 * sum(scores) / len(scores):.0f} |")
    return 0


def cmd_show(args) -> int:

    tokenizer = load_tokenizer(model_dir(args.model))
    ex = make_example(PromptBuilder(tokenizer), args.task, args.length, args.index, args.seed)
    print(tokenizer.decode(list(ex.prompt_ids)))
    print(f"\n--- {ex.key}: {len(ex.prompt_ids)} tokens, answers {list(ex.answers)}, "
          f"scorer {ex.scorer}, max_tokens {ex.max_tokens}, {ex.padding} padding tokens")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return {"run": cmd_run, "report": cmd_report, "baseline": cmd_baseline,
            "show": cmd_show}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
