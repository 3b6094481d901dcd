"""`python -m vllm_kvevict.train`: train PruLong or DuoAttention head gates; see the package
docstring (`vllm_kvevict/train/__init__.py`) for the objectives, data and outputs."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

import vllm_kvevict.train.data as data_mod
import vllm_kvevict.train.hard_concrete as hc
from vllm_kvevict.config import DEFAULT_SINK, DEFAULT_WINDOW
from vllm_kvevict.masks import HEAD_MASKS_DIR, full_heads_at_sparsity, model_key
from vllm_kvevict.train.trainer import DTYPES, OBJECTIVES, TrainConfig, Trainer


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m vllm_kvevict.train",
                                description="Train PruLong / DuoAttention head gates for a "
                                            "local HF Llama/Mistral/Qwen2/Qwen3 model "
                                            "(--device: cpu by default).")
    p.add_argument("--objective", choices=OBJECTIVES, required=True)
    p.add_argument("--model", required=True, help="local model directory (transformers)")
    p.add_argument("--out", help="mask JSON to write (default head_masks/<model>/"
                                 "<objective>-s<target>.json)")
    p.add_argument("--target-sparsity", type=float, default=0.7,
                   help="final target head sparsity t (prulong; recorded for duo)")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=1, help="sequences per step")
    p.add_argument("--chunk", type=int, default=1024,
                   help="prefill chunk of the streaming heads' semantics")
    p.add_argument("--sink", type=int, default=DEFAULT_SINK)
    p.add_argument("--window", type=int, default=DEFAULT_WINDOW)
    p.add_argument("--lr", type=float, default=None,
                   help="peak lr of log_alpha (prulong, default 1 as the paper; 0.5 is better "
                        "for runs of < ~100 steps) or alpha (duo, default 0.02)")
    p.add_argument("--lambda-lr", type=float, default=1.0, help="peak lr of lambda1, lambda2")
    p.add_argument("--warmup-frac", type=float, default=0.1, help="lr warm-up share of steps")
    p.add_argument("--final-lr-frac", type=float, default=0.01,
                   help="lr at the last step, as a share of the peak")
    p.add_argument("--sparsity-warmup-steps", type=int, default=None,
                   help="steps over which the target goes 0 -> t (default 0.8 * steps)")
    p.add_argument("--init-log-alpha", type=float, default=None,
                   help="initial log_alpha (default: the clamp's upper bound, 0.90 for C = 2.5; "
                        "3.0 without a clamp)")
    p.add_argument("--gate-logit-clamp", type=float, default=hc.DEFAULT_GATE_LOGIT_CLAMP,
                   help="after every step clamp log_alpha so that P(z > 0) stays in "
                        "[sigmoid(-C), sigmoid(C)]; 0 disables (default 2.5: 7.6%%..92.4%%; "
                        "not in the paper, see hard_concrete.clamp_log_alpha_)")
    p.add_argument("--duo-lambda", type=float, default=0.05, help="duo: L1 weight")
    p.add_argument("--duo-passkeys", type=int, default=10)
    p.add_argument("--duo-passkey-words", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt-every", type=int, default=0,
                   help="checkpoint every N steps (and always at the end) when --ckpt-dir")
    p.add_argument("--ckpt-dir", help="checkpoint + train_log.jsonl directory")
    p.add_argument("--resume", action="store_true", help="continue from --ckpt-dir")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--device", default="cpu",
                   help="torch device of the model and the gates: cpu (default), cuda, cuda:1, ...")
    p.add_argument("--text-share", type=float, default=data_mod.DEFAULT_TEXT_SHARE)
    p.add_argument("--held-out-fraction", type=float,
                   default=data_mod.DEFAULT_HELD_OUT_FRACTION)
    p.add_argument("--max-source-chars", type=int, default=data_mod.DEFAULT_MAX_SOURCE_CHARS)
    p.add_argument("--no-progress", action="store_true")
    return p


def default_out(model: str, objective: str, target: float) -> Path:
    return HEAD_MASKS_DIR / model_key(model) / f"{objective}-s{target:g}.json"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = args.out or str(default_out(args.model, args.objective, args.target_sparsity))
    cfg = TrainConfig(
        objective=args.objective, model=args.model, out=out,
        target_sparsity=args.target_sparsity, seq_len=args.seq_len, steps=args.steps,
        batch_size=args.batch_size, chunk=args.chunk, sink=args.sink, window=args.window,
        lr=args.lr, lambda_lr=args.lambda_lr, warmup_frac=args.warmup_frac,
        final_lr_frac=args.final_lr_frac, sparsity_warmup_steps=args.sparsity_warmup_steps,
        init_log_alpha=args.init_log_alpha,
        gate_logit_clamp=args.gate_logit_clamp, duo_lambda=args.duo_lambda,
        duo_passkeys=args.duo_passkeys, duo_passkey_words=args.duo_passkey_words,
        seed=args.seed, ckpt_every=args.ckpt_every, ckpt_dir=args.ckpt_dir,
        resume=args.resume, dtype=args.dtype, text_share=args.text_share,
        held_out_fraction=args.held_out_fraction, max_source_chars=args.max_source_chars,
        device=args.device)
    torch.manual_seed(cfg.seed)
    started = time.perf_counter()
    trainer = Trainer(cfg)
    print(f"model {cfg.model}: {trainer.num_layers} layers x {trainer.num_kv_heads} KV heads; "
          f"{len(trainer.train_sources)} train / {len(trainer.held_out_sources)} held-out "
          f"sources; device {cfg.device}; {torch.get_num_threads()} threads; setup "
          f"{time.perf_counter() - started:.1f} s", flush=True)
    trainer.train(progress=not args.no_progress)
    path = trainer.export(out)
    gates = trainer.head_gates()
    full = full_heads_at_sparsity(gates, cfg.target_sparsity)
    print(f"wrote {path} after {trainer.step} steps ({trainer.elapsed:.0f} s of training); "
          f"full heads per layer at sparsity {cfg.target_sparsity:g}: "
          f"{' '.join(str(int(n)) for n in full.sum(dim=1))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
