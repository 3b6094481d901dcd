"""Tensor parallel against one worker: each policy served by `vllm serve` at
--tensor-parallel-size 1 and 2 (vLLM's multi-process CPU TP, one core per rank with
VLLM_CPU_OMP_THREADS_BIND="0|1") on tiny random Qwen3 models with 4 and 2 KV heads
(tests/tiny_models.py), the same prompts greedy; compares the token ids and reports each rank's
KV bytes. Resumable: finished (model, policy, tp) runs are kept in runs.jsonl.

    python scripts/tp_matrix.py --out-dir docs/results/tensor_parallel

Writes <out-dir>/runs.jsonl and summary.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

PROMPT_LENGTHS = (300, 340, 700)
NEW_TOKENS = 16
CHUNK = 128
POLICIES = {
    "full": {"policy": "full"},
    "prulong 0.7": {"policy": "prulong", "sparsity": 0.7, "sink": 16, "window": 64},
    "duo 0.5": {"policy": "duo", "sparsity": 0.5, "sink": 16, "window": 64},
    "streaming": {"policy": "streaming", "sink": 16, "window": 64},
    "snapkv patched 0.5": {"policy": "snapkv", "sparsity": 0.5, "eviction": "patched"},
    "snapkv naive 0.5": {"policy": "snapkv", "sparsity": 0.5, "eviction": "naive"},
    "pyramidkv patched 0.7": {"policy": "pyramidkv", "sparsity": 0.7, "eviction": "patched"},
    "pyramidkv naive 0.5 tiers 2": {"policy": "pyramidkv", "sparsity": 0.5,
                                    "eviction": "naive", "tiers": 2},
}


def serve_and_query(model_dir: Path, policy: dict, tp: int, prompts, log_dir: Path) -> dict:
    import httpx

    from vllm_kvevict.launch import VLLM, ServerProcess, free_port, policy_flags

    port = free_port()
    argv = [VLLM, "serve", str(model_dir),
            "--served-model-name", "m", "--host", "127.0.0.1", "--port", str(port),
            "--enforce-eager", "--max-model-len", "2048", "--dtype", "float32", "--seed", "0",
            "--kv-cache-memory-bytes", str(64 << 20), "--max-num-batched-tokens", str(CHUNK),
            "--tensor-parallel-size", str(tp), *policy_flags(policy)]
    server = ServerProcess(argv, log_dir / f"tp-serve-{port}.log",
                           env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"} if tp == 2 else {})
    base = f"http://127.0.0.1:{port}"
    try:
        server.wait_healthy(base, 600.0)
        outputs = []
        for prompt in prompts:
            t0 = time.perf_counter()
            r = httpx.post(f"{base}/v1/completions", timeout=600, json={
                "model": "m", "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}).json()
            kv = r["kv_stats"]
            outputs.append({"prompt_tokens": len(prompt), "seconds": time.perf_counter() - t0,
                            "token_ids": r["choices"][0]["token_ids"],
                            **{k: kv.get(k) for k in ("chunk_boundaries", "kv_bytes_peak",
                                                      "kv_bytes_peak_per_rank",
                                                      "full_kv_bytes_peak",
                                                      "measured_footprint", "footprint")}})
        return {"outputs": outputs}
    finally:
        server.stop()


def summary(runs: list[dict]) -> str:
    by = {(r["model"], r["policy"], r["tp"]): r for r in runs}
    commands = list(dict.fromkeys(r.get("command", "") for r in runs))
    lines = ["# Tensor parallel 2 against one worker", "",
             "Commands: " + ", ".join(f"`{c}`" for c in commands), "",
             "`vllm serve` of tiny random Qwen3 models (4 layers, head_dim 64, random head "
             "gates for duo / prulong) at --tensor-parallel-size 1 and 2 (two worker "
             "processes, one core each), prompts of "
             f"{', '.join(map(str, PROMPT_LENGTHS))} tokens in {CHUNK}-token chunks, "
             f"{NEW_TOKENS} greedy tokens each. Bytes are the request's peak over both ranks and "
             "per rank (rank 0 / rank 1); full attention's peak is the same at TP 1 and 2.", "",
             "| model | policy | tokens equal | KV bytes TP 1 | KV bytes TP 2 (rank 0 / rank 1) "
             "| TP 2 / TP 1 bytes | full attention bytes |",
             "|---|---|---|---|---|---|---|"]
    equal_all = True
    for (model, policy, tp), r2 in sorted(by.items()):
        r1 = by.get((model, policy, 1))
        if tp != 2 or r1 is None:
            continue
        same = [a["token_ids"] == b["token_ids"] for a, b in zip(r1["outputs"], r2["outputs"])]
        equal_all &= all(same)
        a, b = r1["outputs"][-1], r2["outputs"][-1]  # the longest prompt
        ranks = " / ".join(str(x) for x in b["kv_bytes_peak_per_rank"])
        lines.append(f"| {model} | {policy} | {sum(same)}/{len(same)} | {a['kv_bytes_peak']} | "
                     f"{b['kv_bytes_peak']} ({ranks}) | "
                     f"{b['kv_bytes_peak'] / a['kv_bytes_peak']:.3f} | "
                     f"{b['full_kv_bytes_peak']} |")
    lines += ["", "Bytes are those of the " f"{PROMPT_LENGTHS[-1]}-token prompt. "
              "Head masks cost more bytes at TP 2 than at TP 1: vLLM requires every rank "
              "to declare the same KV-cache spec per layer, so each rank's paged cache holds "
              "the most full heads any rank holds in that layer (docs/design/parallel.md, "
              "\"Tensor parallel\"); `streaming` has no full head at all, and vLLM needs one "
              "paged layer to schedule blocks, so each rank keeps the 1-head placeholder layer "
              "of TP 1 (two heads in all). Token eviction splits evenly.", "",
              f"All token ids equal: {'yes' if equal_all else 'NO'}."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    import torch
    from transformers import AutoTokenizer

    from test_policies_vllm import source_prompts
    from tiny_models import build_tiny_model
    from vllm_kvevict.masks import HeadGates, save_head_gates
    from vllm_kvevict.model import ensure_bundled_model

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", default=str(REPO / "docs" / "results" / "tensor_parallel"))
    p.add_argument("--kv-heads", nargs="+", type=int, default=[4, 2])
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    p.add_argument("--models-dir", default=str(Path.home() / ".cache" / "vllm-kvevict" /
                                               "tiny-models"))
    args = p.parse_args(argv)
    command = "python scripts/tp_matrix.py " + " ".join(
        repr(a) if " " in a else a for a in (argv if argv is not None else sys.argv[1:]))
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "runs.jsonl"
    runs = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    done = {(r["model"], r["policy"], r["tp"]) for r in runs}
    tokenizer = AutoTokenizer.from_pretrained(ensure_bundled_model())
    prompts = source_prompts(tokenizer, PROMPT_LENGTHS)
    models = Path(args.models_dir)
    todo = [(kv, name, tp) for kv in args.kv_heads for name in args.policies for tp in (1, 2)]
    for i, (kv, name, tp) in enumerate(todo):
        model = f"qwen3 {kv} KV heads"
        if (model, name, tp) in done:
            continue
        model_dir = models / f"tiny-qwen3-kv{kv}"
        if not (model_dir / "config.json").exists():
            build_tiny_model("qwen3", models, num_kv_heads=kv, name=model_dir.name)
        policy = dict(POLICIES[name])
        if policy["policy"] in ("duo", "prulong"):
            mask = models / f"{model_dir.name}-mask.json"
            if not mask.exists():
                gates = torch.rand(4, kv, generator=torch.Generator().manual_seed(0))
                save_head_gates(mask, HeadGates(gates, meta={"objective": "random"}))
            policy["mask_path"] = str(mask)
        print(f"[{i + 1}/{len(todo)}] {model} {name} TP {tp}", flush=True)
        run = {"model": model, "policy": name, "tp": tp, "kv_policy": policy,
               "command": command,
               **serve_and_query(model_dir, policy, tp, prompts, Path(tempfile.gettempdir()))}
        runs.append(run)
        with path.open("a") as f:
            f.write(json.dumps(run) + "\n")
    (out / "summary.md").write_text(summary(runs))
    print((out / "summary.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
