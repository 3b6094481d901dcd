"""The policies issue's full correctness matrix: every policy served by `vllm serve` (through the
OpenAI API) against the independent plain-PyTorch reference, at head/token sparsity 0.3 and 0.7,
prefill chunks of 256 and 1024 tokens, on real-text prompts of 1K-4K tokens.

    python scripts/policy_matrix.py --out-dir docs/results/policy_matrix            # everything
    python scripts/policy_matrix.py --part served ...     # only the servers' answers
    python scripts/policy_matrix.py --part reference ...  # only the reference (another core)
    python scripts/policy_matrix.py --part report ...     # compare and write summary.md
    python scripts/policy_matrix.py --model DIR --mask GATES.json ...  # another model

Each policy sees `--prompts-per-policy` (default 20) distinct prompts, spread evenly over its
(sparsity, chunk) cells; `--prompts-per-cell N` instead runs N prompts in every cell.
Prompts are sent one at a time, so vLLM chunks them exactly every `chunk` tokens; the report
still checks that the served chunk boundaries (from `kv_stats`) are the ones the reference used.
Both parts append to JSONL files and skip what is already there (resumable).
A cell passes when every prompt's greedy tokens are identical and the first generated token's
log-prob differs by less than `--logprob-tol`.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SERVED_NAME = "smollm2"


@dataclass(frozen=True)
class Cell:
    policy: str
    sparsity: float | None
    eviction: str | None
    chunk: int

    @property
    def name(self) -> str:
        parts = [self.policy]
        if self.sparsity is not None:
            parts.append(f"{self.sparsity:g}")
        if self.eviction:
            parts.append(self.eviction)
        return ":".join(parts) + f"@{self.chunk}"

    @property
    def policy_name(self) -> str:
        return self.policy + (f":{self.eviction}" if self.eviction else "")

    def policy_dict(self) -> dict:
        d = {"policy": self.policy}
        if self.sparsity is not None:
            d["sparsity"] = self.sparsity
        if self.eviction:
            d["eviction"] = self.eviction
        return d

    def server_key(self) -> tuple:
        """Cells that one server can answer: token-eviction sparsity is a per-request override."""
        per_request = self.policy in ("snapkv", "pyramidkv")
        return (self.policy, None if per_request else self.sparsity, self.eviction, self.chunk)


def build_cells(sparsities, chunks) -> list[Cell]:
    cells = []
    for chunk in chunks:
        cells.append(Cell("full", None, None, chunk))
        cells.append(Cell("streaming", None, None, chunk))
        for policy in ("duo", "prulong"):
            cells += [Cell(policy, s, None, chunk) for s in sparsities]
        for policy in ("snapkv", "pyramidkv"):
            for eviction in ("naive", "patched"):
                cells += [Cell(policy, s, eviction, chunk) for s in sparsities]
    return cells


def prompt_pool(tokenizer, count: int, lo: int, hi: int) -> list[list[int]]:
    """`count` distinct real-text prompts (this Python's standard library sources), lengths
    spread evenly over [lo, hi] tokens."""
    files = sorted(glob.glob(str(Path(sys.base_prefix) / "lib" / "python3.11" / "*.py")))
    files = [f for f in files if Path(f).stat().st_size > 4000][:count]
    lengths = [round(lo + (hi - lo) * i / max(count - 1, 1)) for i in range(count)]
    prompts = []
    for path, n in zip(files, lengths):
        ids = tokenizer(Path(path).read_text(errors="replace"))["input_ids"]
        while len(ids) < n:
            ids = ids + ids
        prompts.append(ids[:n])
    return prompts


def assign_prompts(cells, pool_size: int, per_policy: int, per_cell: int | None):
    """(cell, prompt index) pairs: a policy's prompts go round its cells, so its cells together
    see `per_policy` distinct prompts."""
    jobs = []
    by_policy: dict[str, list[Cell]] = {}
    for cell in cells:
        by_policy.setdefault(cell.policy_name, []).append(cell)
    for group in by_policy.values():
        if per_cell:
            jobs += [(c, i % pool_size) for c in group for i in range(per_cell)]
        else:
            jobs += [(group[i % len(group)], i % pool_size) for i in range(per_policy)]
    return jobs


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def append_jsonl(path: Path, row: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")


def server_flags(cell: Cell, mask: str | None = None, attention_backend: str = "cpu") -> list[str]:
    from vllm_kvevict.launch import policy_flags

    policy = {"policy": cell.policy}
    if attention_backend != "cpu":
        policy["attention_backend"] = attention_backend
    if mask and cell.policy in ("duo", "prulong"):
        policy["mask_path"] = mask
    if cell.sparsity is not None and cell.policy not in ("snapkv", "pyramidkv"):
        policy["sparsity"] = cell.sparsity
    if cell.eviction:
        policy["eviction"] = cell.eviction
    return ["--max-num-batched-tokens", str(cell.chunk), *policy_flags(policy)]


def run_served(args, model_dir: str, jobs, prompts, out: Path) -> None:
    import httpx
    from tqdm import tqdm

    from vllm_kvevict.launch import VLLM, ServerProcess, port_in_use

    done = {(r["cell"], r["prompt"]) for r in read_jsonl(out)}
    todo = [(c, i) for c, i in jobs if (c.name, i) not in done]
    groups: dict[tuple, list] = {}
    for cell, i in todo:
        groups.setdefault(cell.server_key(), []).append((cell, i))
    bar = tqdm(total=len(todo), desc="served", unit="prompt")
    port = args.port
    while port_in_use("127.0.0.1", port):
        port += 1
    for key, group in groups.items():
        argv = [VLLM, "serve", model_dir,
                "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port),
                *([] if args.compiled else ["--enforce-eager"]), "--dtype", "float32",
                "--max-model-len", "8192", "--seed", "0",
                "--kv-cache-memory-bytes", str(512 << 20), *server_flags(group[0][0], args.mask,
                                                                      args.attention_backend)]
        log = Path(args.out_dir) / "logs" / f"server_{'_'.join(map(str, key))}.log"
        with ServerProcess(argv, log, env={"VLLM_CPU_NUM_OF_RESERVED_CPU":
                                           str(args.reserved_cpus)}) as server:
            base = f"http://127.0.0.1:{port}"
            server.wait_healthy(base, timeout_s=600)
            with httpx.Client(base_url=base, timeout=900, trust_env=False) as client:
                for cell, i in group:
                    body = {"model": SERVED_NAME, "prompt": prompts[i], "max_tokens": args.new_tokens,
                            "temperature": 0, "logprobs": 1, "return_token_ids": True}
                    if cell.policy in ("snapkv", "pyramidkv"):
                        body["vllm_xargs"] = {"kv_sparsity": cell.sparsity}
                    t0 = time.monotonic()
                    r = client.post("/v1/completions", json=body)
                    r.raise_for_status()
                    data = r.json()
                    choice = data["choices"][0]
                    stats = data.get("kv_stats") or {}
                    append_jsonl(out, {
                        "cell": cell.name, "prompt": i, "prompt_tokens": len(prompts[i]),
                        "token_ids": choice["token_ids"],
                        "first_logprob": choice["logprobs"]["token_logprobs"][0],
                        "chunk_boundaries": stats.get("chunk_boundaries"),
                        "footprint": stats.get("footprint"),
                        "measured_footprint": stats.get("measured_footprint"),
                        "seconds": time.monotonic() - t0})
                    bar.update()
    bar.close()


def reference_boundaries(n: int, chunk: int) -> list[int]:
    return list(range(chunk, n, chunk)) + [n]


def run_reference(args, model_dir: str, jobs, prompts, out: Path) -> None:
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    from vllm_kvevict.config import KVPolicyConfig
    from vllm_kvevict.masks import resolve_full_heads
    from vllm_kvevict.policies import build_policy
    from vllm_kvevict.reference import ReferenceRunner

    if args.threads:
        torch.set_num_threads(args.threads)
    done = {(r["cell"], r["prompt"]) for r in read_jsonl(out)}
    todo = [(c, i) for c, i in jobs if (c.name, i) not in done]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    layers = model.config.num_hidden_layers
    kv_heads = model.config.num_key_value_heads
    for cell, i in tqdm(todo, desc="reference", unit="prompt"):
        policy = cell.policy_dict()
        if args.mask and cell.policy in ("duo", "prulong"):
            policy["mask_path"] = args.mask
        cfg = KVPolicyConfig.from_dict(policy)
        full_heads = mask_path = None
        if cfg.uses_head_mask and cfg.policy != "streaming":
            full_heads, mask_path = resolve_full_heads(cfg, model_dir, layers, kv_heads)
        runner = ReferenceRunner(model, build_policy(cfg, layers, kv_heads,
                                                     full_heads=full_heads))
        t0 = time.monotonic()
        ends = reference_boundaries(len(prompts[i]), cell.chunk)
        ref = runner.generate(prompts[i], args.new_tokens, ends)
        append_jsonl(out, {"cell": cell.name, "prompt": i, "token_ids": ref.token_ids,
                           "first_logprob": float(ref.first_token_logprobs.max()),
                           "chunk_boundaries": ends, "mask": mask_path,
                           "seconds": time.monotonic() - t0})


def report(args, cells, jobs, out_dir: Path) -> int:
    served = {(r["cell"], r["prompt"]): r for r in read_jsonl(out_dir / "served.jsonl")}
    ref = {(r["cell"], r["prompt"]): r for r in read_jsonl(out_dir / "reference.jsonl")}
    rows, failures, missing = [], [], 0
    for cell in cells:
        mine = [i for c, i in jobs if c == cell]
        n = same = bounds_ok = 0
        worst, lengths = 0.0, []
        for i in mine:
            s, r = served.get((cell.name, i)), ref.get((cell.name, i))
            if s is None or r is None:
                missing += 1
                continue
            n += 1
            lengths.append(s["prompt_tokens"])
            ok_tokens = s["token_ids"] == r["token_ids"]
            bounds_ok += s["chunk_boundaries"] == r["chunk_boundaries"]
            delta = abs(s["first_logprob"] - r["first_logprob"])
            worst = max(worst, delta)
            same += ok_tokens
            if not ok_tokens or delta >= args.logprob_tol or \
                    s["chunk_boundaries"] != r["chunk_boundaries"]:
                failures.append(f"{cell.name} prompt {i} ({s['prompt_tokens']} tokens): "
                                f"tokens {'equal' if ok_tokens else 'DIFFER'}, "
                                f"|dlogprob| {delta:.2e}, boundaries "
                                f"{'equal' if s['chunk_boundaries'] == r['chunk_boundaries'] else 'DIFFER'}")
        rows.append((cell, n, same, bounds_ok, worst, lengths))
    lines = ["# Policy matrix: `vllm serve` vs the plain-PyTorch reference", "",
             f"Model: `{Path(args.model).name if args.model else 'SmolLM2-135M-Instruct'}`"
             + (f", head mask `{Path(args.mask).name}`" if args.mask else ""), "",
             f"Command: `python scripts/policy_matrix.py {args.command}`", "",
             f"Greedy, {args.new_tokens} new tokens, float32, prompts sent one at a time; "
             f"log-prob tolerance {args.logprob_tol:g} on the first generated token.", "",
             "| policy | sparsity | chunk | prompts | prompt tokens | identical tokens | "
             "same chunk boundaries | max abs dlogprob |", "|---|---|---|---|---|---|---|---|"]
    for cell, n, same, bounds_ok, worst, lengths in rows:
        span = f"{min(lengths)}-{max(lengths)}" if lengths else "-"
        lines.append(f"| {cell.policy}{':' + cell.eviction if cell.eviction else ''} | "
                     f"{'-' if cell.sparsity is None else cell.sparsity} | {cell.chunk} | {n} | "
                     f"{span} | {same}/{n} | {bounds_ok}/{n} | {worst:.1e} |")
    per_policy: dict[str, set] = {}
    for cell, i in jobs:
        if (cell.name, i) in served and (cell.name, i) in ref:
            per_policy.setdefault(cell.policy_name, set()).add(i)
    total = sum(n for _, n, *_ in rows)
    lines += ["", "Distinct prompts per policy: " +
              ", ".join(f"{k} {len(v)}" for k, v in per_policy.items()),
              "", f"Compared {total} prompt runs; {len(failures)} mismatches; {missing} not run."]
    if failures:
        lines += ["", "## Mismatches", ""] + [f"- {f}" for f in failures]
    (out_dir / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 1 if failures or missing else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=("all", "served", "reference", "report"), default="all")
    p.add_argument("--out-dir", default=str(REPO / "docs" / "results" / "policy_matrix"))
    p.add_argument("--sparsities", type=float, nargs="+", default=[0.3, 0.7])
    p.add_argument("--chunks", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--prompts-per-policy", type=int, default=20)
    p.add_argument("--prompts-per-cell", type=int, default=None)
    p.add_argument("--min-tokens", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=4000)
    p.add_argument("--new-tokens", type=int, default=12)
    p.add_argument("--logprob-tol", type=float, default=2e-3)
    p.add_argument("--policies", nargs="+", default=None, help="only these policy names")
    p.add_argument("--port", type=int, default=8310)
    p.add_argument("--compiled", action="store_true",
                   help="serve in vLLM's compile mode (no --enforce-eager)")
    p.add_argument("--reserved-cpus", type=int, default=1,
                   help="VLLM_CPU_NUM_OF_RESERVED_CPU for the servers (1: one worker thread on "
                        "2 cores, leaving the other for --part reference)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the reference")
    p.add_argument("--attention-backend", choices=("cpu", "flex"), default="cpu",
                   help="the servers' --kv-attention-backend")
    p.add_argument("--model", default=None, help="model directory (default: the bundled model)")
    p.add_argument("--mask", default=None, help="head-mask file for duo / prulong (default: the "
                   "one shipped for the model)")
    args = p.parse_args(argv)
    args.command = " ".join(sys.argv[1:] if argv is None else argv)

    from transformers import AutoTokenizer

    from vllm_kvevict.model import ensure_bundled_model

    model_dir = args.model or str(ensure_bundled_model())
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cells = build_cells(args.sparsities, args.chunks)
    if args.policies:
        cells = [c for c in cells if c.policy in args.policies]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    pool = max(args.prompts_per_policy, args.prompts_per_cell or 0)
    prompts = prompt_pool(tokenizer, pool, args.min_tokens, args.max_tokens)
    jobs = assign_prompts(cells, len(prompts), args.prompts_per_policy, args.prompts_per_cell)
    if args.part in ("all", "served"):
        run_served(args, model_dir, jobs, prompts, out_dir / "served.jsonl")
    if args.part in ("all", "reference"):
        run_reference(args, model_dir, jobs, prompts, out_dir / "reference.jsonl")
    if args.part in ("all", "report"):
        return report(args, cells, jobs, out_dir)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
