"""The head-pages Triton kernel (`vllm_kvevict/kernels/head_pages.py`) in Triton's interpreter,
against the reference's masked attention (`reference/attention.py`: `visibility`, `attend`).

Each case builds, per request and KV head, the reference's explicit cache at true positions
and the kernel's pool: scattered pages, a causal head's kept tokens in slot order, a streaming
head's pages by logical index. Every slot the step may not read (a streaming head's positions
in [S, a - W), unused slots, the pages of a streaming head's evicted middle) holds NaN, so a
kernel that reads and uses one fails.

The interpreter: Triton jits its own library (tl.max, tl.sum, ...) when `triton` is imported,
for the interpreter only if TRITON_INTERPRET=1 then. So this module imports Triton with it set
when nothing imported Triton before (the kernel module jits its kernels per call, under the
setting the tests give); in a process that already imported Triton without it (a pytest-xdist
worker that ran vLLM's tests first), the tests skip here and `test_in_fresh_process` runs this
file in a pytest process of its own with the interpreter on. `test_compiles_for_cuda` compiles
the kernels for sm_90 (no GPU needed) in a process without the interpreter.
"""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys

import pytest
import torch
import triton_interpreter

triton = triton_interpreter.import_interpreted_triton()
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from vllm_kvevict.kernels.head_pages import head_pages_attention  # noqa: E402
from vllm_kvevict.reference.attention import EMPTY, attend, visibility  # noqa: E402

IN_PROCESS = isinstance(triton.language.standard.sum, InterpretedFunction)
NO_INTERPRETER = ("test_in_fresh_process", "test_compiles_for_cuda")
FULL, STREAM, COMPACT = "full", "stream", "compact"
TOL = {torch.float32: 1e-5, torch.bfloat16: 2.0 ** -6, torch.float16: 2.0 ** -8}


@pytest.fixture(autouse=True)
def _interpreter(request, monkeypatch):
    if request.function.__name__ in NO_INTERPRETER:
        return
    if not IN_PROCESS:
        pytest.skip("Triton was imported here without the interpreter: test_in_fresh_process")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def test_in_fresh_process():
    if IN_PROCESS:
        pytest.skip("the kernel tests run in this process")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop("PYTEST_XDIST_WORKER", None)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-p", "no:xdist", __file__, "-k",
                           " and ".join(f"not {name}" for name in NO_INTERPRETER)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1], \
        proc.stdout[-2000:]


def test_compiles_for_cuda(tmp_path):
    """The compiler's view, no GPU needed: both kernels compile for sm_90 (H100 / H200) with
    this Triton, for a split bfloat16 decode tile and a float32 one (compile_check.py)."""
    import triton.backends

    if not os.path.isdir(os.path.join(os.path.dirname(triton.backends.__file__), "nvidia")):
        pytest.skip("this Triton has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "vllm_kvevict.kernels.compile_check",
                           "--quick"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "all ok" in proc.stdout, proc.stdout + proc.stderr[-3000:]


def run_step(kinds, requests, *, group=4, head_dim=32, page_size=8, sink=4, window=12,
             dtype=torch.float32, seed=0, num_splits=None, block_n=16, block_m=64,
             starts=None):
    """One launch. kinds: per KV head FULL / STREAM / COMPACT; requests: (a, q_len, kept) with
    a the step's first position and kept the past tokens a COMPACT head keeps (of [0, a)).
    starts: per request, each query's chunk start (passed as `chunk_start`; None: a).
    Returns max |kernel - reference| / (1 + |reference|)."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    kv_heads, q_heads = len(kinds), len(kinds) * group
    streaming = torch.tensor([k == STREAM for k in kinds])
    tokens = sum(q_len for _, q_len, _ in requests)
    q = torch.randn(tokens, q_heads, head_dim, generator=gen).to(dtype)
    # Slots per (request, head): position held in each slot (None: must not be read).
    starts = starts or [[a] * q_len for a, q_len, _ in requests]
    layouts, refs = [], []
    for (a, q_len, kept), first in zip(requests, (min(s) for s in starts)):
        length = a + q_len
        hist_k = torch.randn(kv_heads, length, head_dim, generator=gen).to(dtype)
        hist_v = torch.randn(kv_heads, length, head_dim, generator=gen).to(dtype)
        per_head = []
        for h, kind in enumerate(kinds):
            if kind == COMPACT:
                pos = sorted(rng.sample(range(a), min(kept, a))) + list(range(a, length))
                slots = pos
            elif kind == FULL:
                pos = slots = list(range(length))
            else:
                pos = list(range(length))
                slots = [p if p < sink or p >= first - window else None for p in pos]
            per_head.append((pos, slots))
        layouts.append((hist_k, hist_v, per_head))
        refs.append((a, q_len, hist_k, hist_v, [pos for pos, _ in per_head]))

    # The pool: page 0..n scattered; `poison` pages hold NaN.
    need = sum(math.ceil(len(s) / page_size) for _, _, ph in layouts for _, s in ph) + 1
    order = list(range(need))
    rng.shuffle(order)
    poison = order.pop()
    k_cache = torch.full((need, page_size, head_dim), float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    max_pages = max(math.ceil(len(s) / page_size) for _, _, ph in layouts for _, s in ph)
    table = torch.full((len(requests), kv_heads, max_pages), poison, dtype=torch.int32)
    lengths = torch.zeros(len(requests), kv_heads, dtype=torch.int32)
    for r, (hist_k, hist_v, per_head) in enumerate(layouts):
        for h, (_, slots) in enumerate(per_head):
            lengths[r, h] = len(slots)
            for lp in range(math.ceil(len(slots) / page_size)):
                chunk = slots[lp * page_size:(lp + 1) * page_size]
                if all(p is None for p in chunk):
                    continue  # an evicted page: the table keeps the poison page
                page = order.pop()
                table[r, h, lp] = page
                for j, p in enumerate(chunk):
                    if p is not None:
                        k_cache[page, j] = hist_k[h, p]
                        v_cache[page, j] = hist_v[h, p]
    qsl = torch.tensor([0] + [q_len for _, q_len, _ in requests], dtype=torch.int32).cumsum(
        0).to(torch.int32)
    chunk_start = torch.tensor([c for s in starts for c in s], dtype=torch.int32)
    out = head_pages_attention(q, k_cache, v_cache, table, lengths, qsl, streaming=streaming,
                               sink=sink, window=window, num_splits=num_splits,
                               block_n=block_n, block_m=block_m,
                               chunk_start=chunk_start if any(
                                   s != [a] * q for s, (a, q, _) in zip(starts, requests))
                               else None)
    assert out.shape == q.shape and out.dtype == dtype

    err = 0.0
    scale = 1.0 / math.sqrt(head_dim)
    for r, (a, q_len, hist_k, hist_v, positions) in enumerate(refs):
        width = max(len(p) for p in positions)
        key_pos = torch.full((kv_heads, width), EMPTY, dtype=torch.long)
        keys = torch.zeros(kv_heads, width, head_dim, dtype=dtype)
        values = torch.zeros_like(keys)
        for h, pos in enumerate(positions):
            key_pos[h, :len(pos)] = torch.tensor(pos)
            keys[h, :len(pos)] = hist_k[h, pos]
            values[h, :len(pos)] = hist_v[h, pos]
        rows = slice(int(qsl[r]), int(qsl[r + 1]))
        expect = torch.cat([  # each query over what its own chunk [c, ...) lets it see
            attend(q[rows][i:i + 1].transpose(0, 1), keys, values,
                   visibility(torch.tensor([a + i]), key_pos, c, streaming, sink, window),
                   scale).float() for i, c in enumerate(starts[r])], dim=1)
        got = out[rows].transpose(0, 1).float()
        assert torch.isfinite(got).all(), f"request {r}: NaN/inf (a slot it must not read?)"
        err = max(err, float(((got - expect).abs() / (1 + expect.abs())).max()))
    return err


def check(err, dtype=torch.float32):
    assert err <= TOL[dtype], f"error {err:.3g} > {TOL[dtype]:.3g} ({dtype})"


def test_full_heads_prefill_decode_mixed_batch():
    # A fresh prefill, a chunk over past pages, two decode steps: one launch, odd lengths.
    reqs = [(0, 13, 0), (21, 7, 0), (37, 1, 0), (5, 1, 0)]
    check(run_step([FULL, FULL], reqs, page_size=8))
    check(run_step([FULL], reqs, page_size=5, group=1, head_dim=40, seed=1))


def test_streaming_edges_inside_pages():
    # sink 5, window 11, pages of 8: the sink ends and the window starts inside a page.
    for a, q_len in ((0, 19), (9, 6), (23, 9), (40, 1), (61, 1), (30, 17)):
        check(run_step([STREAM, STREAM], [(a, q_len, 0)], sink=5, window=11, page_size=8,
                       seed=a))
    # window start and sink end in one tile, pages of 3
    check(run_step([STREAM], [(14, 4, 0), (50, 1, 0)], sink=3, window=9, page_size=3, seed=7))


def test_full_and_streaming_heads_one_launch_gqa():
    # prulong-like: 2 of 4 KV heads stream, 4 query heads each; prefill, chunk and decodes.
    kinds = [FULL, STREAM, STREAM, FULL]
    reqs = [(0, 20, 0), (29, 13, 0), (45, 1, 0), (70, 1, 0)]
    check(run_step(kinds, reqs, sink=4, window=16, page_size=16))
    check(run_step(kinds, reqs, group=2, sink=6, window=10, page_size=4, seed=3))


def test_chunk_starts_per_query():
    # A canonical chunk begun in an earlier step (the step starts at 30, its chunk at 24), and
    # decode queries each a chunk of its own (speculative drafts, a teacher-forced tail).
    kinds = [FULL, STREAM, STREAM, FULL]
    reqs = [(30, 9, 0), (57, 4, 0), (80, 1, 0)]
    starts = [[24] * 9, [57, 58, 59, 60], [80]]
    check(run_step(kinds, reqs, sink=5, window=11, page_size=8, starts=starts))
    check(run_step([STREAM], [(41, 6, 0)], sink=3, window=7, page_size=4,
                   starts=[[36, 36, 36, 44, 45, 46]], seed=4, num_splits=1))
    check(run_step(kinds, [(90, 3, 0)], sink=4, window=9, page_size=8, starts=[[90, 91, 92]],
                   num_splits=4, seed=5))


def test_compacted_heads_and_hybrid():
    # token eviction: each head keeps its own subset of the past, compacted; the hybrid adds
    # streaming heads in the same launch.
    reqs = [(40, 9, 13), (33, 1, 10), (18, 1, 18)]
    check(run_step([COMPACT, COMPACT], reqs, page_size=8, seed=4))
    check(run_step([COMPACT, STREAM, COMPACT, FULL], reqs, sink=4, window=8, page_size=6,
                   seed=5))


def test_decode_split_kv():
    # Long enough for several tiles per split; streaming heads leave most splits empty.
    kinds = [FULL, STREAM, COMPACT]
    reqs = [(150, 1, 60), (97, 1, 40)]
    for splits in (1, 4, 8):
        check(run_step(kinds, reqs, sink=4, window=20, page_size=16, num_splits=splits,
                       seed=splits))
    # a split prefill chunk too (the same partials and combine)
    check(run_step([FULL, STREAM], [(60, 12, 0)], sink=4, window=20, num_splits=4, seed=9))


def test_chunked_prefill_then_decode_sequence():
    # One request through its steps: chunks of 16 over past pages, then decode steps.
    kinds = [FULL, STREAM]
    steps = [(0, 16), (16, 16), (32, 10), (42, 1), (43, 1), (44, 1)]
    for i, (a, q_len) in enumerate(steps):
        check(run_step(kinds, [(a, q_len, 0)], sink=3, window=13, page_size=8, seed=20 + i))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype):
    kinds = [FULL, STREAM, COMPACT, STREAM]
    reqs = [(0, 11, 0), (37, 8, 12), (90, 1, 30)]
    check(run_step(kinds, reqs, dtype=dtype, sink=4, window=16, page_size=8), dtype)
    check(run_step(kinds, [(90, 1, 30)], dtype=dtype, sink=4, window=16, num_splits=4,
                   seed=2), dtype)


def test_fp8_kv_scaled():
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("this torch has no float8_e4m3fn")
    gen = torch.Generator().manual_seed(0)
    page_size, head_dim, length = 8, 32, 21
    keys = torch.randn(1, length, head_dim, generator=gen)
    values = torch.randn(1, length, head_dim, generator=gen)
    k8, v8 = (keys / 0.5).to(torch.float8_e4m3fn), (values / 0.25).to(torch.float8_e4m3fn)
    pages = math.ceil(length / page_size)
    k_cache = torch.zeros(pages, page_size, head_dim, dtype=torch.float8_e4m3fn)
    v_cache = torch.zeros_like(k_cache)
    k_cache.view(-1, head_dim)[:length] = k8[0]
    v_cache.view(-1, head_dim)[:length] = v8[0]
    q = torch.randn(1, 2, head_dim, generator=gen)
    table = torch.arange(pages, dtype=torch.int32).view(1, 1, -1)
    out = head_pages_attention(q, k_cache, v_cache, table,
                               torch.tensor([[length]], dtype=torch.int32),
                               torch.tensor([0, 1], dtype=torch.int32), k_scale=0.5,
                               v_scale=torch.tensor(0.25), block_n=16)
    pos = torch.arange(length).view(1, -1)
    seen = visibility(torch.tensor([length - 1]), pos, length - 1, torch.tensor([False]), 0, 0)
    expect = attend(q.transpose(0, 1), k8.float() * 0.5, v8.float() * 0.25, seen,
                    1 / math.sqrt(head_dim))
    check(float(((out.transpose(0, 1) - expect).abs() / (1 + expect.abs())).max()))


def test_wrapper_rejects_bad_inputs():
    q = torch.zeros(3, 4, 16)
    cache = torch.zeros(4, 8, 16)
    table = torch.zeros(1, 2, 4, dtype=torch.int32)
    lengths = torch.full((1, 2), 3, dtype=torch.int32)
    qsl = torch.tensor([0, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="head_dim"):
        head_pages_attention(q, torch.zeros(4, 8, 32), torch.zeros(4, 8, 32), table, lengths,
                             qsl)
    with pytest.raises(TypeError, match="page_table must be int32"):
        head_pages_attention(q, cache, cache, table.long(), lengths, qsl)
    with pytest.raises(ValueError, match="lengths"):
        head_pages_attention(q, cache, cache, table, lengths[:, :1], qsl)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        head_pages_attention(torch.zeros(3, 3, 16), cache, cache, table, lengths, qsl)
    with pytest.raises(ValueError, match="num_splits"):
        head_pages_attention(q, cache, cache, table, lengths, qsl, num_splits=3)
    with pytest.raises(TypeError, match="dtype"):
        head_pages_attention(q, cache.half(), cache.half(), table, lengths, qsl)
    with pytest.raises(ValueError, match="streaming"):
        head_pages_attention(q, cache, cache, table, lengths, qsl,
                             streaming=torch.zeros(3, dtype=torch.bool))
