"""KV bytes with an fp8 cache against the model dtype's, per policy, on the bundled model: each
policy served by `vllm serve` with --kv-cache-dtype auto and fp8 (same prompts, greedy), KV
bytes from kv_stats, and how far fp8 moves the outputs (token agreement with auto, first-token
log-prob). Resumable: finished (policy, dtype) runs are kept in runs.jsonl.

    python scripts/fp8_bytes.py --out-dir docs/results/fp8

Writes <out-dir>/runs.jsonl and summary.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

PROMPT_LENGTHS = (1000, 2000, 3000)
NEW_TOKENS = 32
CHUNK = 512
POLICIES = {
    "full": {"policy": "full"},
    "streaming": {"policy": "streaming"},
    "duo 0.5": {"policy": "duo", "sparsity": 0.5},
    "prulong 0.7": {"policy": "prulong", "sparsity": 0.7},
    "snapkv naive 0.7": {"policy": "snapkv", "sparsity": 0.7, "eviction": "naive"},
    "snapkv patched 0.7": {"policy": "snapkv", "sparsity": 0.7, "eviction": "patched"},
    "pyramidkv naive 0.7": {"policy": "pyramidkv", "sparsity": 0.7, "eviction": "naive",
                            "tiers": 5},
    "pyramidkv patched 0.7": {"policy": "pyramidkv", "sparsity": 0.7, "eviction": "patched",
                              "tiers": 5},
}
DTYPES = ("auto", "fp8")
FIELDS = ("kv_bytes_peak", "full_kv_bytes_peak", "footprint",
          "measured_footprint", "chunk_boundaries")


def serve_and_query(model_dir: Path, policy: dict, dtype: str, prompts) -> list[dict]:
    import httpx

    from vllm_kvevict.launch import VLLM, ServerProcess, free_port, policy_flags

    port = free_port()
    argv = [VLLM, "serve", str(model_dir),
            "--served-model-name", "m", "--host", "127.0.0.1", "--port", str(port),
            "--enforce-eager", "--max-model-len", "8192", "--dtype", "float32", "--seed", "0",
            "--kv-cache-memory-bytes", str(512 << 20), "--max-num-batched-tokens", str(CHUNK),
            "--kv-cache-dtype", dtype, *policy_flags(policy)]
    server = ServerProcess(argv, Path(tempfile.gettempdir()) / f"fp8-serve-{port}.log")
    base = f"http://127.0.0.1:{port}"
    try:
        server.wait_healthy(base, 600.0)
        out = []
        for prompt in prompts:
            r = httpx.post(f"{base}/v1/completions", timeout=600, json={
                "model": "m", "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0,
                "logprobs": 1, "return_token_ids": True}).json()
            choice, kv = r["choices"][0], r["kv_stats"]
            out.append({"prompt_tokens": len(prompt), "token_ids": choice["token_ids"],
                        "first_logprob": choice["logprobs"]["token_logprobs"][0],
                        **{k: kv.get(k) for k in FIELDS}})
        return out
    finally:
        server.stop()


def summary(runs: list[dict]) -> str:
    by = {(r["policy"], r["dtype"]): r["outputs"] for r in runs}
    lines = ["# fp8 KV cache against the model dtype (bundled model, float32)", "",
             "Command: `python scripts/fp8_bytes.py`", "",
             f"SmolLM2-135M-Instruct in float32 served with `--kv-cache-dtype auto` and `fp8`, "
             f"{CHUNK}-token chunks, prompts of {', '.join(map(str, PROMPT_LENGTHS))} tokens, "
             f"{NEW_TOKENS} greedy tokens. Bytes: the {PROMPT_LENGTHS[-1]}-token request's "
             "peak (kv_stats `kv_bytes_peak`); the fp8 / auto byte ratio is the same for every "
             "prompt unless noted. Agreement: generated tokens equal to auto's up to the first "
             "difference, over all prompts; |d logprob|: the first token's log-prob, fp8 - "
             "auto, largest over prompts.", "",
             "| policy | bytes auto | bytes fp8 | fp8 / auto | footprint auto / fp8 | "
             "tokens agreeing | max abs d first-token logprob |",
             "|---|---|---|---|---|---|---|"]
    for name in POLICIES:
        a, f = by.get((name, "auto")), by.get((name, "fp8"))
        if not a or not f:
            continue
        ratios = {round(y["kv_bytes_peak"] / x["kv_bytes_peak"], 4) for x, y in zip(a, f)}
        agree = total = 0
        for x, y in zip(a, f):
            for s, t in zip(x["token_ids"], y["token_ids"]):
                if s != t:
                    break
                agree += 1
            total += len(x["token_ids"])
        dlp = max(abs(x["first_logprob"] - y["first_logprob"]) for x, y in zip(a, f))
        fp = f"{a[-1]['footprint']:.3f} / {f[-1]['footprint']:.3f}" \
            if a[-1]["footprint"] is not None else "-"
        lines.append(f"| {name} | {a[-1]['kv_bytes_peak']} | {f[-1]['kv_bytes_peak']} | "
                     f"{', '.join(f'{r:.4f}' for r in sorted(ratios))} | {fp} | "
                     f"{agree}/{total} | {dlp:.4f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    from transformers import AutoTokenizer

    from test_policies_vllm import source_prompts
    from vllm_kvevict.model import ensure_bundled_model

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", default=str(REPO / "docs" / "results" / "fp8"))
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    args = p.parse_args(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "runs.jsonl"
    runs = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    done = {(r["policy"], r["dtype"]) for r in runs}
    model_dir = ensure_bundled_model()
    prompts = source_prompts(AutoTokenizer.from_pretrained(model_dir), PROMPT_LENGTHS)
    todo = [(name, dtype) for name in args.policies for dtype in DTYPES]
    for i, (name, dtype) in enumerate(todo):
        if (name, dtype) in done:
            continue
        print(f"[{i + 1}/{len(todo)}] {name} {dtype}", flush=True)
        run = {"policy": name, "dtype": dtype, "kv_policy": POLICIES[name],
               "outputs": serve_and_query(model_dir, POLICIES[name], dtype, prompts)}
        runs.append(run)
        with path.open("a") as f:
            f.write(json.dumps(run) + "\n")
    (out / "summary.md").write_text(summary(runs))
    print((out / "summary.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
