"""Paged attention over each (request, KV head)'s own pages: one Triton launch for full,
streaming and compacted (token-evicted) heads, prefill chunks and decode steps alike.
Layout: K/V pools [num_pages, page_size, head_dim] (a page holds one KV head's tokens), a page
table int32 [reqs, kv_heads, max_pages] and lengths int32 [reqs, kv_heads]; the current chunk's
K/V are already in the pages. A causal head's slots are its kept tokens in order, the chunk
last (full: slot = position; compacted: no mask but causal in the chunk). A streaming head's
table is indexed by logical page (position // page_size, as vLLM's sliding-window block table)
and its length is the sequence length; the kernel visits only the tiles of the sink [0, S) and
of [a - W, end) and masks each token by its position, so no position array is read. Program
(request, q tile, KV head, split): all query heads of the KV head as rows; decode splits the
visited tiles over `num_splits` programs and `_combine` merges them (flash-decoding).
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
MAX_SPLITS = 64
_FP8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                          "float8_e5m2fnuz") if hasattr(torch, n))


def _fwd(Q, K, V, TBL, LENS, KIND, QSL, CS, OUT, ACC, MAXS, SUMS, KSCALE, VSCALE,
         qk_scale, sink, window, q_tiles,
         s_qt, s_qh, s_kp, s_ks, s_vp, s_vs, s_tr, s_th, s_lr, s_lh, s_kr, s_kh,
         s_ot, s_oh, s_at, s_ah, s_as, s_mt, s_mh,
         PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_P2: tl.constexpr,
         BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
         HEAD_DIM_P2: tl.constexpr, NUM_SPLITS: tl.constexpr, IS_FP8: tl.constexpr,
         DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr, HAS_CS: tl.constexpr):
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_P2
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    req = pid // q_tiles
    i0 = (pid % q_tiles) * BLOCK_Q  # first chunk index of this query tile
    q_start = tl.load(QSL + req)
    q_len = tl.load(QSL + req + 1) - q_start
    if i0 < q_len:
        length = tl.load(LENS + req * s_lr + kvh * s_lh)
        streaming = tl.load(KIND + req * s_kr + kvh * s_kh) != 0
        past = length - q_len  # slots before the chunk; a streaming head's chunk start a
        # The last slot any row of this tile may see (causal), plus one.
        hi = past + tl.minimum(q_len, i0 + BLOCK_Q)
        # A streaming head's chunk start a: the step's first slot, or per query (CS: a
        # canonical chunk begun in an earlier step, or decode queries each a chunk of its own);
        # the tile's first row has the smallest.
        if HAS_CS:
            a0 = tl.load(CS + q_start + i0)
        else:
            a0 = past
        # Visited slots: [0, s_end) then [w_start, hi). A causal head: [0, hi) as part two.
        s_end = tl.where(streaming, tl.minimum(sink, hi), 0)
        w_start = tl.where(streaming, tl.maximum(a0 - window, s_end), 0)
        w_start = tl.minimum(w_start, hi)
        n_t1 = tl.cdiv(s_end, BLOCK_N)
        w_lo = (w_start // BLOCK_N) * BLOCK_N
        n_tiles = n_t1 + tl.cdiv(hi - w_lo, BLOCK_N)
        per = tl.cdiv(n_tiles, NUM_SPLITS)
        t_begin = split * per
        t_end = tl.minimum(t_begin + per, n_tiles)

        rows = tl.arange(0, BLOCK_M)
        qi = i0 + rows // GROUP_P2  # chunk index of each row
        hq = kvh * GROUP + rows % GROUP_P2
        row_ok = (qi < q_len) & (rows % GROUP_P2 < GROUP)
        q_slot = past + qi
        if HAS_CS:  # each row's own window start (streaming heads; 0 for the others)
            a_row = tl.load(CS + q_start + qi, mask=row_ok, other=0)
            lo_row = tl.where(streaming, tl.maximum(a_row - window, s_end), 0)
        else:
            lo_row = tl.zeros([BLOCK_M], tl.int32) + w_start
        dd = tl.arange(0, HEAD_DIM_P2)
        d_ok = dd < HEAD_DIM
        tok = (q_start + qi).to(tl.int64)  # 64-bit offsets: a long chunk's split partials
        q = tl.load(Q + tok[:, None] * s_qt + hq[:, None] * s_qh + dd[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        if IS_FP8:
            k_scale = tl.load(KSCALE)
            v_scale = tl.load(VSCALE)
        table = TBL + req * s_tr + kvh * s_th
        cols = tl.arange(0, BLOCK_N)
        # Finite start: a row that sees nothing in this split keeps exp2(-inf - m) = 0, no NaN.
        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_P2], tl.float32)
        for t in range(t_begin, t_end):
            second = t >= n_t1
            n = tl.where(second, w_lo + (t - n_t1) * BLOCK_N, t * BLOCK_N) + cols
            lo = tl.where(second, w_start, 0)
            top = tl.where(second, hi, s_end)
            n_ok = (n >= lo) & (n < top)
            page = tl.load(table + n // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)
            off = n % PAGE_SIZE
            kv_ok = n_ok[:, None] & d_ok[None, :]
            k = tl.load(K + page[:, None] * s_kp + off[:, None] * s_ks + dd[None, :],
                        mask=kv_ok, other=0.0)
            v = tl.load(V + page[:, None] * s_vp + off[:, None] * s_vs + dd[None, :],
                        mask=kv_ok, other=0.0)
            if IS_FP8:
                k = (k.to(tl.float32) * k_scale).to(q.dtype)
                v = (v.to(tl.float32) * v_scale).to(q.dtype)
            if DOT_F32:  # the interpreter's dot multiplies bfloat16's bits: same values in fp32
                qk = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
            qk = qk * qk_scale
            seen = n_ok[None, :] & (n[None, :] <= q_slot[:, None]) & (
                (n[None, :] < s_end) | (n[None, :] >= lo_row[:, None]))
            qk = tl.where(seen, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if DOT_F32:
                pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        if NUM_SPLITS == 1:
            o = acc / l_i[:, None]
            tl.store(OUT + tok[:, None] * s_ot + hq[:, None] * s_oh + dd[None, :],
                     o.to(OUT.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        else:
            tl.store(ACC + tok[:, None] * s_at + hq[:, None] * s_ah + split * s_as + dd[None, :],
                     acc, mask=row_ok[:, None] & d_ok[None, :])
            tl.store(MAXS + tok * s_mt + hq * s_mh + split, m_i, mask=row_ok)
            tl.store(SUMS + tok * s_mt + hq * s_mh + split, l_i, mask=row_ok)


def _combine(ACC, MAXS, SUMS, OUT, s_at, s_ah, s_as, s_mt, s_mh, s_ot, s_oh,
             NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    hq = tl.program_id(1)
    s = tl.arange(0, NUM_SPLITS)
    dd = tl.arange(0, HEAD_DIM_P2)
    d_ok = dd < HEAD_DIM
    m = tl.load(MAXS + tok * s_mt + hq * s_mh + s)
    w = tl.exp2(m - tl.max(m, 0))
    total = tl.sum(tl.load(SUMS + tok * s_mt + hq * s_mh + s) * w, 0)
    acc = tl.load(ACC + tok * s_at + hq * s_ah + s[:, None] * s_as + dd[None, :],
                  mask=d_ok[None, :], other=0.0)
    o = tl.sum(acc * w[:, None], 0) / total
    tl.store(OUT + tok * s_ot + hq * s_oh + dd, o.to(OUT.dtype.element_ty), mask=d_ok)


_JITTED: dict[bool, tuple] = {}


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _kernels():
    """The two kernels, jitted on first use for the current TRITON_INTERPRET setting (Triton
    decides interpreter or compiler when a function is jitted), so a test may turn the
    interpreter on for its calls in a process that already imported Triton."""
    interpret = _interpreting()
    if interpret not in _JITTED:
        _JITTED[interpret] = (triton.jit(_fwd), triton.jit(_combine))
    return _JITTED[interpret]


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _scale_tensor(scale, device) -> torch.Tensor:
    if scale is None:
        raise ValueError("an fp8 KV cache needs k_scale and v_scale (per layer)")
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ValueError(f"k_scale / v_scale must hold one value (per layer), got "
                             f"{tuple(scale.shape)}")
        return scale.reshape(1).to(device=device, dtype=torch.float32)
    return torch.tensor([float(scale)], device=device, dtype=torch.float32)


def split_workspace(tokens: int, q_heads: int, head_dim: int, num_splits: int,
                    device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The split-KV partials of up to `tokens` query rows: fp32 (acc [tokens, q_heads,
    num_splits, head_dim], maxs and sums [tokens, q_heads, num_splits]); pass them as
    `head_pages_attention(..., workspace=)` to allocate once (a CUDA graph's fixed buffers)."""
    acc = torch.empty(tokens, q_heads, num_splits, head_dim, dtype=torch.float32, device=device)
    maxs = torch.empty(tokens, q_heads, num_splits, dtype=torch.float32, device=device)
    return acc, maxs, torch.empty_like(maxs)


def _check_workspace(workspace, tokens: int, q_heads: int, num_splits: int, head_dim: int,
                     device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    acc, maxs, sums = workspace
    want = (q_heads, num_splits)
    if (acc.dim() != 4 or tuple(acc.shape[1:]) != want + (head_dim,) or acc.shape[0] < tokens
            or acc.stride(3) != 1 or maxs.shape != sums.shape or maxs.dim() != 3
            or tuple(maxs.shape[1:]) != want or maxs.shape[0] < tokens
            or maxs.stride() != sums.stride() or maxs.stride(2) != 1
            or any(t.dtype != torch.float32 or t.device != device for t in workspace)):
        raise ValueError(f"workspace must be split_workspace({tokens} or more, {q_heads}, "
                         f"{head_dim}, {num_splits}) on {device}: fp32 acc [tokens, {q_heads}, "
                         f"{num_splits}, {head_dim}], maxs and sums [tokens, {q_heads}, "
                         f"{num_splits}]; got {[tuple(t.shape) for t in workspace]}")
    return acc, maxs, sums


def auto_splits(num_reqs: int, num_kv_heads: int, max_query_len: int, device) -> int:
    """Decode (max_query_len 1): enough (request, KV head, split) programs to fill the device
    twice over, a power of two up to MAX_SPLITS; each program's share of the tiles is decided
    in the kernel from the lengths (no host sync). Prefill and mixed steps: one split."""
    if max_query_len > 1:
        return 1
    if torch.device(device).type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    else:
        sms = 4
    return min(MAX_SPLITS, _pow2(triton.cdiv(2 * sms, max(1, num_reqs * num_kv_heads))))


def head_pages_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         page_table: torch.Tensor, lengths: torch.Tensor,
                         query_start_loc: torch.Tensor, streaming: torch.Tensor | None = None,
                         chunk_start: torch.Tensor | None = None,
                         sink: int = 0, window: int = 0, scale: float | None = None,
                         k_scale=None, v_scale=None, max_query_len: int | None = None,
                         num_splits: int | None = None, block_n: int = 64, block_m: int = 64,
                         num_warps: int | None = None, num_stages: int | None = None,
                         out: torch.Tensor | None = None,
                         workspace: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                         ) -> torch.Tensor:
    """Attention of every request's chunk over its heads' pages; returns [tokens, q_heads, d].

    q: [tokens, q_heads, d], the requests' chunks packed in order; query_start_loc int32
    [reqs + 1] (request r's queries are rows qsl[r]:qsl[r+1], a decode step is one row).
    k_cache, v_cache: [num_pages, page_size, d] (last dim contiguous); fp8 needs k_scale and
    v_scale (floats or one-element tensors). page_table int32 [reqs, kv_heads, max_pages];
    lengths int32 [reqs, kv_heads]: slots in use including the chunk (streaming heads: the
    sequence length, table by logical page). streaming: bool/int [kv_heads] or [reqs, kv_heads]
    (None: no streaming head); sink, window: S and W of the streaming heads. chunk_start: int32
    [tokens], each query's chunk start a (a streaming head sees the sink, [a - W, a) and its
    chunk causally); None: each request's step is one chunk. Query head h reads
    KV head h // (q_heads // kv_heads). max_query_len: the longest chunk (None: read from
    query_start_loc, a host sync). num_splits: KV splits, a power of two (None: `auto_splits`).
    block_n: KV tokens a tile; block_m: query rows (tokens x GROUP padded to a power of two) a
    prefill tile; num_warps, num_stages: Triton's launch options (None: its defaults).
    workspace: the split partials (`split_workspace`, at least `tokens` rows), preallocated so
    that a decode step can be captured in a CUDA graph (None: allocated per call when
    num_splits > 1). With max_query_len and num_splits given (and a bool/int32 `streaming` on
    the device, or None), the call makes no host sync.
    Rows of q after query_start_loc[-1] (padding) get no defined output.
    """
    if q.dim() != 3 or k_cache.dim() != 3 or v_cache.dim() != 3:
        raise ValueError(f"q must be [tokens, q_heads, d] and k_cache / v_cache [num_pages, "
                         f"page_size, d]; got q {tuple(q.shape)}, k_cache "
                         f"{tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}")
    tokens, q_heads, head_dim = q.shape
    if k_cache.shape != v_cache.shape or k_cache.shape[2] != head_dim:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} "
                         f"must match, with head_dim {head_dim} of q")
    if page_table.dim() != 3 or lengths.dim() != 2 or query_start_loc.dim() != 1:
        raise ValueError("page_table must be [reqs, kv_heads, max_pages], lengths [reqs, "
                         "kv_heads], query_start_loc [reqs + 1]")
    reqs, kv_heads, _ = page_table.shape
    if tuple(lengths.shape) != (reqs, kv_heads) or query_start_loc.shape[0] != reqs + 1:
        raise ValueError(f"lengths {tuple(lengths.shape)} must be {(reqs, kv_heads)} and "
                         f"query_start_loc {tuple(query_start_loc.shape)} {(reqs + 1,)}, "
                         f"from page_table {tuple(page_table.shape)}")
    if chunk_start is not None and (chunk_start.dim() != 1 or chunk_start.shape[0] < tokens):
        raise ValueError(f"chunk_start must be [tokens] ({tokens}), got "
                         f"{tuple(chunk_start.shape)}")
    for name, t in (("page_table", page_table), ("lengths", lengths),
                    ("query_start_loc", query_start_loc)) + (
                        (("chunk_start", chunk_start),) if chunk_start is not None else ()):
        if t.dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {t.dtype}")
    if q_heads % kv_heads:
        raise ValueError(f"q_heads {q_heads} is not a multiple of kv_heads {kv_heads}")
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"q must be float32, bfloat16 or float16, got {q.dtype}")
    is_fp8 = k_cache.dtype in _FP8
    if not is_fp8 and k_cache.dtype != q.dtype or v_cache.dtype != k_cache.dtype:
        raise TypeError(f"k_cache / v_cache dtype ({k_cache.dtype}, {v_cache.dtype}) must be "
                        f"q's ({q.dtype}) or an fp8 type")
    if q.stride(2) != 1 or k_cache.stride(2) != 1 or v_cache.stride(2) != 1:
        raise ValueError("q, k_cache and v_cache need a contiguous last (head_dim) dimension")
    devices = {t.device for t in (q, k_cache, v_cache, page_table, lengths, query_start_loc)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    device = q.device
    if streaming is None:
        streaming = torch.zeros(kv_heads, dtype=torch.int32, device=device)
    if streaming.dim() == 1:
        streaming = streaming.unsqueeze(0)
    if streaming.dim() != 2 or streaming.shape[1] != kv_heads or streaming.shape[0] not in (
            1, reqs):
        raise ValueError(f"streaming must be [kv_heads] or [reqs, kv_heads], got "
                         f"{tuple(streaming.shape)}")
    streaming = streaming.to(device=device, dtype=torch.int32).expand(reqs, kv_heads)
    if sink < 0 or window < 0:
        raise ValueError(f"sink and window must be >= 0, got {sink}, {window}")
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max()) if reqs else 0
    if num_splits is None:
        num_splits = auto_splits(reqs, kv_heads, max_query_len, device)
    if num_splits < 1 or num_splits > MAX_SPLITS or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two in [1, {MAX_SPLITS}], got "
                         f"{num_splits}")
    if block_n < 1 or block_n & (block_n - 1) or block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"block_n and block_m must be powers of two, got {block_n}, {block_m}")
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.stride(2) != 1:
        raise ValueError(f"out must be like q {tuple(q.shape)}, got {tuple(out.shape)}")
    if reqs == 0 or tokens == 0:
        return out
    if is_fp8:
        ks, vs = _scale_tensor(k_scale, device), _scale_tensor(v_scale, device)
    else:
        ks = vs = lengths  # unused
    group = q_heads // kv_heads
    group_p2 = _pow2(group)
    block_q = max(1, block_m // group_p2)
    block_q = min(block_q, _pow2(max(1, max_query_len)))  # decode: one token a tile
    block_q = max(block_q, 16 // group_p2)  # tl.dot wants 16 rows at least
    q_tiles = triton.cdiv(max(1, max_query_len), block_q)
    if num_splits > 1:
        acc, maxs, sums = (_check_workspace(workspace, tokens, q_heads, num_splits, head_dim,
                                            device) if workspace is not None else
                           split_workspace(tokens, q_heads, head_dim, num_splits, device))
    else:
        acc = maxs = sums = out
    fwd, combine = _kernels()
    launch = {k: v for k, v in (("num_warps", num_warps), ("num_stages", num_stages))
              if v is not None}
    fwd[(reqs * q_tiles, kv_heads, num_splits)](
        q, k_cache, v_cache, page_table, lengths, streaming, query_start_loc,
        query_start_loc if chunk_start is None else chunk_start, out, acc, maxs,
        sums, ks, vs, scale * LOG2E, int(sink), int(window), q_tiles,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), page_table.stride(0), page_table.stride(1),
        lengths.stride(0), lengths.stride(1), streaming.stride(0), streaming.stride(1),
        out.stride(0), out.stride(1), acc.stride(0), acc.stride(1),
        acc.stride(2) if num_splits > 1 else 0, maxs.stride(0), maxs.stride(1),
        PAGE_SIZE=k_cache.shape[1], GROUP=group, GROUP_P2=group_p2, BLOCK_Q=block_q,
        BLOCK_N=block_n, HEAD_DIM=head_dim, HEAD_DIM_P2=_pow2(max(16, head_dim)),
        NUM_SPLITS=num_splits, IS_FP8=is_fp8,
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        DOT_F32=_interpreting() and q.dtype == torch.bfloat16, HAS_CS=chunk_start is not None,
        **launch)
    if num_splits > 1:
        combine[(tokens, q_heads)](
            acc, maxs, sums, out, acc.stride(0), acc.stride(1), acc.stride(2),
            maxs.stride(0), maxs.stride(1), out.stride(0), out.stride(1),
            NUM_SPLITS=num_splits, HEAD_DIM=head_dim, HEAD_DIM_P2=_pow2(max(16, head_dim)))
    return out
