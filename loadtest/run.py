"""CLI: one load test against a running OpenAI-compatible server.

    python -m loadtest.run --base-url http://127.0.0.1:8000 --model NAME --tokenizer PATH \\
        --workload rag --input-len 7000 --output-len 64 --concurrency 4 --num-requests 16 \\
        --max-duration 300 --seed 0 --out results.json

Prints a table, writes the JSON result with --out; --cross-check also runs `vllm bench serve`
with the same load and compares throughput.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from loadtest import crosscheck
from loadtest.loopback import RemoteURLError, check_base_url
from loadtest.report import build_result, format_table, write_json
from loadtest.runner import LoadSettings, run
from loadtest.workloads import WORKLOADS, Shape, build_prompts, make_shapes
from vllm_kvevict.launch import VLLM


def load_tokenizer(path: str):
    """The served model's tokenizer from a local path (never downloaded)."""
    from transformers import AutoTokenizer  # slow import; only when a run needs it

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def run_once(tokenizer, shapes: list[Shape], num_requests: int, seed: int,
             settings: LoadSettings, extra_config: dict[str, Any] | None = None) -> dict:
    """Build the prompts, run the load, and return the JSON-ready result."""
    prompts = build_prompts(tokenizer, shapes, num_requests, seed)
    data = run(prompts, settings)
    config = {**(extra_config or {}),
              "shapes": [dataclasses.asdict(s) for s in shapes],
              "num_requests": num_requests, "seed": seed,
              **{k: v for k, v in dataclasses.asdict(settings).items() if k != "progress"}}
    return build_result(config, data)


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """Workload and bound flags, shared with loadtest.compare."""
    p.add_argument("--model", required=True, help="model name as the server serves it")
    p.add_argument("--tokenizer", help="local path of the served model's tokenizer "
                                       "(default: --model, if that is a local path)")
    p.add_argument("--workload", choices=WORKLOADS, default="rag",
                   help="rag: long prompt/short answer; cot: short prompt/long answer; "
                        "mix: each request rag or cot")
    p.add_argument("--input-len", type=int, help="prompt tokens (mix: of the rag requests)")
    p.add_argument("--output-len", type=int, help="answer tokens (mix: of the cot requests)")
    p.add_argument("--rag-fraction", type=float, default=0.5, help="mix: share of rag requests")
    p.add_argument("--num-requests", type=int, default=16, help="request bound of a run")
    p.add_argument("--max-duration", type=float, default=300.0,
                   help="wall-clock bound of a run in seconds; requests still running then "
                        "are cancelled")
    p.add_argument("--request-timeout", type=float,
                   help="seconds one request may take before it counts as failed "
                        "(default: --max-duration)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let the model stop at EOS (output lengths then vary)")
    p.add_argument("--no-metrics", dest="scrape_metrics", action="store_false",
                   help="do not scrape the server's /metrics")
    p.add_argument("--no-progress", dest="progress", action="store_false")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest.run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--allow-remote", action="store_true",
                   help="allow a base URL that is not loopback (127.0.0.0/8, localhost, ::1)")
    add_workload_args(p)
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, help="requests in flight (default 1)")
    load.add_argument("--rate", type=float, help="Poisson arrivals per second")
    p.add_argument("--server-pid", type=int, help="sample RSS of this PID and its children")
    p.add_argument("--out", help="write the JSON result here")
    p.add_argument("--cross-check", action="store_true",
                   help="then run `vllm bench serve` with the same load and compare throughput")
    p.add_argument("--tolerance", type=float, default=0.10, help="cross-check tolerance")
    p.add_argument("--vllm", default=VLLM, help="vllm executable for --cross-check")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        base_url = check_base_url(args.base_url, args.allow_remote)
        shapes = make_shapes(args.workload, args.input_len, args.output_len, args.rag_fraction)
        settings = LoadSettings(
            base_url=base_url, model=args.model,
            concurrency=None if args.rate else (args.concurrency or 1), rate=args.rate,
            max_duration_s=args.max_duration, request_timeout_s=args.request_timeout,
            ignore_eos=args.ignore_eos, arrival_seed=args.seed, server_pid=args.server_pid,
            scrape_metrics=args.scrape_metrics, progress=args.progress)
    except (RemoteURLError, ValueError) as exc:
        parser.error(str(exc))
    if args.num_requests < 1:
        parser.error("--num-requests must be >= 1")
    if args.cross_check and len(shapes) != 1:
        parser.error("--cross-check needs a fixed-shape workload (rag or cot), not mix")
    tokenizer_path = args.tokenizer or args.model
    try:
        tokenizer = load_tokenizer(tokenizer_path)
    except (OSError, ValueError) as exc:
        parser.error(f"cannot load tokenizer from {tokenizer_path!r}: {exc}")
    result = run_once(tokenizer, shapes, args.num_requests, args.seed, settings,
                      {"workload": args.workload, "tokenizer": tokenizer_path})
    print(format_table(result))
    status = 0
    if args.cross_check:
        argv_bench = crosscheck.bench_serve_command(
            base_url=base_url, model=args.model, tokenizer=tokenizer_path,
            input_len=shapes[0].input_len, output_len=shapes[0].output_len,
            num_prompts=args.num_requests, concurrency=settings.concurrency, rate=args.rate,
            seed=args.seed, ignore_eos=args.ignore_eos, executable=args.vllm)
        check = crosscheck.compare_throughput(
            result["throughput"], crosscheck.run_bench_serve(argv_bench), args.tolerance)
        result["cross_check"] = {"argv": argv_bench, **check}
        print(crosscheck.format_comparison(check))
        status = 0 if check["within_tolerance"] else 1
    if args.out:
        write_json(result, args.out)
        print(f"wrote {args.out}")
    return status


if __name__ == "__main__":
    sys.exit(main())
