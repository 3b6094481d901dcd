"""Tensor-parallel padding of a head mask: what vLLM's equal-specs rule costs, and what a
balanced head order would cost (issue 47).

vLLM gives rank r the contiguous KV heads [r H/T, (r + 1) H/T) and wants every rank to declare
the same KV-cache spec per layer, so each rank's paged cache holds the most full heads any rank
has in that layer (`kv_cache_specs.layer_heads`), and its streaming companion the most
streaming heads. "contiguous" is that rule on the mask as trained; "balanced" is the same rule
after permuting each layer's KV heads (with their query heads and o_proj's columns) so that
every rank gets ceil or floor of the layer's full heads / T: exact up to the float order of
tensor parallel's own all-reduce; served by default (`--kv-tp-head-order balanced`,
`vllm_kvevict/integration/worker/head_order.py`: the weights are permuted as they load).
Ratios are padded / unpadded bytes; full heads' bytes grow with the context, the streaming
companions' stay at sink + window.

    python scripts/tp_padding.py head_masks/Meta-Llama-3.1-8B-Instruct/duo.json \
        --policy duo --sparsity 0.5 0.7 --tp 2 4 8
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vllm_kvevict.masks import (duo_quantile_full_heads, full_heads_at_sparsity,  # noqa: E402
                                load_head_gates)


def padding(full: torch.Tensor, tp: int) -> dict[str, float]:
    """full: bool [L, H]. Padded / unpadded heads, full and streaming, both orders."""
    layers, heads = full.shape
    per_rank = full.view(layers, tp, heads // tp)
    n_full, n_stream = full.sum().item(), (~full).sum().item()
    f_layer = full.sum(dim=1).tolist()
    contiguous_full = tp * per_rank.sum(dim=2).max(dim=1).values.sum().item()
    contiguous_stream = tp * (~per_rank).sum(dim=2).max(dim=1).values.sum().item()
    balanced_full = tp * sum(math.ceil(f / tp) for f in f_layer)
    balanced_stream = tp * sum(math.ceil((heads - f) / tp) for f in f_layer)
    return {"full_contiguous": contiguous_full / n_full,
            "full_balanced": balanced_full / n_full,
            "stream_contiguous": contiguous_stream / n_stream if n_stream else 1.0,
            "stream_balanced": balanced_stream / n_stream if n_stream else 1.0}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mask")
    parser.add_argument("--policy", choices=("duo", "prulong"), default="duo")
    parser.add_argument("--sparsity", type=float, nargs="+", default=[0.5, 0.7])
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4, 8])
    args = parser.parse_args(argv)
    gates = load_head_gates(args.mask)
    pick = duo_quantile_full_heads if args.policy == "duo" else full_heads_at_sparsity
    print(f"{args.mask} ({args.policy}'s head choice), padded / unpadded heads' bytes\n")
    print("| sparsity | TP | full heads, contiguous (vLLM's order, before) | full heads, "
          "balanced order (served) | streaming heads, contiguous | streaming heads, balanced |")
    print("|---|---|---|---|---|---|")
    for sparsity in args.sparsity:
        full = pick(gates, sparsity)
        for tp in args.tp:
            p = padding(full, tp)
            print(f"| {sparsity} | {tp} | {p['full_contiguous']:.2f}x | {p['full_balanced']:.2f}x"
                  f" | {p['stream_contiguous']:.2f}x | {p['stream_balanced']:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
