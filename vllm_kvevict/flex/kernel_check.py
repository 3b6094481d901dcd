"""Kernel-level check of the portable path (torch only, no vLLM): `flex_attention` with the
block masks the served path builds (`block_mask.py`) against the reference's attention
(`reference/attention.py`: `visibility` + `attend`), per head-mask policy, on random q, k, v
over a paged cache with scattered pages, on whatever device torch sees.

    python -m vllm_kvevict.flex.kernel_check [--device cuda] [--eager] [--blocks]

The batch is mixed on purpose: a prefill chunk resuming mid-prompt, a decode query, a first
chunk, and a recomputed (preempted) request whose generated tokens follow its prompt in one step
(each of them a chunk of its own); then the same rows under canonical chunks that split a step.
`--blocks` counts the (query block, key page) pairs a streaming and a full head compute for the
last prefill chunk and a decode query of prompts of 2K-8K tokens.
"""

from __future__ import annotations

import argparse
import functools
import time

import torch
from torch.nn.attention.flex_attention import flex_attention

from vllm_kvevict.config import DEFAULT_SINK, DEFAULT_WINDOW, KVPolicyConfig
from vllm_kvevict.flex.block_mask import blocks_computed, head_mask_block_mask, paged_queries
from vllm_kvevict.masks import num_streaming_heads
from vllm_kvevict.policies import build_policy
from vllm_kvevict.reference.attention import attend, visibility

PAGE = 16
NUM_KV_HEADS, QUERIES_PER_KV, HEAD_DIM, NUM_LAYERS = 3, 3, 64, 4
# (computed before the step, tokens in the step, prompt length)
MIXED_ROWS = ((512, 188, 700), (900, 1, 600), (0, 256, 1000), (0, 330, 300))
# (rows, canonical chunk): decodes alone (torch's short-query kernel), the mixed batch, and a
# step [100, 300) split by canonical chunks of 128 beside a one-token prompt
SCENARIOS = ((((900, 1, 1000), (40, 1, 30)), None), (MIXED_ROWS, None),
             (((100, 200, 700), (0, 1, 1)), 128))
TOKEN_CAPACITY, ROW_CAPACITY = 2048, 8  # the mask tables' fixed shapes (block_mask.py)
POLICIES = {  # name -> (policy config, head sparsity)
    "full": {"policy": "full"},
    "streaming": {"policy": "streaming"},
    "duo-0.3": {"policy": "duo", "sparsity": 0.3},
    "prulong-0.7": {"policy": "prulong", "sparsity": 0.7},
}

def attention_fn(eager: bool):
    return flex_attention if eager else compiled_flex_attention()


@functools.cache
def compiled_flex_attention():
    return torch.compile(flex_attention, fullgraph=True)  # as vLLM compiles it, once


def streaming_heads(name: str, sink: int, window: int, seed: int = 0) -> torch.Tensor:
    """Bool [L, H] from the policy object (duo/prulong: a random mask at the sparsity)."""
    raw = dict(POLICIES[name], sink=sink, window=window)
    cfg = KVPolicyConfig.from_dict(raw)
    full_heads = None
    if cfg.policy in ("duo", "prulong"):
        gen = torch.Generator().manual_seed(seed)
        order = torch.randperm(NUM_LAYERS * NUM_KV_HEADS, generator=gen)
        full_heads = torch.ones(NUM_LAYERS * NUM_KV_HEADS, dtype=torch.bool)
        full_heads[order[:num_streaming_heads(NUM_LAYERS * NUM_KV_HEADS, cfg.sparsity)]] = False
        full_heads = full_heads.view(NUM_LAYERS, NUM_KV_HEADS)
    return build_policy(cfg, NUM_LAYERS, NUM_KV_HEADS, full_heads).streaming_heads().bool()


def scattered_block_table(seq_lens: list[int], gen: torch.Generator, spare: int = 7):
    """Pages of every row at random physical places (as vLLM's pool hands them out)."""
    pages = [-(-n // PAGE) for n in seq_lens]
    num_pages = sum(pages) + spare
    perm = torch.randperm(num_pages, generator=gen)
    table = torch.zeros(len(seq_lens), max(pages), dtype=torch.int32)
    used = 0
    for r, n in enumerate(pages):
        table[r, :n] = perm[used:used + n].int()
        used += n
    return table, num_pages


def _paged_kv(lengths: list[int], table: torch.Tensor, num_pages: int,
              gen: torch.Generator):
    """Random K and V [H, n, d] per request of `lengths` keys, and the paged caches [pages *
    PAGE, H, d] holding them at the pages of `table`'s rows."""
    keys = [torch.randn(NUM_KV_HEADS, n, HEAD_DIM, generator=gen) for n in lengths]
    values = [torch.randn(NUM_KV_HEADS, n, HEAD_DIM, generator=gen) for n in lengths]
    cache_k = torch.zeros(num_pages * PAGE, NUM_KV_HEADS, HEAD_DIM)
    cache_v = torch.zeros_like(cache_k)
    for r, n in enumerate(lengths):
        pos = torch.arange(n)
        slots = table[r].long()[pos // PAGE] * PAGE + pos % PAGE
        cache_k[slots], cache_v[slots] = keys[r].transpose(0, 1), values[r].transpose(0, 1)
    return keys, values, cache_k, cache_v


def _flex_step(batch, streaming_q: torch.Tensor, sink: int, window: int, queries, cache_k,
               cache_v, device: str, eager: bool) -> torch.Tensor:
    """flex_attention of a step's queries [Hq, T, d] over the paged caches with the served
    path's block mask (`head_mask_block_mask`), on `device`; the output on the CPU."""
    to = lambda x: x.to(device)  # noqa: E731
    batch_dev = type(batch)(**{k: to(v) if isinstance(v, torch.Tensor) else v
                               for k, v in vars(batch).items()})
    mask = head_mask_block_mask(batch_dev, to(streaming_q), sink, window,
                                token_capacity=TOKEN_CAPACITY, row_capacity=ROW_CAPACITY)
    return attention_fn(eager)(to(queries)[None], to(cache_k).transpose(0, 1)[None],
                               to(cache_v).transpose(0, 1)[None], block_mask=mask,
                               scale=HEAD_DIM ** -0.5, enable_gqa=True)[0].cpu()


def run_case(streaming_kv: torch.Tensor, rows, sink: int, window: int, chunk: int | None,
             device: str, eager: bool, seed: int = 0,
             reference_streaming: torch.Tensor | None = None) -> float:
    """Max |flex - reference| over every query of the step, for one layer's head split
    (`reference_streaming`: another split for the reference, a negative control)."""
    gen = torch.Generator().manual_seed(seed)
    computed, q_lens, prompt_lens = (list(x) for x in zip(*rows))
    seq_lens = [a + c for a, c in zip(computed, q_lens)]
    table, num_pages = scattered_block_table(seq_lens, gen)
    keys, values, cache_k, cache_v = _paged_kv(seq_lens, table, num_pages, gen)
    queries = torch.randn(NUM_KV_HEADS * QUERIES_PER_KV, sum(q_lens), HEAD_DIM, generator=gen)
    batch = paged_queries(computed, q_lens, table, PAGE, num_pages, prompt_lens, chunk)
    out = _flex_step(batch, streaming_kv.repeat_interleave(QUERIES_PER_KV), sink, window,
                     queries, cache_k, cache_v, device, eager)
    scale = HEAD_DIM ** -0.5
    # the reference: one call per (row, run of queries sharing a chunk start)
    worst, first = 0.0, 0
    for r, (a, c) in enumerate(zip(computed, q_lens)):
        starts = batch.chunk_start[first:first + c]
        i = 0
        while i < c:
            j = i
            while j < c and starts[j] == starts[i]:
                j += 1
            qpos = torch.arange(a + i, a + j)
            kpos = torch.arange(a + j).expand(NUM_KV_HEADS, -1)
            seen = visibility(qpos, kpos, int(starts[i]), streaming_kv if reference_streaming
                              is None else reference_streaming, sink, window)
            ref = attend(queries[:, first + i:first + j], keys[r][:, :a + j],
                         values[r][:, :a + j], seen, scale)
            worst = max(worst, float((ref - out[:, first + i:first + j]).abs().max()))
            i = j
        first += c
    return worst


def check_policies(device: str = "cpu", eager: bool = False, sink: int = 16, window: int = 64,
                   policies=tuple(POLICIES)) -> dict[str, float]:
    """Policy -> max abs diff over its layers' head splits, mixed rows and canonical chunks."""
    results = {}
    for name in policies:
        heads = streaming_heads(name, sink, window)
        worst = 0.0
        for layer in range(NUM_LAYERS):
            for rows, chunk in SCENARIOS:
                worst = max(worst, run_case(heads[layer], rows, sink, window, chunk, device,
                                            eager, seed=layer))
        results[name] = worst
    return results


def check_token_eviction(device: str = "cpu", eager: bool = False, seed: int = 0,
                         question_sees_chunk: bool = True) -> float:
    """Max |flex - reference| for token eviction's step (`integration/attention/flex_attention.py`):
    rows over their compacted (kept) past by physical position, every head full. A prefill chunk
    of 188 tokens after 300 kept ones, a decode after 250 kept, and a patched question of 16 rows
    that shares the first row's pages (its keys written right after the chunk, which the
    chunk's own queries must not see). `question_sees_chunk=False`: a reference whose question
    row sees only its own keys (a negative control: must differ)."""
    gen = torch.Generator().manual_seed(seed)
    kept, chunk, question = 300, 188, 16
    lengths = [kept + chunk + question, 251]           # keys stored per request
    table, num_pages = scattered_block_table(lengths, gen)
    table = torch.cat([table, table[:1]])               # the question row: request 0's pages
    computed, q_lens = [kept, 250, kept + chunk], [chunk, 1, question]
    keys, values, cache_k, cache_v = _paged_kv(lengths, table, num_pages, gen)
    hq = NUM_KV_HEADS * QUERIES_PER_KV
    queries = torch.randn(hq, sum(q_lens), HEAD_DIM, generator=gen)
    batch = paged_queries(computed, q_lens, table, PAGE, num_pages)
    out = _flex_step(batch, torch.zeros(hq, dtype=torch.bool), 0, 0, queries, cache_k, cache_v,
                     device, eager)
    scale = HEAD_DIM ** -0.5
    worst, first = 0.0, 0
    for request, a, c in zip((0, 1, 0), computed, q_lens):
        qpos = torch.arange(a, a + c)
        kpos = torch.arange(a + c).expand(NUM_KV_HEADS, -1)
        seen = visibility(qpos, kpos, a, torch.zeros(NUM_KV_HEADS, dtype=torch.bool), 0, 0)
        if first and c == question and not question_sees_chunk:
            seen[..., :a] = False
        ref = attend(queries[:, first:first + c], keys[request][:, :a + c],
                     values[request][:, :a + c], seen, scale)
        worst = max(worst, float((ref - out[:, first:first + c]).abs().max()))
        first += c
    return worst


def block_counts(lengths=(2048, 4096, 8192), chunk: int = 256, sink: int = DEFAULT_SINK,
                 window: int = DEFAULT_WINDOW) -> list[dict]:
    """Per prompt length: (query block, key page) pairs a full and a streaming head compute for
    the prompt's last prefill chunk and for a decode query right after it."""
    out = []
    streaming_q = torch.tensor([False, True])
    for n in lengths:
        gen = torch.Generator().manual_seed(n)
        table, num_pages = scattered_block_table([n + 1], gen)
        prefill = head_mask_block_mask(
            paged_queries([n - chunk], [chunk], table, PAGE, num_pages, [n]), streaming_q,
            sink, window)
        decode = head_mask_block_mask(
            paged_queries([n], [1], table, PAGE, num_pages, [n]), streaming_q, sink, window)
        (pf, ps), (df, ds) = blocks_computed(prefill).tolist(), blocks_computed(decode).tolist()
        out.append({"prompt": n, "prefill_full": pf, "prefill_streaming": ps,
                    "decode_full": df, "decode_streaming": ds})
    return out


def time_heads(n: int = 8192, chunk: int = 256, sink: int = DEFAULT_SINK,
               window: int = DEFAULT_WINDOW, repeats: int = 5) -> tuple[float, float]:
    """Seconds of the last prefill chunk of an n-token prompt, all heads full vs all streaming."""
    gen = torch.Generator().manual_seed(0)
    table, num_pages = scattered_block_table([n], gen)
    batch = paged_queries([n - chunk], [chunk], table, PAGE, num_pages, [n])
    hq = NUM_KV_HEADS * QUERIES_PER_KV
    q = torch.randn(1, hq, chunk, HEAD_DIM, generator=gen)
    k = torch.randn(1, NUM_KV_HEADS, num_pages * PAGE, HEAD_DIM, generator=gen)
    fn = attention_fn(False)
    times = []
    for streaming in (False, True):
        mask = head_mask_block_mask(batch, torch.full((hq,), streaming), sink, window,
                                    token_capacity=TOKEN_CAPACITY, row_capacity=ROW_CAPACITY)
        fn(q, k, k, block_mask=mask, enable_gqa=True)  # compile
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn(q, k, k, block_mask=mask, enable_gqa=True)
        times.append((time.perf_counter() - t0) / repeats)
    return times[0], times[1]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--eager", action="store_true", help="flex_attention uncompiled")
    parser.add_argument("--blocks", action="store_true", help="also count blocks, 2K-8K")
    parser.add_argument("--tol", type=float, default=1e-4)
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, device {args.device}, "
          f"{'eager' if args.eager else 'compiled'} flex_attention")
    ok = True
    results = check_policies(args.device, args.eager)
    results["token-evict"] = check_token_eviction(args.device, args.eager)
    for name, diff in results.items():
        passed = diff <= args.tol
        ok &= passed
        print(f"{name:12s} max abs diff vs reference {diff:.2e}  {'ok' if passed else 'FAIL'}")
    if args.blocks:
        print("blocks computed per head (query block x key page), sink 64, window 256, "
              "chunk 256, page 16:")
        for row in block_counts():
            print("  prompt {prompt:5d}: last chunk full {prefill_full:5d} streaming "
                  "{prefill_streaming:4d} | decode full {decode_full:3d} streaming "
                  "{decode_streaming:3d}".format(**row))
        full, stream = time_heads()
        print(f"  8K prompt, last chunk: all-full {full * 1e3:.1f} ms, all-streaming "
              f"{stream * 1e3:.1f} ms (ratio {full / stream:.1f}x)")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
