"""What decode-time eviction costs: a held-out long continuation scored under each setting.

Each document is a real text (Python standard-library sources, this Python's own files, in a
fixed order): its first `--prompt-len` tokens are the prompt, the next `--continuation-len`
tokens are teacher-forced through the policy (`vllm_xargs.kv_teacher_forced`: served as decode
steps, so decode-time eviction compresses them as it would generated tokens), and their
log-probs come back as `prompt_logprobs`. Per setting: the mean negative log-likelihood per
continuation token, and its difference from full attention per document (paired), with a
bootstrap 95 % interval over documents; per position bucket, the same difference (does the
loss grow as the generation goes on?).

    python -m vllm_kvevict.evaluation.continuation --out-dir docs/results/decode-eviction/quality

Settings are `launch.parse_policy` strings (`snapkv:0.7:naive:d256e64`: decode budget 256,
a compression every 64 tokens). Resumable: `results.jsonl` keeps one record per (setting,
document); a rerun skips what is there and starts no server whose documents are all done.
"""

from __future__ import annotations

import argparse
import glob
import json
import sys
from pathlib import Path

import httpx
import numpy as np

from vllm_kvevict.launch import ServerProcess, build_server_command, free_port, parse_policy
from vllm_kvevict.model import ensure_bundled_model

SERVED = "continuation"
DEFAULT_SETTINGS = ("full", "snapkv:0.7:naive", "snapkv:0.7:naive:d512e128",
                    "snapkv:0.7:naive:d256e128", "snapkv:0.7:naive:d256e32",
                    "snapkv:0.7:naive:d128e64", "pyramidkv:0.7:naive:d256e128")


def documents(tokenizer, count: int, length: int) -> list[tuple[str, list[int]]]:
    """(name, token ids) of the first `count` standard-library sources with >= `length`
    tokens, cut to `length`."""
    out = []
    for path in sorted(glob.glob(str(Path(sys.base_prefix) / "lib" / "python3.11" / "*.py"))):
        ids = tokenizer(Path(path).read_text(errors="replace"))["input_ids"]
        if len(ids) >= length:
            out.append((Path(path).name, ids[:length]))
        if len(out) == count:
            break
    return out


def score(client: httpx.Client, base_url: str, prompt: list[int], continuation: list[int]
          ) -> tuple[list[float], dict]:
    body = {"model": SERVED, "prompt": prompt + continuation, "max_tokens": 1,
            "temperature": 0.0, "prompt_logprobs": 0,
            "vllm_xargs": {"kv_teacher_forced": len(continuation)}}
    r = client.post(base_url + "/v1/completions", json=body, timeout=3600)
    r.raise_for_status()
    out = r.json()
    kv = out.get("kv_stats") or {}
    if kv.get("teacher_forced_tokens") != len(continuation):
        raise RuntimeError(f"the server did not teacher-force the continuation: {kv}")
    rows = out["choices"][0]["prompt_logprobs"][-len(continuation):]
    return [row[str(t)]["logprob"] for row, t in zip(rows, continuation)], kv


def run(args) -> None:
    from tqdm import tqdm
    from transformers import AutoTokenizer

    model = args.model or str(ensure_bundled_model())
    tokenizer = AutoTokenizer.from_pretrained(model)
    docs = documents(tokenizer, args.documents, args.prompt_len + args.continuation_len)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    results = args.out_dir / "results.jsonl"
    done = set()
    if results.exists():
        for line in results.read_text().splitlines():
            rec = json.loads(line)
            done.add((rec["setting"], rec["document"]))
    (args.out_dir / "command.txt").write_text(
        "python -m vllm_kvevict.evaluation.continuation " + " ".join(sys.argv[1:]) + "\n")
    for text in args.settings:
        spec = parse_policy(text)
        todo = [(name, ids) for name, ids in docs if (spec.label, name) not in done]
        if not todo:
            continue
        port = free_port()
        argv = build_server_command(model, spec, kv_cache_bytes=args.kv_cache_memory_bytes,
                                    max_batched_tokens=args.chunk, port=port,
                                    extra_args=["--dtype", "float32", "--served-model-name",
                                                SERVED, "--max-model-len", "4096"])
        log = args.out_dir / "logs" / f"{spec.slug}.log"
        with ServerProcess(argv, log) as server, httpx.Client() as client:
            base_url = f"http://127.0.0.1:{port}"
            server.wait_healthy(base_url)
            for name, ids in tqdm(todo, desc=spec.label, file=sys.stderr):
                logprobs, kv = score(client, base_url, ids[:args.prompt_len],
                                     ids[args.prompt_len:])
                rec = {"setting": spec.label, "document": name, "logprobs": logprobs,
                       "decode_compressions": kv.get("decode_compressions"),
                       "kv_bytes_peak": kv.get("kv_bytes_peak"),
                       "full_kv_bytes_peak": kv.get("full_kv_bytes_peak"),
                       "footprint": kv.get("footprint")}
                with results.open("a") as f:
                    f.write(json.dumps(rec) + "\n")


def bootstrap(diffs: np.ndarray, rng: np.random.Generator, n: int = 2000) -> tuple[float, float]:
    means = diffs[rng.integers(0, len(diffs), size=(n, len(diffs)))].mean(axis=1)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def report(args) -> None:
    records = [json.loads(line) for line in (args.out_dir / "results.jsonl").read_text()
               .splitlines()]
    by_setting: dict[str, dict[str, dict]] = {}
    for rec in records:
        by_setting.setdefault(rec["setting"], {})[rec["document"]] = rec
    full = by_setting.get("full")
    if not full:
        raise SystemExit("no full-attention records to compare with")
    rng = np.random.default_rng(0)
    buckets = args.buckets
    lines = [f"Command: `{(args.out_dir / 'command.txt').read_text().strip()}`", "",
             "| setting | documents | NLL / token | Δ NLL vs full [95 % CI] | "
             "decode compressions | KV bytes peak / full's | footprint (paper) |",
             "|---|---|---|---|---|---|---|"]
    curves = {}
    for setting, docs in by_setting.items():
        names = sorted(set(docs) & set(full))
        nll = np.array([-np.mean(docs[d]["logprobs"]) for d in names])
        diff = nll - np.array([-np.mean(full[d]["logprobs"]) for d in names])
        lo, hi = bootstrap(diff, rng)
        peak = np.mean([docs[d]["kv_bytes_peak"] / docs[d]["full_kv_bytes_peak"] for d in names])
        lines.append(f"| {setting} | {len(names)} | {nll.mean():.3f} | {diff.mean():+.3f} "
                     f"[{lo:+.3f}, {hi:+.3f}] | "
                     f"{np.mean([docs[d]['decode_compressions'] or 0 for d in names]):.0f} | "
                     f"{peak:.2f} | {np.mean([docs[d]['footprint'] for d in names]):.3f} |")
        per_pos = np.array([np.array(full[d]["logprobs"]) - np.array(docs[d]["logprobs"])
                            for d in names])  # [docs, tokens]: NLL difference per position
        edges = np.linspace(0, per_pos.shape[1], buckets + 1).astype(int)
        curves[setting] = (edges, [per_pos[:, a:b].mean() for a, b in zip(edges, edges[1:])])
    (args.out_dir / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for setting, (edges, values) in curves.items():
        if setting == "full":
            continue
        centres = (edges[:-1] + edges[1:]) / 2
        ax.plot(centres, values, marker="o", label=setting)
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xlabel("position in the teacher-forced continuation (tokens)")
    ax.set_ylabel("NLL per token minus full attention's")
    ax.set_title("Decode-time eviction: loss along a long continuation")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out_dir / "nll_by_position.png", dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--settings", nargs="+", default=list(DEFAULT_SETTINGS))
    ap.add_argument("--documents", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--continuation-len", type=int, default=1536)
    ap.add_argument("--chunk", type=int, default=512, help="--max-num-batched-tokens")
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=1 << 30)
    ap.add_argument("--buckets", type=int, default=6)
    ap.add_argument("--out-dir", type=Path, default=Path("docs/results/decode-eviction/quality"))
    ap.add_argument("--report-only", action="store_true")
    args = ap.parse_args()
    if not args.report_only:
        run(args)
    report(args)


if __name__ == "__main__":
    main()
