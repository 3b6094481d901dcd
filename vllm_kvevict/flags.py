"""The `--kv-*` flags: one table naming each flag, its `KVPolicyConfig` field and its help, and the
one-line start-up error. Plain Python (no vLLM import): `integration/entrypoints/cli.py` puts the
table on vLLM's parser, `launch.py` (tests, evaluation, load tests, scripts) builds command lines
from it, `integration/entrypoints/validation.py` stops a server with `fail`."""

from __future__ import annotations

import re
import sys

from vllm_kvevict.config import (ADMISSION_MODES, ATTENTION_BACKENDS, DEFAULT_DECODE_INTERVAL,
                                 DEFAULT_OBS_WINDOW, DEFAULT_POOL_KERNEL, DEFAULT_SINK,
                                 DEFAULT_SPARSITY, DEFAULT_WINDOW, EVICTION_MODES, POLICIES,
                                 PREFIX_REUSE_MODES, TP_HEAD_ORDERS, KVPolicyError)

# flag -> (KVPolicyConfig field, type, help)
FLAGS = {
    "--kv-policy": ("policy", str,
                    f"KV eviction policy: {', '.join(POLICIES)} (default: full = stock vLLM). "
                    "streaming/duo/prulong keep their streaming heads' sink + window in "
                    "blocks of vLLM's own pool, freed as the window moves (counted by vLLM's "
                    "admission and kv_cache_usage_perc), and keep vLLM's prefix caching on: "
                    "the prompt is then chunked at multiples of --kv-eviction-chunk (default "
                    "--max-num-batched-tokens); "
                    "hits start at chunk boundaries or inside a prompt's last chunk, and a "
                    "chunk's positions before its last window are not stored (vLLM's "
                    "--prefix-cache-retention-interval: 0 by default; None stores every "
                    "position, for hits at any block; with --no-enable-prefix-caching each "
                    "step is its own chunk). snapkv/pyramidkv and "
                    "--kv-token-policy run with prefix caching off unless "
                    "--enable-prefix-caching is given with --kv-eviction naive: then a hit at "
                    "a chunk boundary (--kv-eviction-chunk, default --max-num-batched-tokens) "
                    "reuses the compacted blocks (patched eviction scores each chunk with the "
                    "prompt's last tokens, so its explicit --enable-prefix-caching is "
                    "refused)."),
    "--kv-sparsity": ("sparsity", float,
                      "Head sparsity (share of streaming KV heads) for duo/prulong; token "
                      "sparsity p (share of each prefill chunk's KVs evicted) for "
                      f"snapkv/pyramidkv. In [0, 1]; default {DEFAULT_SPARSITY}."),
    "--kv-sink": ("sink", int, f"Sink tokens kept by streaming heads (default {DEFAULT_SINK}; "
                               "paper: 128)."),
    "--kv-window": ("window", int, "Local window of streaming heads, in tokens (default "
                                   f"{DEFAULT_WINDOW}; paper: 1024)."),
    "--kv-obs-window": ("obs_window", int, "Observation window k of snapkv/pyramidkv, in tokens "
                                           f"(default {DEFAULT_OBS_WINDOW}, as in the paper)."),
    "--kv-pool-kernel": ("pool_kernel", int, "Average-pool kernel smoothing snapkv/pyramidkv "
                                             f"scores (odd; default {DEFAULT_POOL_KERNEL})."),
    "--kv-eviction": ("eviction", str, "Chunked eviction mode of snapkv/pyramidkv: "
                                       f"{' or '.join(EVICTION_MODES)} (default patched, as in the paper)."),
    "--kv-tiers": ("tiers", int, "snapkv/pyramidkv: split the layers into this many tiers of "
                                 "consecutive layers, each with its own vLLM KV-cache group "
                                 "(block table), so a tier holds only its own largest per-layer "
                                 "budget. Must divide the layer count. Default: one per layer "
                                 "for pyramidkv, 1 for snapkv."),
    "--kv-admission": ("admission", str,
                       "Admission of evicting policies: reserve (default: admit a request only "
                       "when its whole growth fits next to the running requests', so none is "
                       "ever preempted) or vllm (stock: admit when the prompt fits; under "
                       "pressure vLLM preempts, and the preempted request is recomputed with "
                       f"its original chunk boundaries, exactly). One of "
                       f"{', '.join(ADMISSION_MODES)}."),
    "--kv-eviction-chunk": ("eviction_chunk", int,
                            "snapkv/pyramidkv: evict once per this many prompt tokens (the "
                            "paper's chunk), while vLLM prefills in steps of "
                            "--max-num-batched-tokens (which then must be >= --kv-obs-window). "
                            "Default: evict after every prefill chunk vLLM schedules. "
                            "streaming/duo/prulong: the prompt's prefill chunk (default: "
                            "--max-num-batched-tokens with prefix caching on, each step "
                            "without); set it below --max-num-batched-tokens so a chunk runs in "
                            "one step beside the decodes that share the budget."),
    "--kv-token-policy": ("token_policy", str,
                          "duo/prulong: also evict tokens of the full heads with this policy "
                          "(snapkv or pyramidkv; --kv-eviction, --kv-obs-window, --kv-tiers "
                          "apply), streaming heads keeping sink + window. Default: none."),
    "--kv-token-sparsity": ("token_sparsity", float,
                            "Token sparsity p of --kv-token-policy (share of each prefill "
                            "chunk's KVs a full head evicts), while --kv-sparsity stays the "
                            f"head sparsity. In [0, 1]; default {DEFAULT_SPARSITY}."),
    "--kv-decode-budget": ("decode_budget", int,
                           "snapkv/pyramidkv (and --kv-token-policy's full heads): decode-time "
                           "eviction. Every --kv-decode-interval "
                           "generated tokens each layer's KV is compressed back to this many "
                           "tokens per KV head (pyramidkv: spread over the layers as its prompt "
                           "budget), scored by the last min(--kv-obs-window, interval, budget) "
                           "decode queries; the freed blocks return to vLLM's pool. Default: "
                           "off (generated tokens are never evicted)."),
    "--kv-decode-interval": ("decode_interval", int,
                             "Generated tokens between two decode-time compressions "
                             f"(--kv-decode-budget); default {DEFAULT_DECODE_INTERVAL}."),
    "--kv-mask": ("mask_path", str, "Head-mask file for duo/prulong (our JSON format, PruLong "
                                    "0/1 TSV or DuoAttention gate TSV). Default: the mask shipped "
                                    "in head_masks/ for the served model."),
    "--kv-attention-backend": ("attention_backend", str,
                               "Attention path: cpu (vLLM's CPU attention kernel; the "
                               "default on the CPU platform) or flex (vLLM's FlexAttention "
                               "backend, streaming heads as block-sparse masks; the default, "
                               "and the only path, on other platforms) or triton (our Triton "
                               "kernel over each head's pages; head masks and full, on the CPU "
                               "under TRITON_INTERPRET=1 for now). One of "
                               f"{', '.join(ATTENTION_BACKENDS)}."),
    "--kv-tp-head-order": ("tp_head_order", str,
                           "A head mask under --tensor-parallel-size: balanced (default: each "
                           "layer's KV heads, with their query heads and o_proj's columns, "
                           "permuted as the weights load so every rank holds its share of the "
                           "layer's full heads; vLLM pads every rank's cache to the fullest "
                           "rank's) or contiguous (vLLM's head order). One of "
                           f"{', '.join(TP_HEAD_ORDERS)}."),
    "--kv-prefix-reuse": ("prefix_reuse", str,
                          "snapkv/pyramidkv with --kv-eviction patched and "
                          "--enable-prefix-caching: exact (default: patched eviction refuses "
                          "prefix caching, each chunk being scored with the request's own "
                          "question) or across-questions (a hit at a chunk boundary reuses "
                          "chunks compressed under an earlier request's question; kv_stats "
                          "counts them in reused_chunks_other_question). One of "
                          f"{', '.join(PREFIX_REUSE_MODES)}."),
    "--kv-full-block-size": ("full_block_size", int,
                             "duo/prulong on the CPU attention path: tokens per block of the "
                             "full heads' KV-cache groups, a multiple of --block-size (which "
                             "the streaming heads keep). E.g. --block-size 64 (the bundled "
                             "masks' 64-token sink in whole blocks) with 128 (vLLM's CPU "
                             "kernel reads 128-token blocks faster). Default: --block-size."),
}


FLAG_OF_FIELD = {field: flag for flag, (field, _type, _help) in FLAGS.items()}


def flag_message(exc: KVPolicyError) -> str:
    """The error with its setting named as the flag a user typed (`--kv-sparsity must ...`)."""
    message, flag = str(exc), FLAG_OF_FIELD.get(exc.field or "")
    return re.sub(rf"^{re.escape(exc.field)}\b", flag, message) if flag else message


def fail(message: str) -> "None":
    """One line on stderr, exit code 2 (argparse's usage-error code), before any model loads."""
    print(f"vllm-kvevict: error: {message}", file=sys.stderr)
    raise SystemExit(2)
