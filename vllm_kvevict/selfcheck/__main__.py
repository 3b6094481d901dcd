"""`python -m vllm_kvevict.selfcheck`: serve the policy matrix on this vLLM, device and dtype,
compare with the plain-PyTorch reference, print the table, record a pass if every cell is
exact (see the package docstring)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from vllm_kvevict.selfcheck import records
from vllm_kvevict._version import __version__
from vllm_kvevict.config import KVPolicyConfig
from vllm_kvevict.masks import resolve_full_heads
from vllm_kvevict.model import ensure_bundled_model
from vllm_kvevict.policies import build_policy
from vllm_kvevict.reference import ReferenceRunner
from vllm_kvevict.selfcheck import tiny_model

# The cells: every policy family, both eviction modes of the token policies. Sparsity 0.5:
# half the heads streaming / half the prompt evicted, so a wrong head or token shows.
CELLS = {
    "full": {"policy": "full"},
    "streaming": {"policy": "streaming"},
    "duo": {"policy": "duo", "sparsity": 0.5},
    "prulong": {"policy": "prulong", "sparsity": 0.5},
    "snapkv:patched": {"policy": "snapkv", "sparsity": 0.5, "eviction": "patched"},
    "snapkv:naive": {"policy": "snapkv", "sparsity": 0.5, "eviction": "naive"},
    "pyramidkv:patched": {"policy": "pyramidkv", "sparsity": 0.5, "eviction": "patched"},
    "pyramidkv:naive": {"policy": "pyramidkv", "sparsity": 0.5, "eviction": "naive"},
}
# the first generated token's log-prob, served vs reference (the tokens must be identical)
LOGPROB_TOL = {"float32": 2e-3, "float16": 2e-2, "bfloat16": 5e-2}


@dataclass
class CellResult:
    name: str
    prompts: int = 0
    identical: int = 0
    boundaries: int = 0
    worst: float = 0.0
    error: str = ""

    def ok(self, tol: float) -> bool:
        return (not self.error and self.prompts > 0 and self.identical == self.prompts
                and self.boundaries == self.prompts and self.worst < tol)


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m vllm_kvevict.selfcheck",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="the model you serve (a directory or hub id; "
                   "default: the bundled SmolLM2-135M-Instruct); its config shapes the tiny model")
    p.add_argument("--real-model", action="store_true",
                   help="check the model itself instead of a tiny random one of its shape")
    p.add_argument("--mask", default=None, help="head-mask file for duo / prulong with "
                   "--real-model (default: the one shipped for the model)")
    p.add_argument("--dtype", default="float32", choices=sorted(LOGPROB_TOL))
    p.add_argument("--device", default=None, help="the reference's torch device (default: cuda "
                   "if torch sees one, else cpu)")
    p.add_argument("--policies", nargs="+", default=list(CELLS), choices=list(CELLS),
                   metavar="CELL", help=f"cells to run (default all: {' '.join(CELLS)})")
    p.add_argument("--prompt-tokens", type=int, nargs="+", default=[700, 1100])
    p.add_argument("--chunk", type=int, default=256, help="--max-num-batched-tokens")
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--attention-backend", choices=("cpu", "flex"), default=None,
                   help="--kv-attention-backend (default: cpu on the CPU platform, else flex)")
    p.add_argument("--record-dir", default=None,
                   help=f"where passes are recorded (default: ${records.ENV_DIR} or "
                        "~/.cache/vllm-kvevict/selfcheck)")
    p.add_argument("--no-record", action="store_true", help="check only")
    p.add_argument("--perturb-reference", action="store_true",
                   help="compare with a reference under other settings (half the window, "
                        "+0.2 token sparsity): must fail; shows the check can tell")
    p.add_argument("--work-dir", default=None, help="where the tiny model is built")
    return p.parse_args(argv)


def reference_config(policy: dict, perturb: bool):

    cfg = KVPolicyConfig.from_dict(policy)
    if perturb and cfg.uses_head_mask:
        cfg = cfg.replace(window=cfg.window // 2)
    elif perturb and cfg.evicts_tokens:
        cfg = cfg.replace(sparsity=min(0.9, cfg.sparsity + 0.2))
    return cfg


def serve(cells: list[dict], log: Path, bar) -> dict[str, list | str]:
    """cell name -> its results (one per prompt, in order), or the error that stopped it. One
    subprocess serves the cells in turn; if it dies, the cell it was on gets the error and a
    new one serves the rest."""
    env = {**os.environ, records.ENV_CHECKING: "1", "VLLM_LOGGING_LEVEL": "WARNING",
           "TOKENIZERS_PARALLELISM": "false"}
    out: dict[str, list | str] = {}
    pending = list(cells)
    with log.open("a") as log_file:
        while pending:
            proc = subprocess.Popen([sys.executable, "-m", "vllm_kvevict.selfcheck.serve_cell",
                                     json.dumps(pending)], stdout=subprocess.PIPE,
                                    stderr=log_file, text=True, env=env)
            for line in proc.stdout:
                log_file.write(line)
                tag, _, body = line.partition(" ")
                if tag not in ("RESULT", "CELLERROR"):
                    continue
                row = json.loads(body)
                if tag == "CELLERROR":
                    out[row["cell"]] = row["error"]
                else:
                    out.setdefault(row["cell"], []).append(row)
                cell = next(c for c in pending if c["name"] == row["cell"])
                if tag == "CELLERROR" or len(out[row["cell"]]) == len(cell["prompts"]):
                    pending.remove(cell)
                    bar.update()
            code = proc.wait()
            if pending and code != 0:
                cell = pending.pop(0)
                out[cell["name"]] = f"the vLLM process exited {code} (log: {log})"
                bar.update()
            elif pending:
                for cell in pending:
                    out[cell["name"]] = f"no result (log: {log})"
                pending = []
    return out


def main(argv=None) -> int:
    args = parse(argv)
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM


    import vllm
    from vllm.platforms import current_platform

    platform = str(current_platform.device_type)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    backend = args.attention_backend or ("cpu" if platform == "cpu" else "flex")
    dtype = getattr(torch, args.dtype)
    source = args.model or str(ensure_bundled_model())
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="kvevict-selfcheck-"))
    mask = args.mask
    if args.real_model:
        model_dir = source
    else:
        model_dir = str(tiny_model.build(source, work / "tiny-model"))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    text = getattr(model.config, "text_config", None) or model.config
    layers, kv_heads = text.num_hidden_layers, text.num_key_value_heads
    if not args.real_model:
        mask = str(tiny_model.random_mask(Path(model_dir), layers, kv_heads))
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, min(text.vocab_size, tiny_model.VOCAB), (n,),
                             generator=generator).tolist() for n in args.prompt_tokens]
    tol = LOGPROB_TOL[args.dtype]
    max_len = max(args.prompt_tokens) + args.new_tokens + 64
    print(f"vllm-kvevict self-check: vLLM {vllm.__version__}, platform {platform}, device "
          f"{records.device_name(platform)}, dtype {args.dtype}, attention backend {backend}, "
          f"model {model_dir}{' (tiny, random, shaped like ' + source + ')' if not args.real_model else ''}",
          flush=True)
    cells = []
    for name in args.policies:
        policy = dict(CELLS[name])
        if backend != "cpu":
            policy["attention_backend"] = backend
        if mask and policy["policy"] in ("duo", "prulong"):
            policy["mask_path"] = mask
        cells.append({"name": name, "model": model_dir, "policy": policy, "chunk": args.chunk,
                      "prompts": prompts, "new_tokens": args.new_tokens, "dtype": args.dtype,
                      "max_model_len": max_len, "kv_cache_bytes": 256 << 20})
    with tqdm(total=len(cells), desc="served", unit="cell") as bar:
        served_by_cell = serve(cells, work / "served.log", bar)
    results = []
    for cell in tqdm(cells, desc="reference", unit="cell"):
        result = CellResult(cell["name"])
        results.append(result)
        served = served_by_cell.get(cell["name"], "no result")
        try:
            if isinstance(served, str):
                raise RuntimeError(served)
            cfg = reference_config(cell["policy"], args.perturb_reference)
            full_heads = None
            if cfg.policy in ("duo", "prulong"):
                full_heads, _ = resolve_full_heads(cfg, model_dir, layers, kv_heads)
            runner = ReferenceRunner(model, build_policy(cfg, layers, kv_heads,
                                                         full_heads=full_heads), dtype=dtype)
        except Exception as exc:  # one cell's failure is that cell's row
            result.error = str(exc) if isinstance(served, str) else f"{type(exc).__name__}: {exc}"
            continue
        for prompt, got in zip(prompts, served):
            ends = list(range(args.chunk, len(prompt), args.chunk)) + [len(prompt)]
            ref = runner.generate(prompt, args.new_tokens, ends)
            result.prompts += 1
            result.identical += got["token_ids"] == list(ref.token_ids)
            result.boundaries += got["chunk_boundaries"] == ends
            result.worst = max(result.worst, abs(got["first_logprob"]
                                                 - float(ref.first_token_logprobs.max())))
    lines = ["| cell | prompts | identical tokens | same chunk boundaries | max abs dlogprob | "
             "verdict |", "|---|---|---|---|---|---|"]
    for r in results:
        verdict = "exact" if r.ok(tol) else ("ERROR " + r.error if r.error else "DIFFERS")
        lines.append(f"| {r.name} | {r.prompts} | {r.identical}/{r.prompts} | "
                     f"{r.boundaries}/{r.prompts} | {r.worst:.1e} | {verdict} |")
    print("\n".join(lines))
    passed = all(r.ok(tol) for r in results) and set(args.policies) == set(CELLS)
    if not all(r.ok(tol) for r in results):
        print("self-check FAILED: no pass recorded", flush=True)
        return 1
    if args.perturb_reference:
        print("self-check passed against a perturbed reference: the comparison cannot tell "
              "(no pass recorded)")
        return 1
    if not passed or args.no_record:
        print("self-check passed for the cells run"
              + ("" if passed else f" (a pass is recorded only when every cell runs: {' '.join(CELLS)})"))
        return 0
    key = records.PassKey(plugin=__version__, vllm=vllm.__version__.split("+")[0],
                          platform=platform, device=records.device_name(platform),
                          dtype=args.dtype)
    path = records.write_pass(key, {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": "python -m vllm_kvevict.selfcheck " + " ".join(sys.argv[1:] if argv is None
                                                                   else argv),
        "model": source, "real_model": args.real_model, "attention_backend": backend,
        "table": lines}, Path(args.record_dir) if args.record_dir else None)
    print(f"self-check passed: recorded {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
