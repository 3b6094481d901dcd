"""Pool storage of streaming heads without a server: vLLM's own BlockPool and manager factory
drive `SinkWindowManager` (which blocks a request holds as it advances), the group planner, the
paged read-back at arbitrary slots, and the start-up refusals of what pool storage does not
serve yet."""

from __future__ import annotations

import pytest
import torch

from vllm_kvevict.config import KVPolicyConfig, KVPolicyError
from vllm_kvevict.integration.kv_cache.pool_groups import _first_fit, _pack, plan_widths
from vllm_kvevict.integration.kv_cache.sink_window import (SinkWindowManager, SinkWindowSpec,
                                                           register_manager)


def _manager(sink: int, window: int, block: int = 16, blocks: int = 64, chunk: int = 0,
             retention: int | None = 0, caching: bool = False):
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.single_type_kv_cache_manager import get_manager_for_kv_cache_spec

    register_manager()
    spec = SinkWindowSpec(block_size=block, num_kv_heads=2, head_size=64, dtype=torch.float32,
                          sliding_window=window + 1, sink=sink, chunk=chunk, retention=retention)
    pool = BlockPool(blocks, enable_caching=caching, hash_block_size=block)
    manager = get_manager_for_kv_cache_spec(spec, max_in_flight_tokens=64, max_model_len=4096,
                                            block_pool=pool, enable_caching=caching,
                                            kv_cache_group_id=0, scheduler_block_size=block)
    return manager, pool, spec


def _held(manager, req="r") -> list[int]:
    """Block positions (index in the request's row) that hold a real block."""
    return [i for i, b in enumerate(manager.req_to_blocks[req]) if not b.is_null]


def test_vllm_builds_our_manager_with_the_window_cap():
    manager, _, spec = _manager(sink=20, window=40)
    assert isinstance(manager, SinkWindowManager)
    # no canonical chunk: sink blocks + the windows before and after a step of 64 in flight
    assert manager.max_admission_blocks_per_request == 2 + min(-(-(40 + 64) // 16) + 1,
                                                               2 * (-(-40 // 16) + 1))
    assert spec.max_admission_blocks_per_request(64, 4096) == manager.max_admission_blocks_per_request


@pytest.mark.parametrize("chunk", [0, 64])
def test_sink_blocks_kept_gap_freed_window_kept(chunk):
    """Steps through a 200-token prompt, then decode: before each step vLLM calls
    remove_skipped_blocks with the tokens computed so far (a), then counts and allocates the
    step's blocks. Held after the allocation: every block with a token of the sink, of
    [anchor - W, a) (anchor: a, or with canonical chunks of E the start of a's chunk while in
    the prompt) and of the step's tokens a later step reads: all of them with canonical chunks
    and dense retention (a prefix hit may start anywhere), else only the step's last W (the
    rest are null blocks, never allocated). Everything else is back in the pool, and vLLM's
    count of blocks to allocate is what was allocated."""
    sink, window, bs, prompt = 20, 40, 16, 200
    manager, pool, _ = _manager(sink, window, bs, chunk=chunk, retention=None)
    free0 = pool.get_num_free_blocks()
    computed = 0
    for step in [96, 48, 56] + [1] * 30:
        manager.remove_skipped_blocks("r", computed, num_prompt_tokens=prompt)
        end = computed + step
        free_before = pool.get_num_free_blocks()
        count = manager.get_num_blocks_to_allocate("r", end, [], computed, computed, end)
        manager.allocate_new_blocks("r", end, end)
        assert free_before - pool.get_num_free_blocks() == count, (computed, count)
        held = _held(manager)
        anchor = computed // chunk * chunk if chunk and computed < prompt else computed
        needed = {p // bs for p in range(min(sink, end))}
        needed |= {p // bs for p in range(max(anchor - window, 0), computed)}
        step_kept = computed if chunk else max(end - window, computed)
        needed |= {p // bs for p in range(step_kept, end)}
        assert set(held) == needed, (computed, held, sorted(needed))
        assert pool.get_num_free_blocks() == free0 - len(held)
        computed = end
    manager.free("r")
    assert pool.get_num_free_blocks() == free0
    # a preempted request comes back under the same id and is freed from the start again
    manager.allocate_new_blocks("r", 96, 96)
    manager.remove_skipped_blocks("r", 96, num_prompt_tokens=prompt)
    manager.allocate_new_blocks("r", 192, 192)
    # (without canonical chunks: sink blocks 0-1, [56, 96) kept by the first step, [152, 192)
    # by the second; with them the first chunk's window starts at 64 - 40)
    assert _held(manager) == ([0, 1, 3, 4, 5, 9, 10, 11] if not chunk else list(range(12)))
    manager.free("r")
    assert pool.get_num_free_blocks() == free0


@pytest.mark.parametrize("retention", [0, 64, None])
def test_retention_stores_chunk_tails_and_the_last_chunk(retention):
    """Canonical chunks of E = 128 with vLLM's retention interval R: the scheduler's steps end
    at chunk ends (here the first chunk in two steps, then whole ones). A step that ends a
    chunk before the prompt's last stores only the blocks of its last W positions (R = 0), and
    with R = 64 also the chunk's positions below its multiple of R; a step that does not end
    its chunk, and the prompt's last chunk, store everything; R = None (dense) stores every
    position. Held after each allocation: the sink, [anchor - W, a) and what the step stores;
    vLLM's count of blocks to allocate is what was allocated."""
    sink, window, bs, prompt, E = 20, 20, 16, 300, 128
    manager, pool, _ = _manager(sink, window, bs, chunk=E, retention=retention)
    free0, computed, stored = pool.get_num_free_blocks(), 0, []
    for step in [40, 88, 128, 44] + [1] * 10:
        manager.remove_skipped_blocks("r", computed, num_prompt_tokens=prompt)
        end = computed + step
        count = manager.get_num_blocks_to_allocate("r", end, [], computed, computed, end)
        free_before = pool.get_num_free_blocks()
        manager.allocate_new_blocks("r", end, end)
        assert free_before - pool.get_num_free_blocks() == count, (computed, count)
        anchor = computed // E * E if computed < prompt else computed
        needed = {p // bs for p in range(min(sink, end))}
        needed |= {p // bs for p in range(max(anchor - window, 0), computed)}
        step_pos = set(range(computed, end))
        if retention is not None and end % E == 0 and end < prompt:
            lo = end - E if not retention else (end - 1) // retention * retention
            step_pos = {p for p in step_pos if p < max(lo, 32) or p >= (end - window) // bs * bs}
        needed |= {p // bs for p in step_pos}
        assert set(_held(manager)) == needed, (computed, _held(manager), sorted(needed))
        stored.append(len(step_pos))
        computed = end
    expected = {0: [40, 32, 32, 44], 64: [40, 56, 96, 44], None: [40, 88, 128, 44]}
    assert stored[:4] == expected[retention]
    manager.free("r")
    assert pool.get_num_free_blocks() == free0


@pytest.mark.parametrize("retention", [0, None])
def test_cache_hits_start_where_the_retained_blocks_allow(retention):
    """vLLM's own BlockPool with caching on: a 200-token prompt (chunks of 64) runs and is
    freed; a request with the same block hashes then hits at the longest h whose sink and
    [kE - W, h) blocks are cached: any block with dense retention; with R = 0 a chunk
    boundary (the tail a chunk end stores) or a block of the prompt's last chunk (stored
    whole: the replay boundary)."""
    from types import SimpleNamespace

    from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager

    sink, window, bs, prompt, E = 20, 40, 16, 200, 64
    manager, pool, spec = _manager(sink, window, bs, chunk=E, retention=retention,
                                   caching=True)
    request = SimpleNamespace(request_id="a", num_prompt_tokens=prompt, sampling_params=None,
                              block_hashes=[bytes([i]) * 32 for i in range(prompt // bs)],
                              shared_prefix_boundary=None)
    computed = 0
    for step in [64, 64, 64, 8, 1, 1]:
        manager.remove_skipped_blocks("a", computed, num_prompt_tokens=prompt)
        manager.allocate_new_blocks("a", computed + step, computed + step)
        computed += step
        manager.cache_blocks(request, computed, replay_boundaries=(prompt - 1,))
    manager.free("a")

    def hit(max_length):
        rows, h = SinkWindowManager.find_longest_cache_hit(
            request.block_hashes, max_length, [0], pool, spec, False, None)
        return h

    got = [hit(m) for m in range(bs, prompt, bs)]
    if retention is None:
        assert got == list(range(bs, prompt, bs))
    else:  # the first chunk's blocks are all there (its window reaches the sink)
        assert got == [h if h <= E or h >= 3 * E else h // E * E
                       for h in range(bs, prompt, bs)], got
    assert "find_longest_cache_hit" in SlidingWindowManager.__dict__


@pytest.mark.parametrize("chunk", [0, 64])
def test_a_decoding_request_holds_at_most_the_decode_window(chunk):
    """The admission reserve counts a request past its prompt at `decode_blocks(K)` in a
    streaming group (the prompt step's cap is larger): with K = 3 drafts and some rejected,
    the blocks held after every decode step's allocation stay within it, and the reserve asks
    a decoding request for no more growth than that."""
    import random
    from types import SimpleNamespace

    from vllm_kvevict.integration.core.admission import GrowthReserve

    sink, window, bs, prompt, drafts = 20, 40, 16, 200, 3
    manager, pool, spec = _manager(sink, window, bs, chunk=chunk)
    computed, rng = 0, random.Random(0)
    for step in [96, 48, 56]:
        manager.remove_skipped_blocks("r", computed, num_prompt_tokens=prompt)
        manager.allocate_new_blocks("r", computed + step, computed + step)
        computed += step
    cap = spec.decode_blocks(drafts)
    assert cap < manager.max_admission_blocks_per_request
    for _ in range(40):  # a verification step: 1 + K slots, then 1..K+1 tokens accepted
        manager.remove_skipped_blocks("r", computed, num_prompt_tokens=prompt)
        end = computed + 1 + drafts
        manager.allocate_new_blocks("r", end, end)
        assert len(_held(manager)) <= cap, (computed, _held(manager))
        computed += rng.randint(1, drafts + 1)

    reserve = GrowthReserve()
    request = SimpleNamespace(request_id="r", num_prompt_tokens=prompt, num_computed_tokens=0,
                              sampling_params=SimpleNamespace(max_tokens=400))
    reserve.scheduler = SimpleNamespace(
        requests={"r": request}, num_spec_tokens=drafts, max_model_len=4096, running=[],
        kv_cache_manager=SimpleNamespace(coordinator=SimpleNamespace(
            single_type_managers=[manager])))
    assert reserve.final_need(request) == [manager.max_admission_blocks_per_request * bs]
    request.num_computed_tokens = prompt
    assert reserve.final_need(request) == [cap * bs]
    manager.free("r")


def test_plan_widths_balances_groups_of_equal_width():
    # the bundled prulong 0.7 mask has 27 full and 63 streaming heads over 30 layers of 3
    full = [(f"l{i}", h) for i, h in enumerate([1, 2, 0, 1, 3, 0] * 5) if h]
    streaming = [(f"l{i}.s", 3 - h) for i, h in enumerate([1, 2, 0, 1, 3, 0] * 5) if 3 - h]
    width, full_groups, stream_groups = plan_widths(full, streaming, 8192, 64 + 257 + 1024)
    sizes = {n: h for n, h in full + streaming}
    used = [sum(sizes[n] for n in g) for g in full_groups + stream_groups]
    assert max(used) <= width
    # every layer in exactly one group
    names = [n for g in full_groups + stream_groups for n in g]
    assert sorted(names) == sorted(sizes)
    # full groups hold whole sequences: no padding on them here
    assert all(sum(sizes[n] for n in g) == width for g in full_groups), (width, used)


def test_plan_widths_packs_exactly_where_first_fit_pads():
    """The bundled prulong mask at head sparsity 0.1: 21 layers of 3 full heads and 9 of 2.
    First-fit decreasing puts seven bins of 3+3+3, then the 2s four to a bin (10 bins of 9, one
    group padded); 3+2+2+2 three times and 3+3+3 six times is 9 bins without padding. Before
    the exact search the planner escaped to blocks of 27 heads and padded the streaming group
    3x: 97.9 % of full attention's KV bytes at 4K where DuoAttention's mask held 92.6 %."""
    counts = [3, 2, 3, 2, 3, 2, 2, 3, 3, 2, 2, 3, 3, 3, 3, 3, 3, 2, 2, 3, 3, 2, 3, 3, 3, 3, 3,
              3, 3, 3]
    full = [(f"l{i}", h) for i, h in enumerate(counts)]
    streaming = [(f"l{i}.s", 3 - h) for i, h in enumerate(counts) if 3 - h]
    assert len(_first_fit(full, 9)) == 10
    for max_model_len in (2048 + 256, 4096 + 256):
        width, full_groups, stream_groups = plan_widths(full, streaming, max_model_len, 848)
        sizes = dict(full + streaming)
        assert width == 9 and len(full_groups) == 9 and len(stream_groups) == 1
        assert all(sum(sizes[n] for n in g) == 9 for g in full_groups + stream_groups)
        assert sorted(n for g in full_groups + stream_groups for n in g) == sorted(sizes)


def _fewest_bins_by_subsets(sizes: list[int], width: int) -> int:
    """Bin packing's optimum by dynamic programming over subsets (items placed one at a time
    into the open bin or a new one; (bins, open bin's fill) minimised per subset)."""
    best: list = [None] * (1 << len(sizes))
    best[0] = (1, 0)
    for done in range(1 << len(sizes)):
        if best[done] is None:
            continue
        bins, fill = best[done]
        for i, size in enumerate(sizes):
            if not done >> i & 1:
                cand = (bins, fill + size) if fill + size <= width else (bins + 1, size)
                nxt = done | 1 << i
                best[nxt] = cand if best[nxt] is None else min(best[nxt], cand)
    return best[-1][0]


def test_pack_is_optimal_on_small_cases_where_first_fit_is_not():
    import random

    rng = random.Random(0)
    first_fit_worse = 0
    for _ in range(300):
        items = [(f"l{i}", rng.randint(2, 5)) for i in range(rng.randint(3, 11))]
        width = rng.randint(6, 12)
        bins = _pack(items, width)
        sizes = dict(items)
        assert sorted(n for b in bins for n in b) == sorted(sizes)
        assert all(sum(sizes[n] for n in b) <= width for b in bins)
        fewest = _fewest_bins_by_subsets([h for _, h in items], width)
        assert len(bins) == fewest, (items, width, bins)
        first_fit_worse += len(_first_fit(items, width)) > fewest
    assert first_fit_worse > 0  # the cases exercise the exact search


@pytest.mark.served_release
def test_gather_reads_any_slots_back_exactly():
    """The read-back behind pool storage: K/V written through vLLM's own reshape-and-cache at
    scattered slots of a block-outer (strided) cache come back exactly."""
    from vllm import _custom_ops as ops

    from vllm_kvevict.integration.attention.paged_layout import PagedLayout

    torch.manual_seed(0)
    bs, heads, d, blocks = 32, 3, 64, 6
    isa = "vec"
    # a block-outer buffer: another layer's page sits between this layer's blocks
    buf = torch.zeros(blocks, 2, heads, 2 * bs, d)
    cache = buf[:, 1]                                  # [B, H, 2 * bs, d], block stride 2 pages
    key_cache, value_cache = cache.chunk(2, dim=2)
    slots = torch.randperm(blocks * bs)[:100]
    k, v = torch.randn(100, heads, d), torch.randn(100, heads, d)
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa, k_scale=1.0,
                                   v_scale=1.0, kv_cache_dtype="auto")
    layout = PagedLayout(torch.float32, bs, d, isa)
    order = torch.randperm(100)
    got_k, got_v = layout.gather(key_cache, value_cache, slots[order])
    assert torch.equal(got_k, k[order]) and torch.equal(got_v, v[order])
    assert torch.count_nonzero(buf[:, 0]) == 0  # the other layer's pages untouched
    # a tensor-parallel rank's first heads of a padded companion
    got_k, got_v = layout.gather(key_cache[:, :2], value_cache[:, :2], slots[order])
    assert torch.equal(got_k, k[order, :2]) and torch.equal(got_v, v[order, :2])
    got_k, got_v = layout.gather(key_cache, value_cache, slots[:0])  # a first chunk: no past
    assert got_k.shape == got_v.shape == (0, heads, d)
    # the decode fast path's flat offsets ([2, H, n, d]), all heads and a rank's first two
    for h in (heads, 2):
        at = layout.flat_offsets(key_cache[:, :h], value_cache[:, :h], slots[order])
        got = layout.gather_flat(key_cache[:, :h], at).view(2, h, 100, d)
        assert torch.equal(got[0], k[order, :h].transpose(0, 1))
        assert torch.equal(got[1], v[order, :h].transpose(0, 1))


def test_head_masks_serve_prefix_caching_token_eviction_does_not():
    """Head masks keep prefix caching (their sink + window state in cached pool blocks);
    token eviction, alone or on a head mask's full heads, does not."""
    for policy in ("streaming", "duo", "prulong"):
        assert KVPolicyConfig.from_dict({"policy": policy}).caches_prefixes
    hybrid = KVPolicyConfig.from_dict({"policy": "prulong", "token_policy": "snapkv"})
    assert not hybrid.caches_prefixes
    for policy in ("full", "snapkv", "pyramidkv"):
        assert not KVPolicyConfig.from_dict({"policy": policy}).caches_prefixes


def test_the_removed_ring_storage_is_an_unknown_key():
    """`streaming_storage` (the per-request ring beside vLLM's pool) is gone: the key is
    refused with the valid ones named, never ignored."""
    with pytest.raises(KVPolicyError, match=r"unknown kv_policy key\(s\) \['streaming_storage'\]"):
        KVPolicyConfig.from_dict({"policy": "prulong", "streaming_storage": "ring"})


def test_canonical_chunks_split_a_step_that_crosses_one():
    """A step [20, 40) of a 100-token prompt with canonical chunks of 16 (sink 4, window 8):
    its queries in [20, 32) belong to chunk [16, 32) and see the sink, [8, 16) and the chunk so
    far ([16, 20) from the pool, the rest from the step); those in [32, 40) see the sink and
    [24, 32), all from the step. A decode step keeps its own window."""
    from vllm_kvevict.integration.attention.step_plan import build_step_plan

    plan = build_step_plan([20, 100], [20, 1], sink=4, window=8, block_size=32,
                           prompt_lens=[100, 100], chunk=16)
    assert plan.num_reqs == 3 and plan.query_start_loc.tolist() == [0, 12, 20, 21]
    pos = plan.prefix_pos.tolist()
    rows = plan.prefix_row.tolist()
    # kernel rows' pool past, in order: piece 1, piece 2, the decode row of request 1
    lens = plan.seq_lens.tolist()
    step = plan.chunk_src.tolist()
    assert pos[:16] == [0, 1, 2, 3, *range(8, 20)] and set(rows[:16]) == {0}
    assert lens[0] == 16 + 12 and step[:12] == list(range(12))   # tokens 20..31
    assert pos[16:20] == [0, 1, 2, 3] and lens[1] == 4 + 16       # past: sink only
    assert step[12:28] == list(range(4, 20))                     # positions 24..39
    assert pos[20:] == [0, 1, 2, 3, *range(92, 100)] and lens[2] == 4 + 8 + 1


def test_the_start_up_hint_names_the_block_size_that_decodes_in_place():
    """worker.in_place_hint: silent when the sink is whole blocks and the window at least one;
    otherwise it says why and names a block size that would do (none if none would)."""
    from vllm_kvevict.integration.worker.state import in_place_hint

    assert in_place_hint(64, 256, 64) is None and in_place_hint(128, 1024, 128) is None
    assert in_place_hint(0, 256, 128) is None
    hint = in_place_hint(64, 256, 128)
    assert "sink (64) is not whole 128-token blocks" in hint and "--block-size 64" in hint
    assert "--block-size 32" in in_place_hint(32, 32, 128)
    assert "window (64) is shorter than a 128-token block" in in_place_hint(128, 64, 128)
    assert "--block-size" not in in_place_hint(16, 64, 32)


def test_the_start_up_hint_names_larger_full_blocks_where_they_apply():
    """worker.full_block_hint: with full heads in blocks of 32 or 64 tokens it names
    --kv-full-block-size 128; silent once given, at 128, for `streaming` (no full heads) and
    for a block size whose kernel path differs (16)."""
    from vllm_kvevict.config import KVPolicyConfig
    from vllm_kvevict.integration.worker.state import full_block_hint

    prulong = KVPolicyConfig.from_dict({"policy": "prulong"})
    assert "--kv-full-block-size 128" in full_block_hint(64, prulong)
    assert "--kv-full-block-size 128" in full_block_hint(32, prulong)
    assert full_block_hint(128, prulong) is None and full_block_hint(16, prulong) is None
    assert full_block_hint(64, prulong.replace(full_block_size=128)) is None
    assert full_block_hint(64, KVPolicyConfig.from_dict({"policy": "streaming"})) is None
    assert full_block_hint(64, prulong.replace(token_policy="snapkv")) is None  # (refused)


def test_a_uniform_decode_step_gets_its_rows_windows_and_their_attention():
    """step_plan.decode_pos: a step whose rows are all one decode query seeing as many tokens
    gives each row its sink + window then itself (the fast path of
    `paged_layout.decode_window`); a prefill row, a multi-query row or rows of unequal length
    give None (the kernel path). decode_attention equals plain softmax attention per query
    head over its KV head's keys (GQA: query head j reads KV head j // group)."""
    from vllm_kvevict.integration.attention.step_plan import build_step_plan, decode_attention

    plan = build_step_plan([100, 200], [1, 1], sink=4, window=8, block_size=32,
                           prompt_lens=[50, 60], chunk=16)
    assert plan.decode_pos.tolist() == [[0, 1, 2, 3, *range(92, 100), 100],
                                        [0, 1, 2, 3, *range(192, 200), 200]]
    assert plan.chunk_src.tolist() == [0, 1]
    for prompt_lens in ([50, 60], None):  # prefix caching off: no canonical chunks
        assert torch.equal(build_step_plan([100, 200], [1, 1], 4, 8, 32, prompt_lens).decode_pos,
                           plan.decode_pos)
    # a 1-token piece of a canonical chunk sees the chunk's window, not its own
    assert build_step_plan([100, 200], [1, 1], 4, 8, 32, [150, 260], chunk=16).decode_pos is None
    assert build_step_plan([100, 10], [1, 1], 4, 8, 32, [50, 5], chunk=16).decode_pos is None
    assert build_step_plan([100, 20], [1, 4], 4, 8, 32, [50, 60], chunk=16).decode_pos is None
    assert build_step_plan([100, 200], [1, 3], 4, 8, 32, [50, 60], chunk=16).decode_pos is None
    torch.manual_seed(0)
    B, hkv, g, L, d = 3, 2, 3, 13, 64
    q, k, v = torch.randn(B, hkv * g, d), torch.randn(hkv, B, L, d), torch.randn(hkv, B, L, d)
    out = decode_attention(q, k, v, 0.125)
    for b in range(B):
        for j in range(hkv * g):
            w = torch.softmax(k[j // g, b] @ q[b, j] * 0.125, dim=0)
            torch.testing.assert_close(out[b, j], w @ v[j // g, b])


def test_a_decode_only_plan_equals_the_general_one_field_by_field():
    """build_step_plan's decode-only plan (`DecodeStepPlan`: scratch indices built on first
    use) holds exactly what the general builder computes for the same rows, with and without
    canonical chunks, rows shorter than sink + window included; a step with a prompt row, a
    multi-query row or patched questions takes the general builder."""
    import dataclasses
    import random

    from vllm_kvevict.integration.attention.step_plan import (DecodeStepPlan, StepPlan, build_plan,
                                                           build_step_plan)

    rng = random.Random(0)
    for case in range(40):
        sink, window, bs = rng.choice([(4, 8, 32), (64, 256, 64), (0, 96, 32), (32, 64, 16)])
        computed = [rng.randrange(1, 700) for _ in range(rng.randrange(1, 9))]
        chunk = rng.choice([None, 64])
        prompts = [rng.randrange(1, a + 1) for a in computed] if chunk or case % 2 else None
        args = (computed, [1] * len(computed), sink, window, bs, prompts)
        fast, ref = build_step_plan(*args, chunk=chunk), build_plan(*args, chunk=chunk)
        assert isinstance(fast, DecodeStepPlan)
        for f in dataclasses.fields(StepPlan):
            a, b = getattr(fast, f.name), getattr(ref, f.name)
            assert (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b), f.name
    for args, kw in [(([100, 200], [1, 1], 4, 8, 32, [150, 60]), {"chunk": 16}),  # in prompt
                     (([100, 200], [1, 3], 4, 8, 32, [50, 60]), {"chunk": 16}),
                     (([100, 200], [1, 1], 4, 8, 32, [50, 60]), {"questions": [(0, 2, 2)]}),
                     (([100, 200], [1, 1], 4, 8, 32, None), {"chunk": 16})]:
        assert not isinstance(build_step_plan(*args, **kw), DecodeStepPlan)


@pytest.mark.served_release
@pytest.mark.parametrize("sink,window,bs", [(64, 256, 64), (32, 64, 32), (0, 96, 32),
                                            (128, 128, 128)])
def test_window_rows_run_the_streaming_decode_in_place(sink, window, bs):
    """step_plan.window_rows: vLLM's CPU kernel over the pool's own blocks, with the virtual
    block rows and seq_lens it builds and a sliding window of sink + window + 1, gives each
    decode query exactly plain softmax attention over [0, sink), [q - W, q) and q (GQA); rows
    of any length in one call, short rows (q - W <= sink: all of [0, q]) among them, blocks
    scattered in the pool, every other slot of a row's blocks holding other numbers."""
    from vllm import _custom_ops as ops
    from vllm import envs

    from vllm_kvevict.integration.attention.step_plan import build_step_plan, window_rows

    torch.manual_seed(0)
    heads, g, d, n = 3, 3, 64, 1100
    qs = [window + sink - 5, window + sink, window + sink + 1, window + 2 * bs - 1, 700, 1099]
    plan = build_step_plan(qs, [1] * len(qs), sink, window, bs, [q - 3 for q in qs], chunk=256)
    assert plan.decode_q.tolist() == qs
    nb = -(-n // bs)
    table = (torch.randperm(2 * nb * len(qs))[:nb * len(qs)] + 1).view(len(qs), nb).to(torch.int32)
    cache = torch.randn(2 * nb * len(qs) + 1, heads, 2 * bs, d)  # slots not written: noise
    key_cache, value_cache = cache.chunk(2, dim=2)
    K, V = torch.randn(len(qs), n, heads, d), torch.randn(len(qs), n, heads, d)
    for r in range(len(qs)):
        slots = table[r, torch.arange(qs[r] + 1) // bs].long() * bs + torch.arange(qs[r] + 1) % bs
        ops.cpu_attn_reshape_and_cache(K[r, :qs[r] + 1], V[r, :qs[r] + 1], key_cache,
                                       value_cache, slots, "vec", k_scale=1.0, v_scale=1.0,
                                       kv_cache_dtype="auto")
    cols, seq_lens = window_rows(plan.decode_q, sink, window, bs)
    rows = torch.gather(table, 1, cols).contiguous()
    query = torch.randn(len(qs), heads * g, d)
    win, q_start = sink + window + 1, plan.query_start_loc
    sched = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(qs), num_heads=heads * g, num_kv_heads=heads, head_dim=d,
        seq_lens=seq_lens, dtype=torch.float32, query_start_loc=q_start, causal=True,
        sliding_window_size=win, isa="vec", enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
        dynamic_causal=None, kv_cache_dtype="auto")
    out = torch.empty_like(query)
    ops.cpu_attention_with_kv_cache(
        query=query, key_cache=key_cache, value_cache=value_cache, output=out,
        query_start_loc=q_start, seq_lens=seq_lens, scale=d ** -0.5, causal=True,
        alibi_slopes=None, sliding_window=win, block_table=rows, softcap=0.0,
        scheduler_metadata=sched, s_aux=None, dynamic_causal=None)
    for r, q in enumerate(qs):
        p = torch.arange(q + 1)
        seen = p[(p < sink) | (p >= q - window)]
        for j in range(heads * g):
            w = torch.softmax(K[r, seen, j // g] @ query[r, j] * d ** -0.5, dim=0)
            torch.testing.assert_close(out[r, j], w @ V[r, seen, j // g], atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"row {r} q {q}: {m}")


@pytest.mark.served_release
def test_vllm_cpu_kernel_reads_a_block_outer_cache_exactly():
    """Pool storage declares vLLM's block-outer layout (BLHNC): a layer's blocks are strided by
    the whole block (every layer's pages), not by its own page. vLLM's CPU reshape-and-cache
    and attention kernels must give bit-identical results on such a view."""
    from vllm import _custom_ops as ops

    torch.manual_seed(0)
    bs, heads, q_per_kv, d, blocks = 32, 2, 3, 64, 8
    isa = "vec"
    strided = torch.zeros(blocks, 3, heads, 2 * bs, d)[:, 1]   # two other pages per block
    dense = torch.zeros(blocks, heads, 2 * bs, d)
    lens = [70, 33]
    table = torch.tensor([[5, 2, 7, 0], [1, 4, 0, 0]], dtype=torch.int32)
    slots = torch.cat([table[r, torch.arange(n) // bs].long() * bs + torch.arange(n) % bs
                       for r, n in enumerate(lens)])
    k, v = torch.randn(len(slots), heads, d), torch.randn(len(slots), heads, d)
    q = torch.randn(sum(lens), heads * q_per_kv, d)
    outs = []
    for cache in (strided, dense):
        key_cache, value_cache = cache.chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa, k_scale=1.0,
                                       v_scale=1.0, kv_cache_dtype="auto")
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        start = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32)
        sched = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=2, num_heads=heads * q_per_kv, num_kv_heads=heads, head_dim=d,
            seq_lens=seq_lens, dtype=torch.float32, query_start_loc=start, causal=True,
            sliding_window_size=-1, isa=isa, enable_kv_split=False, dynamic_causal=None,
            kv_cache_dtype="auto")
        out = torch.empty_like(q)
        ops.cpu_attention_with_kv_cache(
            query=q, key_cache=key_cache, value_cache=value_cache, output=out,
            query_start_loc=start, seq_lens=seq_lens, scale=d ** -0.5, causal=True,
            alibi_slopes=None, sliding_window=-1, block_table=table, softcap=0,
            scheduler_metadata=sched, s_aux=None, dynamic_causal=None, k_scale=1.0,
            v_scale=1.0, kv_cache_dtype="auto")
        outs.append(out)
    assert torch.equal(outs[0], outs[1]) and torch.isfinite(outs[0]).all()


def test_vllm_internals_pool_storage_overrides():
    """The vLLM methods our sink + window manager overrides keep the signatures we wrote
    against (vLLM calls them by keyword)."""
    import inspect

    from vllm.v1.core.single_type_kv_cache_manager import (SingleTypeKVCacheManager,
                                                           SlidingWindowManager)

    params = lambda f: list(inspect.signature(f).parameters)  # noqa: E731
    assert params(SlidingWindowManager.find_longest_cache_hit) == params(
        SinkWindowManager.find_longest_cache_hit)
    assert params(SingleTypeKVCacheManager.remove_skipped_blocks) == [
        "self", "request_id", "processed_computed_tokens", "num_prompt_tokens"]
    assert params(SingleTypeKVCacheManager.cache_blocks)[:3] == ["self", "request", "num_tokens"]
    assert "reachable_block_mask" in SlidingWindowManager.__dict__
    # without prefix caching: the step's dropped blocks (allocate_new_blocks, counted by
    # get_num_blocks_to_allocate), the forward gap walk, the per-request watermark's reset
    for name in ("allocate_new_blocks", "get_num_blocks_to_allocate", "_remove_blocks_in_range",
                 "pop_blocks_for_free"):
        assert params(getattr(SingleTypeKVCacheManager, name)) == params(
            getattr(SinkWindowManager, name)), name
    manager, _, _ = _manager(sink=16, window=32)
    for attr in ("_partial_hit_reqs", "records_new_block_ids", "new_block_ids",
                 "req_to_blocks"):
        assert hasattr(manager, attr), attr
    assert manager.block_pool.null_block.is_null  # (what dropped positions hold)


def test_pool_storage_prompt_steps_stop_at_canonical_chunk_ends():
    """The scheduler side: a prompt step never crosses a multiple of E (so a streaming group
    holds at most sink + W + E tokens, the admission cap); decode steps are left alone."""
    from types import SimpleNamespace

    from vllm_kvevict.integration.core.admission import GrowthReserve

    rule = GrowthReserve()
    rule.canonical_chunk = 256
    request = SimpleNamespace(request_id="r", num_prompt_tokens=700, num_preemptions=0)
    assert rule.step_cap(request, 0, 256) == 256
    assert rule.step_cap(request, 200, 256) == 56     # up to 256
    assert rule.step_cap(request, 512, 256) == 188    # up to the prompt's end (replay_cap)
    assert rule.step_cap(request, 700, 1) == 1        # decode
    rule.canonical_chunk = 0
    assert rule.step_cap(request, 200, 256) == 256


def test_token_ledger_sees_streaming_groups_as_evicting_nothing():
    """A head mask with a token policy and its streaming heads in the pool: vLLM's groups are
    the full heads' (layers by name) then the companions' (a layer without full heads shares
    its companion's cache, so its name sits in a streaming group). The ledger counts a layer in
    its full heads' group only (-1: none), a chunk frees slots in those groups only, and the
    worker's and scheduler's group count is vLLM's."""
    from types import SimpleNamespace

    from vllm_kvevict.integration.kv_cache.sink_window import COMPANION_SUFFIX
    from vllm_kvevict.integration.kv_cache.specs import layer_groups
    from vllm_kvevict.ledger import LayerGroups, group_evictions_of

    name = lambda i: f"model.layers.{i}.self_attn.attn"  # noqa: E731
    # layer 0: full heads only; 1, 2: both; 3: streaming heads only (shares its companion)
    groups = [SimpleNamespace(layer_names=[name(0), name(2)]),
              SimpleNamespace(layer_names=[name(1)]),
              SimpleNamespace(layer_names=[name(1) + COMPANION_SUFFIX,
                                           name(3) + COMPANION_SUFFIX, name(3)]),
              SimpleNamespace(layer_names=[name(2) + COMPANION_SUFFIX])]
    got = layer_groups(SimpleNamespace(kv_cache_groups=groups), 4)
    assert got == LayerGroups((0, 1, 0, -1), total=4) and got.num_groups == 4
    # a 100-token chunk, layers keeping 30 / 40 / 20 / 90: full groups free 100 - their
    # layers' most (layer 3's 90 counts nowhere), streaming groups free nothing
    assert group_evictions_of([30, 40, 20, 90], 100, got) == [70, 60, 0, 0]
    # without companions nothing changes (one group, or one per tier)
    plain = [SimpleNamespace(layer_names=[name(i) for i in range(4)])]
    assert layer_groups(SimpleNamespace(kv_cache_groups=plain), 4) == LayerGroups.single(4)
    assert group_evictions_of([30, 40, 20, 90], 100, LayerGroups.single(4)) == [10]


@pytest.mark.parametrize("world", [1, 3])
def test_flex_head_pages_put_a_layers_heads_of_one_kind_side_by_side(world):
    """The FlexAttention path's pool storage (`head_pages.head_slots`, `head_page_groups`): one KV head per cache layer, so one page size; every
    layer's full slots and its streaming slots each consecutive in one group, in slot order
    (vLLM's layer-outer allocation then puts them one layer stride apart); full groups hold
    full-attention specs, streaming groups `SinkWindowSpec`s tagged with their group; every
    tensor-parallel rank declares the same slots."""
    from types import SimpleNamespace

    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from vllm_kvevict.integration.kv_cache.head_pages import head_page_specs, head_slots
    from vllm_kvevict.integration.kv_cache.head_split import layer_heads
    from vllm_kvevict.integration.kv_cache.pool_groups import head_page_groups

    mask = torch.tensor([[0, 1, 1], [0, 0, 0], [1, 1, 1], [0, 1, 0], [1, 0, 1], [1, 1, 0]],
                        dtype=torch.bool)
    full = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.float32)
    stream = SinkWindowSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.float32,
                            sliding_window=65, sink=16, keep_step=True)
    config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_batched_tokens=256),
                             model_config=SimpleNamespace(max_model_len=4096))
    names = [f"model.layers.{l}.self_attn.attn" for l in range(mask.shape[0])]
    declared = []
    for rank in range(world):
        heads = layer_heads(mask, 3, rank, world)
        specs = head_page_specs(dict(zip(names, heads)), full, stream)
        declared.append(specs)
        assert {s.page_size_bytes for s in specs.values()} == {full.page_size_bytes}
        groups = head_page_groups(config, specs)
        where = {n: (g, i) for g, group in enumerate(groups)
                 for i, n in enumerate(group.layer_names)}
        assert sorted(where) == sorted(specs)  # every slot in exactly one group
        for name, h in zip(names, heads):
            full_slots, stream_slots = head_slots(name, h)
            assert (full_slots + stream_slots)[0] == name  # the attention layer: its first head
            for slots, kind in ((full_slots, FullAttentionSpec), (stream_slots, SinkWindowSpec)):
                if not slots:
                    continue
                g, first = where[slots[0]]
                assert [where[s] for s in slots] == [(g, first + i) for i in range(len(slots))]
                spec = groups[g].kv_cache_spec.kv_cache_specs[slots[0]]
                assert isinstance(spec, kind)
            assert len(h.full_kv) <= h.paged_heads and len(h.streaming_kv) <= h.companion_heads
        tags = [{getattr(s, "group", None) for s in g.kv_cache_spec.kv_cache_specs.values()}
                for g in groups]
        assert all(len(t) == 1 for t in tags)
        stream_tags = [t.pop() for g, t in zip(groups, tags)
                       if isinstance(next(iter(g.kv_cache_spec.kv_cache_specs.values())),
                                     SinkWindowSpec)]
        assert stream_tags == list(range(len(stream_tags)))
    assert all(d == declared[0] for d in declared)


def test_full_heads_in_larger_blocks_count_as_more_head_pages():
    """`--kv-full-block-size 128` beside 64-token streaming blocks: a full KV head's page is
    two head pages (`kv_cache_groups`: the unit is the smallest per-head page) and a sequence
    half as many blocks (`planned_groups` passes max_model_len / 2), so the plan weighs a full
    group's bytes as they are. The bundled mask at 0.7 (27 full heads, 63 streaming): no
    padding either way."""
    full = [(f"f{i}", 2 * h) for i, h in enumerate([3] * 3 + [2] * 6 + [1] * 6)]  # 27 heads
    streaming = [(f"s{i}", h) for i, h in enumerate([3] * 14 + [2] * 6 + [1] * 9)]  # 63
    width, full_groups, stream_groups = plan_widths(full, streaming, 8192 // 2, 64 + 257 + 1024)
    pages = dict(full + streaming)
    assert sum(pages[n] for g in full_groups for n in g) == 54
    for g in full_groups + stream_groups:
        assert sum(pages[n] for n in g) <= width
    # the bytes of the plan: full blocks of 128 tokens at `width` pages each, streaming of 64
    cost = width * (len(full_groups) * 8192 // 128 + len(stream_groups) * (64 + 257 + 1024) // 64)
    ideal = 54 * 8192 // 128 + 63 * (64 + 257 + 1024) // 64
    assert cost <= 1.1 * ideal, (width, len(full_groups), len(stream_groups), cost, ideal)


@pytest.mark.parametrize("kind", ["full", "sink"])
def test_a_manager_that_holds_a_steps_slots_allocates_nothing(kind):
    """The rules quiet steps answer for all KV-cache groups by (kv_cache_coordinator.py), on
    vLLM's own managers of either kind: while a request's blocks hold the step's slots (and no
    copy-on-write hit is pending) vLLM counts 0 blocks to allocate and allocates none, the
    row and the pool unchanged; past them it allocates. Skipped blocks: the full manager never
    frees, ours only when its freed range moves."""
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.single_type_kv_cache_manager import get_manager_for_kv_cache_spec

    from vllm_kvevict.integration.kv_cache.sink_window import PromptFullSpec

    if kind == "sink":
        manager, pool, _ = _manager(64, 256, block=64, blocks=256)
    else:
        register_manager()
        pool = BlockPool(256, enable_caching=False, hash_block_size=64)
        spec = PromptFullSpec(block_size=128, num_kv_heads=2, head_size=64, dtype=torch.float32)
        manager = get_manager_for_kv_cache_spec(spec, max_in_flight_tokens=256,
                                                max_model_len=4096, block_pool=pool,
                                                enable_caching=False, kv_cache_group_id=0,
                                                scheduler_block_size=128)
    computed, prompt, quiet_steps, busy_steps = 0, 700, 0, 0
    last_range, repeats, freeing = None, 0, 0
    for step in [256, 256, 188] + [1] * 300:
        # skipped blocks: vLLM's full manager never frees; ours frees `freed_range`, so a
        # call repeating the last one's range, all of it freed already, changes nothing
        row = list(manager.req_to_blocks.get("r") or ())
        rng = manager.freed_range(computed, prompt) if kind == "sink" else None
        repeat = kind == "full" or (rng == last_range and (
            rng[1] <= rng[0] or manager.freed_to("r") >= rng[1]))
        manager.remove_skipped_blocks("r", computed, num_prompt_tokens=prompt)
        changed = list(manager.req_to_blocks.get("r") or ()) != row
        assert not (repeat and changed), (computed, rng)
        repeats, freeing, last_range = repeats + repeat, freeing + changed, rng
        end = computed + step
        blocks = manager.req_to_blocks.get("r")
        quiet = (blocks is not None and len(blocks) * manager.block_size >= end
                 and "r" not in manager._partial_hit_reqs)
        row, free = list(blocks or ()), pool.get_num_free_blocks()
        count = manager.get_num_blocks_to_allocate("r", end, [], computed, computed, end)
        new = manager.allocate_new_blocks("r", end, end)
        if quiet:
            quiet_steps += 1
            assert (count, new) == (0, []), (computed, step)
            assert manager.req_to_blocks["r"] == row and pool.get_num_free_blocks() == free
        else:
            busy_steps += 1
            assert len(manager.req_to_blocks["r"]) > len(row), (computed, step)
        computed = end
    assert quiet_steps > 250 and busy_steps >= 3
    assert repeats > 250 and freeing >= (kind == "sink") * 3, (repeats, freeing)
    manager.free("r")
