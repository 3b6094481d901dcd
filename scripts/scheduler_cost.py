"""The scheduler's cost per decode step (issue 71): stock vLLM, a head mask with vLLM's
per-group path (`--per-group`) and with quiet steps (`integration/core/kv_cache_coordinator.py`),
one process each (`scripts/decode_profile.py`, one thread), in alternating rounds.

    python scripts/scheduler_cost.py --rounds 3 --batch 8 --prompt 2000 --new 40 --out FILE.md
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

ap = argparse.ArgumentParser()
ap.add_argument("--rounds", type=int, default=3)
ap.add_argument("--batch", type=int, default=8)
ap.add_argument("--prompt", type=int, default=2000)
ap.add_argument("--new", type=int, default=40)
ap.add_argument("--policy", default="prulong:0.7")
ap.add_argument("--out", type=Path)
args = ap.parse_args()
HERE = Path(__file__).resolve().parent
COMMON = [str(args.batch), str(args.prompt), str(args.new), "--prefix-caching", "--repeat", "2"]
# the policy at the layout its defaults choose (features.fast_layout): 64 / 128
LAYOUT = ["--block-size", "64", "--full-block-size", "128"]
VARIANTS = {"stock": ["--policy", "stock"],
            "per-group": ["--policy", args.policy, *LAYOUT, "--per-group"],
            "quiet": ["--policy", args.policy, *LAYOUT]}
rows = {name: [] for name in VARIANTS}
for r in range(args.rounds):
    order = list(VARIANTS) if r % 2 == 0 else list(reversed(VARIANTS))
    for name in order:
        out = subprocess.run([sys.executable, str(HERE / "decode_profile.py"), *COMMON, *VARIANTS[name]],
                             capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        found = re.findall(r"engine step ([\d.]+) ms/step: schedule ([\d.]+), update_from_output ([\d.]+)", out.stdout)
        if not found:
            sys.exit(f"{name}: no result\n{out.stderr[-3000:]}")
        step, sched, update = map(float, found[-1])  # the second generation: warm
        rows[name].append((sched, update, step))
        print(f"round {r} {name}: schedule {sched:.2f} ms, update_from_output {update:.2f} ms, engine step {step:.1f} ms", flush=True)
lines = [f"batch {args.batch}, {args.prompt}-token prompts, {args.new} new tokens, prefix caching on, one thread, "
         f"{args.rounds} alternating rounds (median; each round's second generation in its process)", "",
         "| variant | schedule (ms/step) | update_from_output (ms/step) | scheduler total | x stock | engine step (ms) |",
         "|---|---:|---:|---:|---:|---:|"]
med = {n: [statistics.median(c) for c in zip(*v)] for n, v in rows.items()}
base = med["stock"][0] + med["stock"][1]
for name, (sched, update, step) in med.items():
    label = "stock" if name == "stock" else f"{args.policy} {name}"
    lines.append(f"| {label} | {sched:.2f} | {update:.2f} | {sched + update:.2f} | {(sched + update) / base:.2f} | {step:.1f} |")
text = "\n".join(lines)
print(text)
if args.out:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")
