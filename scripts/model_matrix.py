"""The model-family matrix: every policy (naive and patched token eviction, head masks), head /
token sparsity 0.3 and 0.7, served by `vllm serve` on a tiny random model of each supported
family (Llama 3, Mistral, Qwen2, Qwen3; tests/tiny_models.py) against the plain-PyTorch
reference, with `scripts/policy_matrix.py` per family. Resumable like it.

    python scripts/model_matrix.py --out-dir docs/results/model_matrix

Writes <out-dir>/<family>/{served,reference}.jsonl and summary.md, and <out-dir>/summary.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))


def main(argv=None) -> int:
    import torch

    import policy_matrix
    from tiny_models import FAMILIES, build_tiny_model
    from vllm_kvevict.masks import HeadGates, save_head_gates

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", default=str(REPO / "docs" / "results" / "model_matrix"))
    p.add_argument("--families", nargs="+", default=list(FAMILIES))
    p.add_argument("--chunks", nargs="+", default=["128"])
    p.add_argument("--models-dir", default=str(Path.home() / ".cache" / "vllm-kvevict" /
                                               "tiny-models"),
                   help="where the tiny models are built (kept out of the results)")
    args, rest = p.parse_known_args(argv)
    out = Path(args.out_dir)
    status, parts = 0, []
    for family in args.families:
        models = Path(args.models_dir)
        model_dir = models / f"tiny-{family}"
        if not (model_dir / "config.json").exists():
            build_tiny_model(family, models)
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_dir)
        mask = models / f"tiny-{family}-mask.json"
        if not mask.exists():  # random gates: no mask is trained for a random model
            gates = torch.rand(config.num_hidden_layers, config.num_key_value_heads,
                               generator=torch.Generator().manual_seed(0))
            save_head_gates(mask, HeadGates(gates, meta={"model": model_dir.name,
                                                         "objective": "random"}))
        status |= policy_matrix.main([
            "--model", str(model_dir), "--mask", str(mask), "--out-dir", str(out / family),
            "--chunks", *args.chunks, "--prompts-per-cell", "1", "--min-tokens", "300",
            "--max-tokens", "700", "--reserved-cpus", "0", "--threads", "2", *rest])
        parts.append((family, (out / family / "summary.md").read_text()))
    lines = ["# Model-family matrix: `vllm serve` vs the plain-PyTorch reference", "",
             f"Command: `python scripts/model_matrix.py {' '.join(sys.argv[1:])}`", "",
             f"Commit: {_commit()} (the code served)", "",
             "Tiny random models (tests/tiny_models.py: 4 layers, 2 KV heads, head_dim 64, the "
             "bundled tokenizer), random head gates for duo / prulong; one prompt per cell.", "",
             "Sink 64 and window 256 (the defaults) keep every token of a prompt up to 320 "
             "tokens: with prompts that short the streaming / duo / prulong cells equal full "
             "attention (their evicting runs are then `long-prompts/` and "
             "tests/test_model_families_vllm.py, sink 16, window 64). Each family's own "
             "table follows.", ""]
    for family, text in parts:
        lines += [f"## {family}", ""] + text.splitlines()[2:] + [""]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    return status


def _commit() -> str:
    import subprocess

    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, cwd=Path(__file__).resolve().parents[1]).stdout.strip()


if __name__ == "__main__":
    sys.exit(main())
