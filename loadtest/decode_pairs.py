"""Decode against its limit, with stock vLLM and a policy measured in alternation.

    python -m loadtest.decode_pairs --policy prulong:0.7@b64 --rounds 6 \
        --out-dir docs/results/limits/pairs                 # resumable: one JSON line per round

Why alternation: on this machine the same decode step's time drifts within a minute (the
MLP's gate/up product of one stock process took 4.84, 3.87, 3.72 ms per step in three
`generate` calls in a row, `scripts/decode_profile.py --linear --repeat 3`), so a stock server measured minutes before the policy's
moves the ratio by more than the 10 % the limit is judged by. Here both servers stay up (the
idle one's engine waits on its input queue), every prompt is sent once to warm the prefix cache
(so a round costs decode only), and each round measures, in the order stock-policy or
policy-stock (alternating between rounds):
- stock: TPOT of one `--short-input-len` and one `--input-len` prompt, and the batch-B step at
  `--short-input-len` and `--batch-input-len` (median gap while all B decode, as
  `loadtest.limits`);
- the policy: TPOT at `--input-len` and the batch-B step at `--batch-input-len`.
A round's limit is `loadtest.limits`' (stock's c0 + k x the KV bytes the policy's requests hold
at their last step, both fitted on that round's stock runs), so a drift that slows both servers
moves the measurement and its limit together. The report is every round's measured / limit and
the median over rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import numpy as np

from loadtest.limits import (_send_all, batch_window, full_bytes, launch, line_through,
                             model_bytes, prompts_of)
from vllm_kvevict.launch import STOCK

STOCK_BLOCK = 128  # vLLM's CPU default block size: stock's KV bytes in the fit


def measure(base: str, prompts: dict, stock: bool) -> dict:
    run = lambda ps: asyncio.run(_send_all(base, ps))  # noqa: E731
    out = {}
    b1 = run(prompts["b1"])[0]
    out["b1_tpot_s"] = float(np.median(b1.itl_s))
    out["b1_kv_bytes_end"] = (b1.kv_stats or {}).get("kv_bytes_end")
    bb = run(prompts["batch"])
    out["batch_step_s"] = batch_window(bb)["step_s"]
    out["batch_kv_bytes_end"] = (sum(r.kv_stats["kv_bytes_end"] for r in bb)
                                 if all(r.kv_stats for r in bb) else None)
    if stock:
        out["short_b1_tpot_s"] = float(np.median(run(prompts["short"])[0].itl_s))
        out["short_batch_step_s"] = batch_window(run(prompts["short_batch"]))["step_s"]
    return out


def round_ratios(s: dict, p: dict, args, per_tok: int, block: int) -> dict:
    """measured / limit at batch 1 and batch B for one round (`loadtest.limits.analyse`)."""
    out_len = args.output_len
    x1 = [full_bytes(args.short_input_len + out_len, block, per_tok),
          full_bytes(args.input_len + out_len, block, per_tok)]
    xB = [args.batch * x for x in (full_bytes(args.short_input_len + out_len, block, per_tok),
                                   full_bytes(args.batch_input_len + out_len, block, per_tok))]
    res = {}
    for key, xs, ys, mine, held in [
            ("b1", x1, [s["short_b1_tpot_s"], s["b1_tpot_s"]], p["b1_tpot_s"],
             p["b1_kv_bytes_end"]),
            ("batch", xB, [s["short_batch_step_s"], s["batch_step_s"]], p["batch_step_s"],
             p["batch_kv_bytes_end"])]:
        c0, k = line_through(xs, ys)
        limit = c0 + k * held
        res[key] = {"x_stock": mine / ys[1], "limit_x_stock": limit / ys[1],
                    "measured_over_limit": mine / limit}
    return res


def report(rows: list[dict], args) -> list[str]:
    lines = [f"`python -m loadtest.decode_pairs --policy {args.policy} --rounds {args.rounds}` "
             f"(stock vLLM and the policy both up, measured in alternation; eager, float32, "
             f"{args.kv_cache_memory_bytes >> 20} MiB pools, batch 1 at {args.input_len} tokens, "
             f"batch {args.batch} at {args.batch_input_len}, {args.output_len} generated, "
             f"VLLM_CPU_NUM_OF_RESERVED_CPU={args.reserved_cpus}), {time.strftime('%Y-%m-%d')}",
             "", f"| round | order | stock TPOT b1 (ms) | policy (ms) | x stock | limit | "
             f"meas./limit | stock step b{args.batch} (ms) | policy (ms) | x stock | limit | "
             f"meas./limit |", "|---|---|" + "---|" * 10]
    for r in rows:
        s, p, q = r["stock"], r["policy"], r["ratios"]
        lines.append(
            f"| {r['round']} | {r['order']} | {s['b1_tpot_s'] * 1e3:.1f} | "
            f"{p['b1_tpot_s'] * 1e3:.1f} | {q['b1']['x_stock']:.2f} | "
            f"{q['b1']['limit_x_stock']:.2f} | {q['b1']['measured_over_limit']:.2f} | "
            f"{s['batch_step_s'] * 1e3:.1f} | {p['batch_step_s'] * 1e3:.1f} | "
            f"{q['batch']['x_stock']:.2f} | {q['batch']['limit_x_stock']:.2f} | "
            f"{q['batch']['measured_over_limit']:.2f} |")
    med = {k: statistics.median(r["ratios"][k]["measured_over_limit"] for r in rows)
           for k in ("b1", "batch")}
    lines += ["", f"Median over {len(rows)} rounds, measured / limit: batch 1 "
              f"{med['b1']:.2f}, batch {args.batch} {med['batch']:.2f}."]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policy", default="prulong:0.7@b64")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--input-len", type=int, default=7000)
    ap.add_argument("--batch-input-len", type=int, default=4000)
    ap.add_argument("--short-input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=3 << 30)
    ap.add_argument("--ports", type=int, nargs=2, default=[8126, 8127])
    ap.add_argument("--reserved-cpus", default="1")
    ap.add_argument("--out-dir", type=Path, default=Path("docs/results/limits/pairs"))
    ap.add_argument("--report-only", action="store_true")
    args = ap.parse_args()
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from vllm_kvevict.model import ensure_bundled_model

    model = str(ensure_bundled_model())
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / f"{args.policy.replace(':', '-')}.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    if not args.report_only and len(rows) < args.rounds:
        _, per_tok = model_bytes(model)
        tok = AutoTokenizer.from_pretrained(model)
        rng = np.random.default_rng(0)  # the same prompts for both servers and every round
        prompts = {"b1": prompts_of(tok, rng, 1, args.input_len, args.output_len, "b1"),
                   "batch": prompts_of(tok, rng, args.batch, args.batch_input_len,
                                       args.output_len, "batch"),
                   "short": prompts_of(tok, rng, 1, args.short_input_len, args.output_len,
                                       "short"),
                   "short_batch": prompts_of(tok, rng, args.batch, args.short_input_len,
                                             args.output_len, "short-batch")}
        names = {"stock": STOCK, "policy": args.policy}
        bases = {k: f"http://127.0.0.1:{port}" for k, port in zip(names, args.ports)}
        servers = {}
        try:
            for (k, text), port in zip(names.items(), args.ports):  # one start at a time
                servers[k] = launch(text, args, model, port,
                                    args.out_dir / "logs" / f"{k}_{text.replace(':', '-')}.log")
                servers[k].wait_healthy(bases[k])
                measure(bases[k], prompts, stock=k == "stock")  # warms the prefix cache
            for i in tqdm(range(len(rows), args.rounds), desc="rounds"):
                order = ["stock", "policy"] if i % 2 == 0 else ["policy", "stock"]
                got = {k: measure(bases[k], prompts, stock=k == "stock") for k in order}
                row = {"round": i, "order": "-".join(order), **got,
                       "ratios": round_ratios(got["stock"], got["policy"], args, per_tok,
                                              STOCK_BLOCK)}
                rows.append(row)
                with path.open("a") as f:
                    f.write(json.dumps(row) + "\n")
        finally:
            for s in servers.values():
                s.stop()
    lines = report(rows, args)
    (args.out_dir / f"{args.policy.replace(':', '-')}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
