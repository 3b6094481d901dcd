"""Timing cells: what one step's attention costs under each policy, for a Llama-3.1-8B-shaped
layer (32 query heads, 8 KV heads, head_dim 128) and for the whole model's 32 layers, against
dense attention (torch's SDPA over contiguous K/V, and the served `full` FlexAttention path)
and against the device's bandwidth (the K/V bytes the policy must read / time, over a measured
big copy).

A prefill cell: each of `batch` requests runs its last chunk of `chunk` tokens at `context`; a
decode cell: one token each after `context`. Policies run as served: paged K/V over scattered
pages, one call per kind of head (`layer.kernel`), token eviction over its compacted past
(keeping 30% of each chunk) plus, in prefill, the chunk's scoring and compaction. Block masks
are built once per step and shared by the layers (as served); their build time is apart.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from vllm_kvevict.config import DEFAULT_SINK, DEFAULT_WINDOW, KVPolicyConfig
from vllm_kvevict.flex.block_mask import head_mask_block_mask, paged_queries
from vllm_kvevict.gpu_check import kernel_path
from vllm_kvevict.gpu_check.cells import LLAMA_8B, Sizes, build_case
from vllm_kvevict.gpu_check.layer import PAGE, Q_BLOCK, _to, kernel
from vllm_kvevict.policies import build_policy

FLEX_KINDS = ("flex-dense", "streaming", "prulong-0.7", "snapkv-0.7", "prulong-0.7+snapkv",
         # experiments after the first H200 run (docs/results/gpu/): where does decode lose?
         "prulong-0.7-one-call",     # one call, a per-head mask (served: one call per kind)
         "flex-dense-torch-kernel")  # flex-dense with torch's kernel choice, not vLLM's options
# in this order: SDPA, the head-pages kernel's kinds (one launch a layer), FlexAttention's
KINDS = ("sdpa",) + kernel_path.KINDS + FLEX_KINDS
CPU_KINDS = ("sdpa",) + FLEX_KINDS  # the kernel's kinds run in Triton's interpreter on a CPU
KEEP = 0.3  # token eviction at sparsity 0.7: the compacted past holds 30% of the context


@dataclass(frozen=True)
class Grid:
    contexts: tuple[int, ...]
    batches: tuple[int, ...]
    chunk: int
    step_tokens: int   # a prefill step's largest batch * chunk (vLLM's token budget)
    layers: int        # the model scope's layers


PARTS = ("layer:decode", "layer:prefill", "model:decode", "model:prefill")
INT32_ELEMENTS = 2**31  # flex_attention's Triton kernel indexes a cache with 32-bit offsets
CUDA_GRID = Grid((8192, 32768, 131072), (1, 8, 32), 2048, 16384, 32)
CPU_GRID = Grid((64, 128), (1, 2), 16, 32, 2)


def measure_bandwidth(device: str) -> float:
    """Bytes per second of a big device-to-device copy (read + write), best of 5."""
    n = (1 << 30) if device.startswith("cuda") else (64 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(6):
        best = min(best, timed(lambda: dst.copy_(src), device, repeats=1, warmup=0))
    return 2 * n / best


def timed(fn, device: str, repeats: int = 10, warmup: int = 2, limit_s: float = 1.0) -> float:
    """Seconds per call: `warmup` calls (compilation), then up to `repeats` within `limit_s`."""
    for _ in range(warmup):
        fn()
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    sync()
    times, spent = [], 0.0
    while len(times) < max(repeats, 1) and (spent < limit_s or len(times) < min(repeats, 2)):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
        spent += times[-1]
    return sorted(times)[len(times) // 2]


@dataclass
class Step:
    """One timing cell's inputs: queries [Hq, T, d] of `batch` rows and, per layer, paged K/V
    of `context` tokens (and the compacted 30%) over scattered pages."""

    phase: str
    context: int
    batch: int
    tokens: int                # per row this step
    q: torch.Tensor
    full: list                 # per layer: (K, V) [slots, H, d], every token
    compact: list              # per layer: (K, V) of the compacted past and the step
    table: torch.Tensor
    table_c: torch.Tensor


def make_step(phase: str, context: int, batch: int, grid: Grid, layers: int, device: str,
              dtype) -> Step:
    tokens = grid.chunk if phase == "prefill" else 1
    _, kv, group, d = LLAMA_8B
    per_row = -(-(context + tokens) // PAGE)
    kept = -(-(int(KEEP * context) + tokens) // PAGE)
    tables = [torch.randperm(batch * n, device=device).view(batch, n).int()
              for n in (per_row, kept)]
    cache = lambda pages: [torch.randn(pages * PAGE, kv, d, device=device, dtype=dtype)  # noqa
                           for _ in range(2)]
    return Step(phase, context, batch, tokens,
                torch.randn(kv * group, batch * tokens, d, device=device, dtype=dtype),
                [cache(batch * per_row) for _ in range(layers)],
                [cache(batch * kept) for _ in range(layers)], *tables)


def step_bytes(step: Step, layers: int, kind: str, full_kv: list[int]) -> int:
    """K/V bytes the step must read at least (every key some query of a head sees, once per
    KV head), plus q and the output, over `layers` layers with `full_kv[l]` full KV heads."""
    _, kv, group, d = LLAMA_8B
    elem = step.q.element_size()
    n, c = step.context + step.tokens, step.tokens
    compact = int(KEEP * step.context) + c
    near = min(n, DEFAULT_SINK + DEFAULT_WINDOW + c)
    keys = 0
    for f in full_kv[:layers]:
        kind = kind.replace("kernel-dense", "flex-dense").removeprefix("kernel-")
        full_keys = {"sdpa": n, "flex-dense": n, "streaming": near, "prulong-0.7": n,
                     "snapkv-0.7": compact, "prulong-0.7+snapkv": compact,
                     "prulong-0.7-one-call": n, "flex-dense-torch-kernel": n}[kind]
        f = kv if kind in ("sdpa", "flex-dense", "snapkv-0.7", "flex-dense-torch-kernel") else \
            0 if kind == "streaming" else f
        keys += f * full_keys + (kv - f) * near
    return step.batch * (2 * keys * d * elem) + 2 * layers * step.q.numel() * elem


def _logical(step: Step, device: str):
    b, t, n = step.batch, step.tokens, step.context
    prompts = [n + t] * b if step.phase == "prefill" else [n] * b
    return _to(paged_queries([n] * b, [t] * b, step.table, PAGE, step.full[0][0].shape[0]
                             // PAGE, prompts), device)


def mixed_masks(step: Step, device: str, full_counts) -> dict:
    """Per count f of full KV heads: one block mask for all query heads (the first f KV heads'
    full, the rest streaming), for `prulong-0.7-one-call`."""
    group, logical = LLAMA_8B[2], _logical(step, device)
    return {f: head_mask_block_mask(logical, torch.arange(
                LLAMA_8B[1] * group, device=device) >= f * group, DEFAULT_SINK, DEFAULT_WINDOW,
                q_block=Q_BLOCK) for f in sorted(set(full_counts))}


def step_masks(step: Step, device: str) -> dict:
    """The step's block masks (full heads, streaming heads, the compacted past), as served."""
    b, t, n = step.batch, step.tokens, step.context
    logical = _logical(step, device)
    compact = _to(paged_queries([int(KEEP * n)] * b, [t] * b, step.table_c, PAGE,
                                step.compact[0][0].shape[0] // PAGE), device)
    flag = lambda s: torch.full((1,), s, device=device)  # noqa: E731
    return {"full": head_mask_block_mask(logical, flag(False), DEFAULT_SINK, DEFAULT_WINDOW,
                                         q_block=Q_BLOCK),
            "streaming": head_mask_block_mask(logical, flag(True), DEFAULT_SINK,
                                              DEFAULT_WINDOW, q_block=Q_BLOCK),
            "compact": head_mask_block_mask(compact, flag(False), 0, 0, q_block=Q_BLOCK)}


def compress(policy, step: Step, cache, heads: slice, layer: int) -> None:
    """The chunk's scoring and compaction per row (`compress_chunks`): its own last k queries
    score its keys, the kept K/V move to the front of the chunk's slots."""
    c, group = step.tokens, LLAMA_8B[2]
    keep = policy.chunk_keep(layer, c, True)
    k = policy.config.observation_rows(c)
    before = int(KEEP * step.context)
    qh = slice(heads.start * group, heads.stop * group)
    for r in range(step.batch):
        where = before + torch.arange(c, device=step.q.device)
        slots = step.table_c[r].long()[where // PAGE] * PAGE + where % PAGE
        keys = cache[0][slots][:, heads].transpose(0, 1)
        obs = step.q[qh, (r + 1) * c - k:(r + 1) * c]
        idx = policy.select(policy.score(obs, keys, obs_offset=c - k, window=keep.window),
                            keep.selected, c, keep.window).to(step.q.device)
        for part in cache:
            chunk = part[slots][:, heads]
            part[slots[:idx.shape[1]], heads] = torch.gather(
                chunk, 0, idx.T[..., None].expand(-1, -1, chunk.shape[-1]))


def kind_call(kind: str, step: Step, masks: dict, full_kv: list[int], layers: int, run,
              policy, run_torch=None) -> callable:
    """The step's attention over `layers` layers under `kind` (sdpa: see `sdpa_call`)."""
    group, scale = LLAMA_8B[2], LLAMA_8B[3] ** -0.5
    q = step.q

    def layer_call(l: int) -> None:
        f = full_kv[l]
        (k, v), (kc, vc) = step.full[l], step.compact[l]
        if kind == "flex-dense-torch-kernel":
            run_torch(q, k, v, masks["full"], scale)
        elif kind == "prulong-0.7-one-call":
            run(q, k, v, masks["mixed"][f], scale)
        elif kind in ("flex-dense", "streaming"):
            run(q, k, v, masks["full" if kind == "flex-dense" else "streaming"], scale)
        elif kind == "snapkv-0.7":
            run(q, kc, vc, masks["compact"], scale)
        else:
            full_k, full_v, mask = (kc, vc, "compact") if kind.endswith("snapkv") else \
                (k, v, "full")
            if f:
                run(q[:f * group], full_k[:, :f], full_v[:, :f], masks[mask], scale)
            if f < LLAMA_8B[1]:
                run(q[f * group:], k[:, f:], v[:, f:], masks["streaming"], scale)
        if step.phase == "prefill" and kind.startswith("snapkv"):
            compress(policy, step, step.compact[l], slice(0, LLAMA_8B[1]), l)
        elif step.phase == "prefill" and kind.endswith("snapkv") and full_kv[l]:
            compress(policy, step, step.compact[l], slice(0, full_kv[l]), l)

    return lambda: [layer_call(l) for l in range(layers)]


def sdpa_call(step: Step, layers: int) -> callable:
    """torch's SDPA over contiguous K/V [batch, H, n, d] per layer (causal, bottom-right)."""
    from torch.nn.attention.bias import causal_lower_right

    _, kv, group, d = LLAMA_8B
    b, t, n = step.batch, step.tokens, step.context + step.tokens
    q = step.q.view(kv * group, b, t, d).transpose(0, 1)
    kvs = [(torch.randn(b, kv, n, d, device=q.device, dtype=q.dtype),
            torch.randn(b, kv, n, d, device=q.device, dtype=q.dtype)) for _ in range(layers)]
    mask = causal_lower_right(t, n) if t > 1 else None
    return lambda: [torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, enable_gqa=True) for k, v in kvs]


def cell_groups(grid: Grid, parts: tuple[str, ...] = PARTS):
    """(scope, phase, context, batch) in the order they run: the layer's decode first."""
    for scope, phase in (p.split(":") for p in PARTS if p in parts):
        for context in grid.contexts:
            for batch in grid.batches:
                if phase == "decode" or batch * grid.chunk <= grid.step_tokens:
                    yield scope, phase, context, batch


def fits(phase: str, context: int, batch: int, layers: int, grid: Grid, device: str,
         elem: int, kinds: tuple[str, ...] = KINDS) -> bool:
    """Whether the caches (every token, the compacted 30%, SDPA's contiguous copy; the
    kernel's pools where its kinds run) fit in 80% of the free device memory (CPU: 2 GiB)."""
    tokens = batch * (context + (grid.chunk if phase == "prefill" else 1) + 2 * PAGE)
    pools = (1 + KEEP) * any(k in kernel_path.KINDS for k in kinds)
    need = layers * tokens * (2 + KEEP + 1 + pools) * 2 * LLAMA_8B[1] * LLAMA_8B[3] * elem
    free = torch.cuda.mem_get_info()[0] if device.startswith("cuda") else 2 << 30
    return need < 0.8 * free


def run_group(scope: str, phase: str, context: int, batch: int, grid: Grid, device: str,
              dtype, run, deadline: float, bandwidth: float, run_torch=None,
              kinds: tuple[str, ...] = KINDS, options: dict | None = None) -> list[dict]:
    """Every kind's cell of one (scope, phase, context, batch); `options`: the kernel's
    (`kernel_path.OPTION_NAMES`)."""
    layers = grid.layers if scope == "model" else 1
    base = {"scope": scope, "phase": phase, "context": context, "batch": batch,
            "layers": layers}
    if not fits(phase, context, batch, layers, grid, device, torch.empty(0, dtype=dtype)
                .element_size(), kinds):
        return [dict(base, kind=k, status="skipped: memory") for k in kinds]
    cache = batch * (context + grid.chunk + 2 * PAGE) * LLAMA_8B[1] * LLAMA_8B[3]
    big = cache >= INT32_ELEMENTS  # flex: the first H200 run's illegal address (64-bit: kernel)
    step = make_step(phase, context, batch, grid, layers, device, dtype)
    ks = (kernel_path.make_kernel_step(step.q, batch, context, step.tokens, LLAMA_8B[1],
                                       layers, KEEP)
          if any(k in kernel_path.KINDS for k in kinds) else None)
    t0 = time.perf_counter()
    masks = step_masks(step, device)
    _sync(device)
    mask_ms = 1e3 * (time.perf_counter() - t0)
    policy = build_policy(KVPolicyConfig(policy="snapkv", sparsity=0.7), LLAMA_8B[0],
                          LLAMA_8B[1])
    full_kv = _full_kv_per_layer(scope)
    masks["mixed"] = mixed_masks(step, device, full_kv[:layers])
    out = []
    for kind in kinds:
        if time.monotonic() > deadline:
            out.append(dict(base, kind=kind, status="skipped: budget"))
            continue
        if big and kind in FLEX_KINDS:
            out.append(dict(base, kind=kind, status="skipped: cache over 2^31 elements"))
            continue
        try:
            if kind in kernel_path.KINDS:
                fn = kernel_path.KernelCall(kind, ks, full_kv, layers, options or {},
                                            DEFAULT_SINK, DEFAULT_WINDOW, LLAMA_8B[3] ** -0.5)
            else:
                fn = sdpa_call(step, layers) if kind == "sdpa" else \
                    kind_call(kind, step, masks, full_kv, layers, run, policy, run_torch)
            out.append(dict(base, kind=kind, mask_ms=mask_ms,
                            **_measure(fn, device, step_bytes(step, layers, kind, full_kv),
                                       bandwidth), status="ok"))
            if kind in kernel_path.KINDS:
                out[-1].update(_graph_ms(fn, device, phase))
        except Exception as exc:  # (a GPU run must report every cell, not stop at one)
            out.append(dict(base, kind=kind, status=f"error: {type(exc).__name__}: "
                                                    f"{str(exc)[:200]}"))
        finally:
            fn = None
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
    _relate(out)
    return out


def _graph_ms(call, device: str, phase: str) -> dict:
    """A kernel kind's decode step as a CUDA-graph replay (as vLLM replays decode), and its
    KV splits; CPU and prefill: the splits only."""
    got = {"splits": call.splits}
    if device.startswith("cuda") and phase == "decode":
        try:
            got["graph_ms"] = 1e3 * timed(call.capture(), device)
        except Exception as exc:  # (reported, the eager time stands)
            got["graph_status"] = f"error: {type(exc).__name__}: {str(exc)[:200]}"
    return got


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _full_kv_per_layer(scope: str) -> list[int]:
    """Full KV heads per layer at head sparsity 0.7: the layer scope 2 of 8 (round(0.3 * 8));
    the model scope the seeded Llama mask's layers (`cells.CASES`)."""
    if scope == "layer":
        return [2] * LLAMA_8B[0]
    policy, _ = build_case("prulong-0.7 llama", Sizes((1,), 1, 0, DEFAULT_SINK,
                                                      DEFAULT_WINDOW, 64, 1))
    return (~policy.streaming_heads()).sum(dim=1).tolist()


def _measure(fn, device: str, kv_bytes: int, bandwidth: float) -> dict:
    cuda = device.startswith("cuda")
    if cuda:
        fn()  # compile outside the peak measurement
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    seconds = timed(fn, device, repeats=10 if cuda else 1, warmup=1 if cuda else 0,
                    limit_s=1.0 if cuda else 0.1)
    peak = torch.cuda.max_memory_allocated() - before if cuda else None
    return {"ms": 1e3 * seconds, "bytes": kv_bytes,
            "bandwidth_share": kv_bytes / seconds / bandwidth, "peak_extra_bytes": peak}


def _relate(cells: list[dict]) -> None:
    """Each cell's time over SDPA's and over the served dense path's (flex-dense)."""
    ms = {c["kind"]: c.get("ms") for c in cells}
    for c in cells:
        for ref, key in (("sdpa", "vs_sdpa"), ("flex-dense", "vs_flex_dense")):
            if c.get("ms") and ms.get(ref):
                c[key] = c["ms"] / ms[ref]


def run_timing(grid: Grid, device: str, dtype, compiled: bool, deadline: float,
               log=print, parts: tuple[str, ...] = PARTS, kinds: tuple[str, ...] = KINDS,
               options: dict | None = None) -> dict:
    """Bandwidth, then the cells in order until `deadline` (the rest: skipped, said so)."""
    unknown = set(kinds) - set(KINDS)
    if unknown:
        raise ValueError(f"unknown timing kinds {sorted(unknown)}; known: {', '.join(KINDS)}")
    kinds = tuple(k for k in KINDS if k in kinds)
    bandwidth = measure_bandwidth(device)
    log(f"measured copy bandwidth: {bandwidth / 1e9:.1f} GB/s")
    run, cells = kernel(device, compiled), []
    run_torch = kernel(device, compiled, vllm_options=False)
    for group in cell_groups(grid, parts):
        if time.monotonic() > deadline:
            cells += [dict(zip(("scope", "phase", "context", "batch"), group), kind=k,
                           status="skipped: budget") for k in kinds]
            continue
        try:
            cells += run_group(*group, grid, device, dtype, run, deadline, bandwidth,
                               run_torch, kinds, options)
        except Exception as exc:  # a lost device context: what ran so far is still written
            status = f"error: {type(exc).__name__}: {exc}"[:200]
            cells += [dict(zip(("scope", "phase", "context", "batch"), group), kind=k,
                           status=status) for k in kinds]
            log(_line(cells[-len(kinds):]))
            break
        log(_line(cells[-len(kinds):]))
    return {"bandwidth_bytes_per_s": bandwidth, "cells": cells}


def _line(group: list[dict]) -> str:
    head = "{scope:5s} {phase:7s} ctx {context:6d} batch {batch:2d}".format(**group[0])
    parts = [f"{c['kind']} {c['ms']:.2f} ms" if c.get("ms") is not None else
             f"{c['kind']} {c['status']}" for c in group]
    return head + ": " + ", ".join(parts)
