"""vLLM's CPU decode kernel alone, per KV head, over caches laid out as the pool lays them:
the same work (8 requests x 4,256 tokens, 3 KV heads x 3 query heads, head 64, float32) with
64- or 128-token blocks, in stock's layer-outer cache (a layer's blocks side by side) or in
the block-outer pool of a head mask (`pool_groups`: a block of every group costs WIDTH head
pages, so a layer's block is WIDTH head pages from its next), reading 1-3 of the heads.
Ten layers in rotation (more than L3 holds, as a decode step reads them); rounds interleave
the layouts and the median is printed.

    OMP_NUM_THREADS=1 python scripts/kernel_blocks.py [--rounds 4]
"""
import argparse
import statistics
import time

import torch
from vllm import _custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

REQUESTS, TOKENS, QUERIES_PER_KV, HEAD, LAYERS = 8, 4256, 3, 64, 10


def per_head_ms(block: int, layout: str, width: int, heads: int, reps: int = 10) -> float:
    """ms per KV head of one kernel call over `heads` heads: `layout` "layer-outer" (a layer's
    cache [blocks, width, block, 2 x head]) or "block-outer" (one pool [blocks, layers, width,
    block, 2 x head], a layer's view of it)."""
    per_req = -(-TOKENS // block)
    num_blocks = REQUESTS * per_req + 8
    if layout == "block-outer":
        pool = torch.randn(num_blocks, LAYERS, width, block, 2 * HEAD)
        caches = [pool[:, i, :heads] for i in range(LAYERS)]
    else:
        caches = [torch.randn(num_blocks, width, block, 2 * HEAD)[:, :heads] for _ in range(LAYERS)]
    kv = [c.view(num_blocks, heads, 2 * block, HEAD).chunk(2, dim=2) for c in caches]
    table = torch.arange(1, 1 + REQUESTS * per_req, dtype=torch.int32).view(REQUESTS, per_req)
    query = torch.randn(REQUESTS, heads * QUERIES_PER_KV, HEAD)
    out = torch.empty_like(query)
    starts = torch.arange(REQUESTS + 1, dtype=torch.int32)
    lens = torch.full((REQUESTS,), TOKENS, dtype=torch.int32)
    isa = _get_attn_isa(torch.float32, block, HEAD)
    sched = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=REQUESTS, num_heads=heads * QUERIES_PER_KV, num_kv_heads=heads, head_dim=HEAD,
        seq_lens=lens, dtype=torch.float32, query_start_loc=starts, causal=True,
        sliding_window_size=-1, isa=isa, enable_kv_split=False, dynamic_causal=None,
        kv_cache_dtype="auto")

    def call(k, v):
        ops.cpu_attention_with_kv_cache(
            query=query, key_cache=k, value_cache=v, output=out, query_start_loc=starts,
            seq_lens=lens, scale=HEAD ** -0.5, causal=True, alibi_slopes=None, sliding_window=-1,
            block_table=table, softcap=0.0, scheduler_metadata=sched, s_aux=None,
            dynamic_causal=None, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    for k, v in kv:
        call(k, v)
    t = time.perf_counter()
    for _ in range(reps):
        for k, v in kv:
            call(k, v)
    return (time.perf_counter() - t) / reps / LAYERS / heads * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    cases = [(128, "layer-outer", 3, 3), (64, "layer-outer", 3, 3), (64, "block-outer", 9, 3),
             (64, "block-outer", 9, 2), (64, "block-outer", 9, 1), (128, "block-outer", 9, 3),
             (128, "block-outer", 8, 2)]
    times = {c: [] for c in cases}
    for _ in range(args.rounds):
        for c in cases:
            times[c].append(per_head_ms(*c))
    print("| block | layout | width (head pages) | heads read | ms per KV head (median) |")
    print("|---|---|---|---|---|")
    for c in cases:
        print(f"| {c[0]} | {c[1]} | {c[2]} | {c[3]} | {statistics.median(times[c]):.3f} |")


if __name__ == "__main__":
    main()
