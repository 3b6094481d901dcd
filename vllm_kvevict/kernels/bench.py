"""Time `head_pages_attention` against torch's SDPA on a GPU; prints one JSON document.

    python -m vllm_kvevict.kernels.bench [--contexts 8192,32768] [--batches 1,8] [--out FILE]

One Llama-3.1-8B attention layer (32 query / 8 KV heads, d 128, bfloat16). Per (phase,
context, batch): `sdpa` over contiguous K/V [batch, 8, n, d] (prefill: causal, bottom-right),
then the kernel over scattered 16-token pages for `dense` (every head full), `prulong-0.7`
(2 of 8 KV heads full, 6 streaming) and `streaming` (every head streaming; sink 64, window
256 as config.py's defaults). Decode: one token a request after `context`; prefill: a chunk of
`--chunk` tokens after `context`. `bytes` is the K/V the kernel must read, `gbps` bytes / time;
`err`: the dense cell's max |kernel - sdpa|. Needs CUDA; the kernel's exactness is tested on
the CPU in Triton's interpreter (tests/test_triton_head_pages.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from vllm_kvevict.config import DEFAULT_SINK, DEFAULT_WINDOW
from vllm_kvevict.kernels.head_pages import head_pages_attention

Q_HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
KINDS = {"dense": 0, "prulong-0.7": 6, "streaming": 8}  # streaming KV heads of the 8


def _ms(fn, iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(3):
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return sorted(times)[1]


def cell(phase: str, context: int, batch: int, args, dev: str = "cuda") -> list[dict]:
    dt = torch.bfloat16
    t = 1 if phase == "decode" else args.chunk
    n = context + t
    pages = -(-n // PAGE)
    gen = torch.Generator(device=dev).manual_seed(0)
    k = torch.randn(batch, KV_HEADS, n, HEAD_DIM, device=dev, dtype=dt, generator=gen)
    v = torch.randn(batch, KV_HEADS, n, HEAD_DIM, device=dev, dtype=dt, generator=gen)
    q = torch.randn(batch, Q_HEADS, t, HEAD_DIM, device=dev, dtype=dt, generator=gen)
    # The pool: every (request, KV head)'s logical pages scattered over it.
    perm = torch.randperm(batch * KV_HEADS * pages, device=dev, generator=gen)
    table = perm.view(batch, KV_HEADS, pages).to(torch.int32)
    k_cache = torch.empty(batch * KV_HEADS * pages, PAGE, HEAD_DIM, device=dev, dtype=dt)
    v_cache = torch.empty_like(k_cache)
    pad = pages * PAGE - n
    k_cache[perm] = torch.nn.functional.pad(k, (0, 0, 0, pad)).reshape(-1, PAGE, HEAD_DIM)
    v_cache[perm] = torch.nn.functional.pad(v, (0, 0, 0, pad)).reshape(-1, PAGE, HEAD_DIM)
    lengths = torch.full((batch, KV_HEADS), n, dtype=torch.int32, device=dev)
    qsl = (torch.arange(batch + 1, device=dev) * t).to(torch.int32)
    qk = q.transpose(1, 2).reshape(batch * t, Q_HEADS, HEAD_DIM).contiguous()
    mask = None
    if t > 1:
        from torch.nn.attention.bias import causal_lower_right
        mask = causal_lower_right(t, n)
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
        q, k, v, attn_mask=mask, enable_gqa=True)
    base = dict(phase=phase, context=context, batch=batch, tokens=t)
    sdpa_ms = _ms(sdpa, args.iters)
    rows = [dict(base, kind="sdpa", ms=sdpa_ms, bytes=2 * k.numel() * 2)]
    near = min(n, args.sink + args.window + t)
    for kind, stream in KINDS.items():
        flags = torch.arange(KV_HEADS, device=dev) >= KV_HEADS - stream
        run = lambda: head_pages_attention(  # noqa: E731
            qk, k_cache, v_cache, table, lengths, qsl, streaming=flags, sink=args.sink,
            window=args.window, max_query_len=t, num_splits=args.splits, block_n=args.block_n,
            block_m=args.block_m)
        ms = _ms(run, args.iters)
        nbytes = batch * 2 * HEAD_DIM * 2 * ((KV_HEADS - stream) * n + stream * near)
        row = dict(base, kind=kind, ms=ms, vs_sdpa=ms / sdpa_ms, bytes=nbytes,
                   gbps=nbytes / ms / 1e6)
        if kind == "dense":
            ref = sdpa().transpose(1, 2).reshape(batch * t, Q_HEADS, HEAD_DIM)
            row["err"] = float((run().float() - ref.float()).abs().max())
        rows.append(row)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    p.add_argument("--contexts", type=ints, default=[8192, 32768, 131072])
    p.add_argument("--batches", type=ints, default=[1, 8])
    p.add_argument("--phases", default="decode,prefill")
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--sink", type=int, default=DEFAULT_SINK)
    p.add_argument("--window", type=int, default=DEFAULT_WINDOW)
    p.add_argument("--splits", type=int, default=None, help="KV splits (default: auto)")
    p.add_argument("--block-n", type=int, default=64)
    p.add_argument("--block-m", type=int, default=64)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--budget-s", type=float, default=300.0, help="no new cell after this")
    p.add_argument("--out", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("vllm_kvevict.kernels.bench needs a CUDA GPU (torch.cuda.is_available() is "
              "False); on the CPU the kernel is checked in Triton's interpreter: "
              "pytest tests/test_triton_head_pages.py (it turns the interpreter on)",
              file=sys.stderr)
        return 2
    start, cells = time.monotonic(), []
    for phase in args.phases.split(","):
        for context in args.contexts:
            for batch in args.batches:
                if time.monotonic() - start > args.budget_s:
                    cells.append(dict(phase=phase, context=context, batch=batch,
                                      status="skipped: budget"))
                    continue
                try:
                    cells += cell(phase, context, batch, args)
                except Exception as exc:  # report every cell (out of memory, ...)
                    cells.append(dict(phase=phase, context=context, batch=batch,
                                      status=f"error: {type(exc).__name__}: {exc}"[:300]))
                torch.cuda.empty_cache()
                print(json.dumps(cells[-1]), file=sys.stderr, flush=True)
    doc = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
               triton=__import__("triton").__version__, cells=cells)
    text = json.dumps(doc, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
