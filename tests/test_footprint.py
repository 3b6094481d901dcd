"""KV footprint and peak KV, checked against explicit un-evicted matrices and by hand."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from vllm_kvevict.config import KVPolicyConfig
from vllm_kvevict.footprint import (FootprintResult, chunk_boundaries_for, eviction_boundaries,
                                    head_mask_footprint, kv_footprint, tri)
from vllm_kvevict.policies import ChunkKeep, KVPolicy, build_policy

# The brute-force setting of the brief: 40 prompt tokens in chunks of 16, 5 decode tokens.
N, M, SINK, WINDOW = 40, 5, 2, 4
BOUNDS = [16, 32, 40]


# -- the explicit matrices (rows: query steps, columns: key positions) ---------------------------

def held_end(q: int, b: int, steps: list[int] | None) -> int:
    """With chunk_held, what a query at q holds of its chunk ending at b: up to the end of its
    engine step (the chunk's end when the chunk ran in one step)."""
    return b if steps is None else min(e for e in steps if e > q)


def streaming_matrix(n: int, m: int, bounds: list[int], sink: int, window: int,
                     chunk_held: bool = False, steps: list[int] | None = None) -> np.ndarray:
    """Un-evicted entries of a streaming head, from the definition: during chunk [a, b) the cache
    is the sink and the last `window` positions before a, plus the chunk so far (the whole
    chunk with `chunk_held`); a decode step at q holds the sink, the last `window` positions
    before q, and q."""
    total = n + m
    un_evicted = np.zeros((total, total), dtype=bool)
    a = 0
    for b in bounds:
        for q in range(a, b):
            for p in range(held_end(q, b, steps) if chunk_held else q + 1):
                un_evicted[q, p] = p >= a or p < sink or p >= a - window
        a = b
    for q in range(n, total):
        for p in range(q + 1):
            un_evicted[q, p] = p == q or p < sink or p >= q - window
    return un_evicted


def kept_matrix(n: int, m: int, bounds: list[int], kept: list[int], seed: int,
                chunk_held: bool = False, steps: list[int] | None = None) -> np.ndarray:
    """Un-evicted entries of a head that keeps kept[i] tokens of chunk i (which ones is random:
    the count must not depend on it). The running chunk is whole; decode tokens all stay."""
    rng = np.random.default_rng(seed)
    total = n + m
    un_evicted = np.zeros((total, total), dtype=bool)
    past: list[int] = []
    a = 0
    for b, k in zip(bounds, kept):
        for q in range(a, b):
            un_evicted[q, past] = True
            un_evicted[q, a:held_end(q, b, steps) if chunk_held else q + 1] = True
        past += rng.choice(np.arange(a, b), size=k, replace=False).tolist()
        a = b
    for q in range(n, total):
        un_evicted[q, past] = True
        un_evicted[q, n:q + 1] = True
    return un_evicted


def brute_force(n: int, m: int, bounds: list[int], streaming: torch.Tensor, sink: int,
                window: int, kept_per_layer: list[list[int]] | None,
                chunk_held: bool = False, steps: list[int] | None = None) -> FootprintResult:
    """Sum the per-head matrices; footprint and peak straight from the counts. With
    `chunk_held` full attention's count (the normaliser) also holds each chunk whole."""
    num_layers, num_heads = streaming.shape
    lengths = [b - a for a, b in zip([0] + bounds[:-1], bounds)]
    per_step = np.zeros(n + m, dtype=np.int64)
    for layer in range(num_layers):
        for head in range(num_heads):
            if streaming[layer, head]:
                mat = streaming_matrix(n, m, bounds, sink, window, chunk_held, steps)
            else:
                kept = lengths if kept_per_layer is None else kept_per_layer[layer]
                mat = kept_matrix(n, m, bounds, kept, layer * 100 + head, chunk_held, steps)
            per_step += mat.sum(axis=1)
    heads = num_layers * num_heads
    causal = int(kept_matrix(n, m, bounds, lengths, 0, chunk_held, steps).sum())
    total = int(per_step.sum())
    return FootprintResult(footprint=total / (heads * causal),
                           peak_kv=int(per_step.max()) / (heads * (n + m)),
                           entries=total / heads, full_entries=float(causal))


def policy(name: str, num_layers: int = 3, num_kv_heads: int = 2, full_heads=None,
           **cfg) -> KVPolicy:
    return build_policy(KVPolicyConfig(policy=name, **cfg), num_layers, num_kv_heads,
                        full_heads=full_heads)


# -- basics ---------------------------------------------------------------------------------------

def test_tri_counts_causal_entries():
    for x in range(8):
        assert tri(x) == int(np.tril(np.ones((x, x))).sum())


def test_chunk_boundaries_for():
    assert chunk_boundaries_for(2500, 1024) == [1024, 2048, 2500]
    assert chunk_boundaries_for(2048, 1024) == [1024, 2048]
    assert chunk_boundaries_for(10, 100) == [10]
    with pytest.raises(ValueError):
        chunk_boundaries_for(10, 0)


@pytest.mark.parametrize("bounds, n, m", [
    ([16, 32], 40, 5),      # last boundary is not the prompt length
    ([16, 16, 40], 40, 5),  # not strictly increasing
    ([0, 40], 40, 5),       # empty first chunk
    ([], 40, 5),
    ([40], 40, -1),
    ([40.0], 40, 5),
])
def test_bad_arguments_raise(bounds, n, m):
    with pytest.raises(ValueError):
        kv_footprint(policy("full"), n, bounds, m)


@pytest.mark.parametrize("bounds", [[2500], [1024, 2048, 2500], [1, 2, 3, 2500]])
def test_full_policy_is_exactly_one(bounds):
    res = kv_footprint(policy("full", 30, 3), 2500, bounds, 77)
    assert res.footprint == 1.0
    assert res.peak_kv == 1.0
    assert res.entries == res.full_entries == tri(2577)


def test_small_case_by_hand():
    # n = 6 in chunks [0,3) and [3,6), m = 2, sink 1, window 1 (so at most 2 past entries):
    # chunk 1: T(3) = 6; chunk 2: T(3) + 3 * 2 = 12; decode: 2 steps of 1 + 2 -> 24 of T(8) = 36.
    # Step counts peak at the last query of chunk 2: 2 + 3 = 5 of 8.
    res = head_mask_footprint(6, 2, 3, 1.0, sink=1, window=1)
    assert res.footprint == 24 / 36
    assert res.peak_kv == 5 / 8
    res = kv_footprint(policy("streaming", sink=1, window=1), 6, [3, 6], 2)
    assert (res.footprint, res.peak_kv, res.entries) == (24 / 36, 5 / 8, 24.0)


def test_paper_reference_values():
    n, m, c, h, s, w = 131072, 50, 32768, 0.7, 128, 1024
    # Independent closed form: the first chunk has no past, the three others and every decode
    # step hold the whole sink + window.
    streaming = 4 * tri(c) + 3 * c * (s + w) + m * (1 + s + w)
    expected = h * streaming / tri(n + m) + (1 - h)
    res = head_mask_footprint(n, m, c, h, s, w)
    assert res.footprint == pytest.approx(expected, rel=1e-12)
    assert res.footprint == pytest.approx(0.48, abs=0.01)
    # Peak: the last prefill chunk (full heads hold all n, streaming heads s + w + c).
    assert res.peak_kv == pytest.approx((h * (s + w + c) + (1 - h) * n) / (n + m), rel=1e-12)
    one_chunk = head_mask_footprint(n, m, n, h, s, w)
    assert 0.99 < one_chunk.footprint < 1.0


# -- exact agreement with the explicit matrices --------------------------------------------------

@pytest.mark.parametrize("bounds", [BOUNDS, [40], [5, 6, 30, 40]])
@pytest.mark.parametrize("m", [0, M])
def test_brute_force_head_mask(bounds, m):
    full_heads = torch.tensor([[True, False], [False, False], [True, True]])
    pol = policy("prulong", full_heads=full_heads, sink=SINK, window=WINDOW)
    res = kv_footprint(pol, N, bounds, m)
    assert res == brute_force(N, m, bounds, ~full_heads, SINK, WINDOW, None)
    # One chunk and no decode: streaming heads see the whole prompt causally, nothing saved.
    assert (res.footprint == 1.0) == (bounds == [40] and m == 0)


@pytest.mark.parametrize("n, bounds, m, sink, window", [
    (4, [2, 4], 8, 2, 4),      # decode starts before sink + window is filled
    (10, [3, 10], 6, 3, 8),    # prefill chunks and decode all below sink + window
    (40, BOUNDS, 5, 0, 20),    # no sink, window larger than a chunk
    (40, BOUNDS, 5, 30, 1),    # sink covers most of the prompt
])
def test_brute_force_streaming_before_cache_fills(n, bounds, m, sink, window):
    pol = policy("streaming", sink=sink, window=window)
    res = kv_footprint(pol, n, bounds, m)
    assert res == brute_force(n, m, bounds, pol.streaming_heads(), sink, window, None)


@pytest.mark.parametrize("name", ["streaming", "full"])
def test_brute_force_streaming_and_full(name):
    pol = policy(name, sink=SINK, window=WINDOW)
    res = kv_footprint(pol, N, BOUNDS, M)
    assert res == brute_force(N, M, BOUNDS, pol.streaming_heads(), SINK, WINDOW, None)


def test_brute_force_snapkv_hand_schedule():
    # sparsity 0.5, naive: a 16-token chunk keeps round(8) = 8 (its 4-token window included);
    # the final 8-token chunk keeps 4, which is just its window.
    pol = policy("snapkv", sparsity=0.5, obs_window=4, eviction="naive")
    schedule = [8, 8, 4]
    for layer in range(3):
        assert [pol.chunk_keep(layer, c, final).kept
                for c, final in ((16, False), (16, False), (8, True))] == schedule
    res = kv_footprint(pol, N, BOUNDS, M)
    assert res == brute_force(N, M, BOUNDS, pol.streaming_heads(), 0, 1, [schedule] * 3)


def test_brute_force_pyramidkv_hand_schedule():
    # patched, sparsity 0.5: non-final 16-token chunks have budget 8 and no window inside;
    # lo = 0, hi = 16, step 8 -> layers keep 16, 8, 0. The final chunk keeps its 4-token window.
    pol = policy("pyramidkv", sparsity=0.5, obs_window=4, eviction="patched")
    schedule = [[16, 16, 4], [8, 8, 4], [0, 0, 4]]
    for layer in range(3):
        assert [pol.chunk_keep(layer, c, final).kept
                for c, final in ((16, False), (16, False), (8, True))] == schedule[layer]
    res = kv_footprint(pol, N, BOUNDS, M)
    assert res == brute_force(N, M, BOUNDS, pol.streaming_heads(), 0, 1, schedule)


@pytest.mark.parametrize("token_policy", ["snapkv", "pyramidkv"])
@pytest.mark.parametrize("eviction", ["patched", "naive"])
@pytest.mark.parametrize("bounds", [BOUNDS, [5, 6, 30, 40]])
@pytest.mark.parametrize("chunk_held", [False, True])
def test_brute_force_hybrid(token_policy, eviction, bounds, chunk_held):
    """A head mask with a token policy: per head, streaming heads' entries (sink + window) and
    full heads' entries (the token policy's kept counts of each chunk), summed."""
    full_heads = torch.tensor([[True, False], [False, False], [True, True]])
    pol = policy("prulong", full_heads=full_heads, sink=SINK, window=WINDOW,
                 token_policy=token_policy, token_sparsity=0.5, obs_window=4, eviction=eviction)
    lengths = [b - a for a, b in zip([0] + bounds[:-1], bounds)]
    kept = [[pol.chunk_keep(layer, c, i == len(lengths) - 1).kept
             for i, c in enumerate(lengths)] for layer in range(3)]
    assert any(k < c for row in kept for k, c in zip(row, lengths))  # full heads do evict
    res = kv_footprint(pol, N, bounds, M, chunk_held=chunk_held)
    want = brute_force(N, M, bounds, ~full_heads, SINK, WINDOW, kept, chunk_held=chunk_held)
    assert (res.footprint, res.entries, res.full_entries) == (
        want.footprint, want.entries, want.full_entries)
    if not chunk_held:
        assert res.peak_kv == want.peak_kv
    # below both of its parts alone
    alone = [kv_footprint(policy("prulong", full_heads=full_heads, sink=SINK, window=WINDOW),
                          N, bounds, M, chunk_held=chunk_held),
             kv_footprint(pol.token, N, bounds, M, chunk_held=chunk_held)]
    assert all(res.footprint < a.footprint for a in alone)


@pytest.mark.parametrize("name", ["full", "streaming", "snapkv", "pyramidkv"])
def test_brute_force_chunk_held(name):
    """Charging every query of a chunk the whole chunk (what an engine holds) matches the
    matrices with whole chunks, normalised by full attention counted the same way."""
    cfg = dict(sink=SINK, window=WINDOW) if name in ("full", "streaming") else dict(
        sparsity=0.5, obs_window=4, eviction="patched")
    pol = policy(name, **cfg)
    lengths = [16, 16, 8]
    kept = None
    if pol.evicts_tokens:
        kept = [[pol.chunk_keep(layer, c, i == 2).kept for i, c in enumerate(lengths)]
                for layer in range(3)]
    res = kv_footprint(pol, N, BOUNDS, M, chunk_held=True)
    want = brute_force(N, M, BOUNDS, pol.streaming_heads(), SINK, WINDOW, kept, chunk_held=True)
    assert (res.footprint, res.entries, res.full_entries) == (
        want.footprint, want.entries, want.full_entries)
    causal = kv_footprint(pol, N, BOUNDS, M)
    if name == "full":
        assert res.footprint == 1.0
    else:  # holding the chunk whole costs a policy relatively more than full attention
        assert causal.footprint < res.footprint < 1.0


@pytest.mark.parametrize("name", ["snapkv", "pyramidkv"])
def test_brute_force_chunk_held_over_several_steps(name):
    """A decoupled eviction chunk (E = 16, vLLM steps ending at `steps`): each query holds its
    chunk up to its step's end; the paper's causal count does not depend on the steps."""
    pol = policy(name, sparsity=0.5, obs_window=4, eviction="naive", eviction_chunk=16)
    steps = [5, 16, 20, 30, 32, 40]
    assert eviction_boundaries(steps, N, 16) == BOUNDS
    kept = [[pol.chunk_keep(layer, c, i == 2).kept for i, c in enumerate([16, 16, 8])]
            for layer in range(3)]
    res = kv_footprint(pol, N, BOUNDS, M, chunk_held=True, step_boundaries=steps)
    want = brute_force(N, M, BOUNDS, pol.streaming_heads(), 0, 1, kept, chunk_held=True,
                       steps=steps)
    assert (res.footprint, res.entries, res.full_entries) == (
        want.footprint, want.entries, want.full_entries)
    whole = kv_footprint(pol, N, BOUNDS, M, chunk_held=True)
    causal = kv_footprint(pol, N, BOUNDS, M)
    assert causal.footprint < res.footprint < whole.footprint
    assert kv_footprint(pol, N, BOUNDS, M, chunk_held=True, step_boundaries=BOUNDS) == whole
    with pytest.raises(ValueError, match="must include every chunk boundary"):
        kv_footprint(pol, N, BOUNDS, M, chunk_held=True, step_boundaries=[5, 20, 40])


def test_eviction_boundaries():
    assert eviction_boundaries([128, 256, 512, 600, 1024, 1100], 1100, 512) == [512, 1024, 1100]
    assert eviction_boundaries([128, 256, 300], 300, None) == [128, 256, 300]


@dataclass
class ScheduledPolicy(KVPolicy):
    """Token eviction with a table of kept counts per (layer, chunk length, is_final)."""

    table: dict = None  # type: ignore[assignment]

    @property
    def evicts_tokens(self) -> bool:
        return True

    def chunk_keep(self, layer: int, chunk_len: int, is_final: bool) -> ChunkKeep:
        return ChunkKeep(chunk_len=chunk_len, window=0,
                         selected=self.table[(layer, chunk_len, is_final)])


def test_brute_force_irregular_schedule():
    bounds = [16, 28, 40]  # lengths 16, 12, 12: two equal lengths, only one of them final
    table = {(0, 16, False): 5, (0, 12, False): 3, (0, 12, True): 12,
             (1, 16, False): 16, (1, 12, False): 0, (1, 12, True): 1}
    pol = ScheduledPolicy(config=KVPolicyConfig(policy="snapkv"), num_layers=2, num_kv_heads=3,
                          table=table)
    res = kv_footprint(pol, N, bounds, M)
    kept = [[5, 3, 12], [16, 0, 1]]
    assert res == brute_force(N, M, bounds, pol.streaming_heads(), 0, 1, kept)


def test_kept_count_out_of_range_raises():
    pol = ScheduledPolicy(config=KVPolicyConfig(policy="snapkv"), num_layers=1, num_kv_heads=1,
                          table={(0, 40, True): 41})
    with pytest.raises(ValueError, match="keeps 41"):
        kv_footprint(pol, N, [40], M)


# -- consistency and speed ------------------------------------------------------------------------

def test_head_mask_footprint_matches_policy():
    full_heads = torch.zeros(30, 3, dtype=torch.bool)
    full_heads.view(-1)[::10] = True                      # 9 of 90 full ...
    full_heads.view(-1)[1::10] = True                     # ... 18 ...
    full_heads.view(-1)[2::10] = True                     # ... 27 full: h = 63 / 90 = 0.7
    pol = policy("duo", 30, 3, full_heads=full_heads, sink=64, window=256)
    bounds = chunk_boundaries_for(8000, 2048)
    res = kv_footprint(pol, 8000, bounds, 64)
    ref = head_mask_footprint(8000, 64, 2048, 63 / 90, 64, 256)
    assert res.footprint == pytest.approx(ref.footprint, rel=1e-12)
    assert res.peak_kv == pytest.approx(ref.peak_kv, rel=1e-12)
    assert res.entries == pytest.approx(ref.entries, rel=1e-12)


def test_smaller_chunks_lower_the_footprint():
    values = [head_mask_footprint(8192, 64, c, 0.7, 64, 256).footprint
              for c in (8192, 4096, 2048, 1024)]
    assert values == sorted(values, reverse=True)


@pytest.mark.parametrize("name", ["snapkv", "pyramidkv", "prulong"])
def test_cheap_at_128k(name):
    """512 chunks x 30 layers: the policy is asked once per (layer, chunk length, final), not
    once per chunk (a count, not a timing: timings come from benchmark scripts)."""
    full_heads = torch.rand(30, 3, generator=torch.Generator().manual_seed(0)) > 0.7
    pol = policy(name, 30, 3, full_heads=full_heads if name == "prulong" else None)
    calls = []
    original = pol.chunk_keep
    object.__setattr__(pol, "chunk_keep", lambda *a: calls.append(a) or original(*a))
    bounds = chunk_boundaries_for(131072, 256)  # 512 chunks
    res = kv_footprint(pol, 131072, bounds, 1000)
    assert 0 < res.footprint <= 1
    assert len(calls) <= 30 * 2
