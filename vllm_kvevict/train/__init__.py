"""Training head masks: PruLong (Bhaskar et al. 2025, "Cache Me If You Can", section 4 and the
appendix "The details of the pruning process") and DuoAttention (Xiao et al. 2025) as the
baseline, for any transformers Llama-family GQA model on a local disk, on CPU.

    python -m vllm_kvevict.train --objective prulong|duo --model DIR --target-sparsity 0.7 \
        --seq-len 4096 --steps N [--chunk 1024 --sink 64 --window 256] \
        [--ckpt-dir DIR --ckpt-every K [--resume]] [--threads T] [--dtype float32|bfloat16] \
        --out head_masks/<model>/prulong-s0.7.json
    python -m vllm_kvevict.train.evaluate --model DIR --masks a.json b.json --sparsity 0.7 \
        --seq-len 4096 --num-seqs N --chunk 1024

Modules:
- `hard_concrete.py`: the gates z(log_alpha), their sampling and expected L0 sparsity (the exact
  formulas, and where they differ from the appendix's text, are in its docstring);
- `hybrid.py`: z * full + (1 - z) * streaming attention per KV head, the streaming mask taken
  from `reference.chunked_streaming_visibility` (the same chunk semantics as inference);
- `trainer.py`: `TrainConfig`, `Trainer` (steps, Lagrangian ascent, schedules, checkpoints,
  export), the objectives' formulas in its docstring;
- `data.py`: training / held-out text from this machine, packing, passkey data;
- `evaluate.py`: held-out loss of masks with the reference oracle's exact chunked prefill.

The model's weights are frozen; only the gates (and PruLong's two Lagrange multipliers) train.
The forward is the reference oracle's `ReferenceRunner.run_layers` (every module of the
transformers model except attention, which is the hybrid); gradients reach log_alpha through
z. Both attentions use torch's fused SDPA (float32 softmax, no n x n tensor kept), the
next-token loss is computed block by block with its gradient formed on the way
(`FusedLMLoss`). Memory at seq-len 4096 for SmolLM2-135M in float32: about 7 GB peak.

Data (`data.py`): PruLong learns from natural long text (the paper uses ProLong's code
repositories and books). Nothing may be downloaded here, so the corpus is what this machine
holds: repository-level code (each package of the standard library and of the venv's
site-packages, its files concatenated), long technical prose (Vim's help files, the Python
language reference topics) and the one public-domain book found in an installed package
(Newton's "Opticks"). The held-out split is by source, not by chunk: every book, and about 10 %
of the other sources chosen by a hash of their names, so the evaluation reads packages and
manuals whose text training never saw. DuoAttention's baseline uses its own kind of data,
synthetic passkey retrieval (passkeys hidden in a prose haystack from the training sources).

Output: a `vllm-kvevict-head-mask` JSON (`masks.save_head_gates`): PruLong gates =
sigmoid(log_alpha) plus the raw log_alphas, DuoAttention gates = alpha; `extra` records
steps, seq_len, chunk, wall time, data, seed and the final statistics. Any head sparsity is
derived from the gates by global top-k (`masks.full_heads_at_sparsity`).
"""

from vllm_kvevict.train.hard_concrete import (EPS, LIMIT_L, LIMIT_R, TEMPERATURE,
                                              deterministic_gates, expected_sparsity,
                                              export_gates, gates_from_noise, prob_nonzero,
                                              sample_gates)
from vllm_kvevict.train.hybrid import StreamingMask, full_attention, hybrid_attention
from vllm_kvevict.train.trainer import (FusedLMLoss, TrainConfig, Trainer, lagrangian,
                                        lr_factor, target_sparsity_at)

__all__ = ["EPS", "LIMIT_L", "LIMIT_R", "TEMPERATURE", "deterministic_gates",
           "expected_sparsity", "export_gates", "gates_from_noise", "prob_nonzero",
           "sample_gates", "StreamingMask", "full_attention", "hybrid_attention",
           "FusedLMLoss", "TrainConfig", "Trainer", "lagrangian", "lr_factor",
           "target_sparsity_at"]
