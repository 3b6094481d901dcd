"""CLI: compare KV policies under load, one vLLM server per policy, same pool and workload.

    python -m loadtest.compare --model PATH --policies full prulong:0.7 \\
        pyramidkv:0.7:patched snapkv:0.7:patched --kv-cache-memory-bytes 2000000000 \\
        --max-num-batched-tokens 2048 --concurrency 1,4,8,16 --workload rag \\
        --num-requests 32 --out-dir docs/results/loadtest

For each policy: start the server, wait for /health, send one warm-up request, run the workload
at every concurrency level, stop the server. Level i uses prompt seed `seed + i`, the same for
every policy, so policies see identical prompts while a level never re-sends the previous
level's prompts (which vLLM's prefix cache would answer without prefill).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path
from typing import Any, Callable

from loadtest.plots import plot_all
from loadtest.report import comparison_markdown, format_table, write_json
from loadtest.run import add_workload_args, load_tokenizer, run_once
from loadtest.runner import LoadSettings, run
from vllm_kvevict.launch import (VLLM, PolicySpec, ServerProcess, build_server_command,
                                  parse_policy, port_in_use)
from loadtest.workloads import Shape, build_prompts, make_shapes

HOST = "127.0.0.1"  # the comparison's servers are always local


def parse_levels(text: str) -> list[int]:
    levels = [int(x) for x in text.split(",") if x.strip()]
    if not levels or min(levels) < 1:
        raise ValueError(f"concurrency list must be positive integers, got {text!r}")
    return levels


def warm_up(tokenizer, base_url: str, model: str, timeout_s: float) -> str:
    """One short request so first-request costs (lazy init, allocation) stay out of the runs."""
    prompts = build_prompts(tokenizer, [Shape("warmup", 16, 4)], 1, seed=2**31 - 1)
    settings = LoadSettings(base_url=base_url, model=model, concurrency=1,
                            max_duration_s=timeout_s, scrape_metrics=False, progress=False)
    return run(prompts, settings).results[0].outcome


def run_comparison(*, policies: list[PolicySpec], levels: list[int], model: str, tokenizer,
                   shapes: list[Shape], num_requests: int, seed: int, out_dir: Path,
                   kv_cache_bytes: int, max_batched_tokens: int, port: int = 8000,
                   max_duration_s: float = 300.0, request_timeout_s: float | None = None,
                   ignore_eos: bool = True, scrape_metrics: bool = True, progress: bool = True,
                   health_timeout_s: float = 900.0, stop_timeout_s: float = 60.0,
                   extra_server_args: tuple[str, ...] = (), executable: str = VLLM,
                   command_fn: Callable[..., list[str]] = build_server_command,
                   extra_config: dict[str, Any] | None = None,
                   requests_per_level: list[int] | None = None,
                   server_env: dict[str, str] | None = None,
                   overlong_tokens: int | None = None,
                   probes: dict[str, dict] | None = None,
                   ) -> tuple[dict[str, dict[int, dict]], dict[str, str]]:
    """Run every policy at every level; returns (runs[label][level] = result, failures).

    `requests_per_level[i]` replaces `num_requests` at level i. With `overlong_tokens`, one
    request of that many prompt tokens is sent after the levels (a prompt longer than the
    context must come back as a clean 4xx: `rejected`, not `failed`); its result goes to
    `probes[label]`."""
    base_url = f"http://{HOST}:{port}"
    runs: dict[str, dict[int, dict]] = {}
    failures: dict[str, str] = {}
    for spec in policies:
        if port_in_use(HOST, port):
            raise RuntimeError(f"port {port} is already in use; stop that server or pass --port")
        argv = command_fn(model, spec, kv_cache_bytes=kv_cache_bytes,
                          max_batched_tokens=max_batched_tokens, host=HOST, port=port,
                          extra_args=extra_server_args, executable=executable)
        print(f"== {spec.label}: {' '.join(argv)}", flush=True)
        with ServerProcess(argv, out_dir / f"server_{spec.slug}.log", env=server_env) as server:
            try:
                took = server.wait_healthy(base_url, health_timeout_s)
            except (RuntimeError, TimeoutError) as exc:
                print(f"!! {spec.label}: {exc}", file=sys.stderr)
                failures[spec.label] = str(exc).splitlines()[0]
                continue
            print(f"   healthy after {took:.1f} s; warm-up: "
                  f"{warm_up(tokenizer, base_url, model, min(max_duration_s, 120.0))}")
            runs[spec.label] = {}
            for i, level in enumerate(levels):
                settings = LoadSettings(
                    base_url=base_url, model=model, concurrency=level,
                    max_duration_s=max_duration_s, request_timeout_s=request_timeout_s,
                    ignore_eos=ignore_eos, arrival_seed=seed + i, server_pid=server.pid,
                    scrape_metrics=scrape_metrics, progress=progress)
                count = requests_per_level[i] if requests_per_level else num_requests
                result = run_once(tokenizer, shapes, count, seed + i, settings,
                                  {**(extra_config or {}), "policy": spec.label,
                                   "server_argv": argv})
                write_json(result, out_dir / f"{spec.slug}_c{level}.json")
                print(format_table(result), flush=True)
                runs[spec.label][level] = result
            if overlong_tokens:
                probe = [Shape("overlong", overlong_tokens, 4)]
                settings = LoadSettings(base_url=base_url, model=model, concurrency=1,
                                        max_duration_s=120.0, scrape_metrics=False,
                                        progress=False)
                result = run_once(tokenizer, probe, 1, seed, settings,
                                  {**(extra_config or {}), "policy": spec.label,
                                   "server_argv": argv})
                write_json(result, out_dir / f"{spec.slug}_overlong.json")
                print(f"   {overlong_tokens}-token prompt: {result['requests']} "
                      f"{result['errors']}", flush=True)
                if probes is not None:
                    probes[spec.label] = result
            server.stop(stop_timeout_s)
    return runs, failures


def write_outputs(runs: dict[str, dict[int, dict]], failures: dict[str, str], out_dir: Path,
                  notes: list[str]) -> list[Path]:
    """summary.md (side-by-side tables), summary.json (results without per-request rows), PNGs."""
    notes = notes + [f"- **{p}**: server failed: {why}" for p, why in failures.items()]
    md = comparison_markdown(runs, "KV policy comparison under load", notes)
    (out_dir / "summary.md").write_text(md)
    compact = {p: {str(c): {k: v for k, v in r.items() if k != "per_request"}
                   for c, r in per.items()} for p, per in runs.items()}
    (out_dir / "summary.json").write_text(
        json.dumps({"runs": compact, "failures": failures}, indent=2) + "\n")
    paths = [out_dir / "summary.md", out_dir / "summary.json"]
    if runs:
        paths += plot_all(runs, out_dir)
    return paths


def load_runs(out_dir: Path, policies: list[PolicySpec], levels: list[int]):
    """(runs, probes) from the JSON files a comparison wrote; missing files are skipped."""
    runs: dict[str, dict[int, dict]] = {}
    probes: dict[str, dict] = {}
    for spec in policies:
        for level in levels:
            path = out_dir / f"{spec.slug}_c{level}.json"
            if path.exists():
                runs.setdefault(spec.label, {})[level] = json.loads(path.read_text())
        path = out_dir / f"{spec.slug}_overlong.json"
        if path.exists():
            probes[spec.label] = json.loads(path.read_text())
    return runs, probes


def probe_notes(probes: dict[str, dict]) -> list[str]:
    notes = []
    for label, result in probes.items():
        tokens = result["config"]["shapes"][0]["input_len"]
        notes.append(f"- {label}: one {tokens}-token prompt (longer than the context): "
                     f"{result['requests']['rejected']} rejected (4xx), "
                     f"{result['requests']['failed']} failed; errors {result['errors']}")
    return notes


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest.compare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(p)
    p.add_argument("--policies", nargs="+", required=True,
                   help="POLICY[:SPARSITY[:EVICTION]] each, e.g. full prulong:0.7 "
                        "pyramidkv:0.7:patched")
    p.add_argument("--kv-cache-memory-bytes", type=int, required=True,
                   help="KV pool size, the same for every policy")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--concurrency", default="1,4,8,16", help="comma-separated levels")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--out-dir", default="docs/results/loadtest")
    p.add_argument("--health-timeout", type=float, default=900.0,
                   help="seconds to wait for a server's /health")
    p.add_argument("--stop-timeout", type=float, default=60.0,
                   help="seconds between SIGTERM and SIGKILL when stopping a server")
    p.add_argument("--server-arg", action="append", default=[],
                   help="extra `vllm serve` argument, repeatable "
                        "(e.g. --server-arg=--max-model-len --server-arg=8192)")
    p.add_argument("--vllm", default=VLLM, help="vllm executable")
    p.add_argument("--requests-per-level", help="comma-separated request counts, one per "
                                                "concurrency level (replaces --num-requests)")
    p.add_argument("--server-env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment of every server (repeatable), e.g. "
                        "VLLM_CPU_NUM_OF_RESERVED_CPU=1")
    p.add_argument("--report-only", action="store_true",
                   help="start nothing: rebuild summary.md, summary.json and the plots from the "
                        "<policy>_c<level>.json files already in --out-dir (e.g. after "
                        "re-running one policy)")
    p.add_argument("--overlong-tokens", type=int,
                   help="after the levels, send one prompt of this many tokens (longer than "
                        "the context) and record its outcome")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        policies = [parse_policy(p) for p in args.policies]
        levels = parse_levels(args.concurrency)
        per_level = parse_levels(args.requests_per_level) if args.requests_per_level else None
        if per_level and len(per_level) != len(levels):
            raise ValueError("--requests-per-level needs one count per concurrency level")
        server_env = dict(kv.split("=", 1) for kv in args.server_env)
        shapes = make_shapes(args.workload, args.input_len, args.output_len, args.rag_fraction)
    except ValueError as exc:
        parser.error(str(exc))
    tokenizer_path = args.tokenizer or args.model
    try:
        tokenizer = load_tokenizer(tokenizer_path)
    except (OSError, ValueError) as exc:
        parser.error(f"cannot load tokenizer from {tokenizer_path!r}: {exc}")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.report_only:
        runs, probes = load_runs(out_dir, policies, levels)
        notes = [f"- rebuilt from the run files in `{out_dir}`; commands and settings: each "
                 "file's `config` (`server_argv`, lengths, counts)"]
        notes += probe_notes(probes)
        for path in write_outputs(runs, {}, out_dir, notes):
            print(f"wrote {path}")
        return 0
    probes: dict[str, dict] = {}
    runs, failures = run_comparison(
        policies=policies, levels=levels, model=args.model, tokenizer=tokenizer, shapes=shapes,
        num_requests=args.num_requests, seed=args.seed, out_dir=out_dir,
        kv_cache_bytes=args.kv_cache_memory_bytes,
        max_batched_tokens=args.max_num_batched_tokens, port=args.port,
        max_duration_s=args.max_duration, request_timeout_s=args.request_timeout,
        ignore_eos=args.ignore_eos, scrape_metrics=args.scrape_metrics, progress=args.progress,
        health_timeout_s=args.health_timeout, stop_timeout_s=args.stop_timeout,
        extra_server_args=tuple(args.server_arg), executable=args.vllm,
        extra_config={"workload": args.workload, "tokenizer": tokenizer_path},
        requests_per_level=per_level, server_env=server_env or None,
        overlong_tokens=args.overlong_tokens, probes=probes)
    shape_text = ", ".join(f"{s.kind} {s.input_len} in / {s.output_len} out"
                           + (f" ({100 * s.weight:.0f} %)" if len(shapes) > 1 else "")
                           for s in shapes)
    notes = [f"- date: {dt.date.today().isoformat()}; model `{args.model}`",
             f"- workload `{args.workload}`: {shape_text}; "
             f"{args.requests_per_level or args.num_requests} requests per "
             f"level, max {args.max_duration:g} s, seed {args.seed} (+ level index)",
             f"- command: `python -m loadtest.compare {' '.join(argv or sys.argv[1:])}`",
             f"- KV pool {args.kv_cache_memory_bytes} bytes, max batched tokens "
             f"{args.max_num_batched_tokens}, enforce-eager",
             "- failures = failed + cancelled; latency percentiles over successful requests"]
    notes += probe_notes(probes)
    for path in write_outputs(runs, failures, out_dir, notes):
        print(f"wrote {path}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
