"""The bookkeeping behind real memory, without a server: what each streaming-head step reads
back from the pool, and the token-eviction ledger that the scheduler and the worker must agree
on."""

from __future__ import annotations

import random

import pytest
import torch

from vllm_kvevict.config import KVPolicyConfig
from vllm_kvevict.integration.core.token_ledger import TokenEvictionLedger
from vllm_kvevict.integration.attention.step_plan import build_step_plan, lay_out_rows
from vllm_kvevict.integration.worker.token_plan import TokenEvictionWorker
from vllm_kvevict.ledger import (LayerGroups, allocation_eviction, chunk_kept_per_layer,
                                 eviction_chunk_len, group_evictions)
from vllm_kvevict.policies import build_policy


def visible_before(a: int, sink: int, window: int) -> set[int]:
    """Positions a streaming head may see before a chunk starting at a (the paper's rule)."""
    lw = min(window, a)
    sk = min(sink, a - lw)
    return set(range(sk)) | set(range(a - lw, a))


def test_each_step_lays_out_exactly_the_visible_tokens():
    """Random chunk sizes for three requests: every step's kernel row holds exactly the sink +
    last-window positions before its chunk (read back by position, each token's K its
    position), then the chunk in order."""
    rng = random.Random(0)
    sink, window, bs = 4, 9, 32
    done = [0, 0, 0]
    for _ in range(40):
        q_lens = [rng.choice([1, 1, 2, 5, 13, 30]) for _ in range(3)]
        plan = build_step_plan(done, q_lens, sink, window, bs)
        keys = torch.cat([torch.arange(a, a + q, dtype=torch.float32)
                          for a, q in zip(done, q_lens)]).view(-1, 1, 1)
        laid_k = lay_out_rows(plan, plan.prefix_pos.float().view(-1, 1, 1),
                              keys[plan.chunk_src])
        start = 0
        for r, (a, q) in enumerate(zip(done, q_lens)):
            n = int(plan.seq_lens[r])
            row = laid_k[start:start + n].flatten().tolist()
            v = n - q
            assert set(int(x) for x in row[:v]) == visible_before(a, sink, window)
            assert row[v:] == list(range(a, a + q))  # the chunk, in order, at the end
            start += n
        done = [a + q for a, q in zip(done, q_lens)]


def test_scratch_slots_are_distinct_and_within_rows():
    plan = build_step_plan([500, 3], [1, 70], sink=8, window=16, block_size=32)
    assert plan.scratch_slots.unique().numel() == plan.scratch_slots.numel()
    assert int(plan.seq_lens[0]) == 8 + 16 + 1 and int(plan.seq_lens[1]) == 3 + 70


def simulate_scheduler(policy, prompt_len, chunks, decode, bs, groups=None):
    """The scheduler's view, per KV-cache group: blocks held after every step (allocate, run,
    free the tail)."""
    groups = groups or LayerGroups.single(policy.num_layers)
    G = groups.num_groups
    evicted, computed, held = [0] * G, 0, []
    for c in chunks + [1] * decode:
        held.append([-(-(computed + c - e) // bs) for e in evicted])
        if policy.config.is_eviction_point(computed + c, prompt_len):
            chunk_len = eviction_chunk_len(policy.config, computed, c)
            freed = group_evictions(policy, chunk_len, computed + c == prompt_len, groups)
            evicted = [e + f for e, f in zip(evicted, freed)]
        computed += c
        held.append([-(-(computed - e) // bs) for e in evicted])
    return held


@pytest.mark.parametrize("name, p, num_tiers", [
    ("snapkv", 0.7, 1), ("pyramidkv", 0.5, 1), ("snapkv", 0.0, 1),
    ("pyramidkv", 0.7, 30), ("pyramidkv", 0.5, 5), ("snapkv", 0.7, 3)])
@pytest.mark.parametrize("eviction", ["naive", "patched"])
@pytest.mark.parametrize("eviction_chunk", [None, 256])
def test_worker_and_scheduler_keep_the_same_blocks(name, p, num_tiers, eviction, eviction_chunk):
    """Per KV-cache group, the worker drops exactly the blocks the scheduler frees, and every
    layer writes only into blocks its own group holds, below the group's physical length.
    With an eviction chunk of 256 the steps are smaller and evict only at its boundaries."""
    policy = build_policy(KVPolicyConfig(policy=name, sparsity=p, eviction=eviction,
                                         eviction_chunk=eviction_chunk), 30, 3)
    groups = LayerGroups.tiers(30, num_tiers)
    G = groups.num_groups
    bs, n = 32, 1000
    chunks = [256, 256, 100, 256, 132]
    if eviction_chunk:
        chunks = [100, 100, 56, 128, 128, 100, 92, 64, 168, 64]
    expected = simulate_scheduler(policy, n, chunks, 5, bs, groups)
    worker = TokenEvictionWorker(policy, bs, groups)
    blocks: list[list[int]] = [[] for _ in range(G)]
    next_id, computed, seen = 1, 0, []
    prompt = list(range(n))
    for c in chunks + [1] * 5:
        need = expected[len(seen)]
        for g in range(G):
            while len(blocks[g]) < need[g]:  # vLLM appends the scheduler's new blocks
                blocks[g].append(next_id)
                next_id += 1
        seen.append([len(b) for b in blocks])
        # patched non-final chunks also get k lookahead slots (the question's KVs)
        q = min(64, n) if (eviction == "patched" and computed + c < n and
                           policy.config.is_eviction_point(computed + c, n)) else 0
        for g in range(G):
            while len(blocks[g]) * bs < computed + c + q - worker_alloc(worker, g):
                blocks[g].append(next_id)
                next_id += 1
        plan = worker.plan(["r"], [computed], [c], [n], [[list(b) for b in blocks]],
                           prompt_ids=lambda row: prompt)
        evicts = policy.config.is_eviction_point(computed + c, n)
        assert len(plan.jobs) == evicts
        if evicts and eviction_chunk:  # the job covers the whole chunk, from its start
            assert plan.jobs[0].chunk_len == (computed + c - 1) % eviction_chunk + 1
        for layer in range(30):
            own = blocks[groups.of_layer[layer]]
            assert set((plan.slots[layer] // bs).tolist()) <= set(own), (layer, c)
        counts = [[len(b)] for b in blocks]
        worker.finish_step(plan, lambda r: blocks, counts)
        assert counts == [[len(b)] for b in blocks]
        seen.append([len(b) for b in blocks])
        computed += c
    assert [s[:] for s in seen[1::2]] == expected[1::2], name


def worker_alloc(worker, group):
    led = worker.ledgers.get("r")
    return led.allocation_evicted[group] if led else 0


def test_tiers_hold_fewer_blocks_than_one_group():
    """PyramidKV at p = 0.7 over 8 chunks of 1024: with one group per layer the request holds
    about the mean budget (in layer-blocks), with one group the largest layer's in every layer."""
    policy = build_policy(KVPolicyConfig(policy="pyramidkv", sparsity=0.7), 30, 3)
    bs, chunks = 128, [1024] * 7 + [832]
    held = {}
    for tiers in (1, 2, 3, 5, 6, 30):
        groups = LayerGroups.tiers(30, tiers)
        final = simulate_scheduler(policy, 8000, chunks, 0, bs, groups)[-1]
        held[tiers] = sum(final[g] * len(groups.layers(g)) for g in range(groups.num_groups))
    assert held[1] > held[2] > held[3] > held[5] > held[6] > held[30]
    snap = build_policy(KVPolicyConfig(policy="snapkv", sparsity=0.7), 30, 3)
    snap_final = simulate_scheduler(snap, 8000, chunks, 0, bs)[-1][0] * 30
    assert held[30] <= 1.1 * snap_final  # pyramid's mean budget is snapkv's budget


def test_kept_counts_follow_the_policy():
    policy = build_policy(KVPolicyConfig(policy="pyramidkv", sparsity=0.7), 30, 3)
    kept = chunk_kept_per_layer(policy, 1024, is_final=False)
    assert kept[0] == max(kept) and kept[-1] == min(kept)
    assert allocation_eviction(policy, 1024, False) == 1024 - kept[0]
    # the mean over layers stays the chunk's capacity (patched, non-final: no window inside)
    assert abs(sum(kept) / len(kept) - round(0.3 * 1024)) <= 16


def test_step_cap_keeps_steps_inside_eviction_chunks():
    """With eviction_chunk 512 (prompt 1100): a step never crosses 512 / 1024 / 1100, and when
    the chunk's own last 64 queries score it (naive; the final chunk in patched mode) the last
    step holds them whole, or the request waits (0)."""
    from types import SimpleNamespace

    def cap(eviction, computed, budget):
        policy = build_policy(KVPolicyConfig(policy="snapkv", eviction=eviction,
                                             eviction_chunk=512), 30, 3)
        ledger = TokenEvictionLedger(policy, 512, reserve_growth=False)
        request = SimpleNamespace(request_id="r", num_prompt_tokens=1100, num_preemptions=0,
                                  num_computed_tokens=computed, sampling_params=None)
        ledger.scheduler = SimpleNamespace(requests={"r": request})
        return ledger.step_cap(request, computed, budget)

    for eviction in ("naive", "patched"):
        assert cap(eviction, 0, 128) == 128
        assert cap(eviction, 384, 256) == 128      # stops at the boundary 512
        assert cap(eviction, 1024, 256) == 76      # and at the prompt's end
        assert cap(eviction, 1100, 5) == 5         # decode: untouched
        assert cap(eviction, 1000, 50) == 24
        assert cap(eviction, 1024, 50) == 12       # final chunk: leave its last 64 whole
        assert cap(eviction, 1036, 50) == 0        # 64 left, budget 50: wait
    assert cap("naive", 400, 100) == 48            # a non-final chunk scores itself (naive)
    assert cap("naive", 448, 63) == 0
    assert cap("patched", 400, 100) == 100         # ... or by the question (patched)


def test_replay_follows_the_recorded_chunks():
    """Exact recompute after preemption (admission.py): the prompt chunks a request was first
    prefilled in are recorded; its recompute runs exactly those chunks (or waits), then one
    generated token per step; a first run is never capped."""
    from types import SimpleNamespace

    from vllm_kvevict.integration.core.admission import GrowthReserve

    request = SimpleNamespace(request_id="r", num_prompt_tokens=700, num_computed_tokens=0,
                              num_preemptions=0)
    reserve = GrowthReserve(reserve_growth=False)
    reserve.scheduler = SimpleNamespace(requests={"r": request})

    def run(chunk):  # what the scheduler does after scheduling `chunk` tokens of r
        request.num_computed_tokens += chunk
        reserve.record_chunks(SimpleNamespace(num_scheduled_tokens={"r": chunk}))

    for budget in (256, 100, 256):       # first run: whatever the budget allowed
        assert reserve.replay_cap(request, request.num_computed_tokens, budget) == budget
        run(budget)
    assert reserve.replay_cap(request, 612, 256) == 88      # never past the prompt
    run(88)
    run(1), run(1)                                           # two decode steps
    assert reserve._chunks["r"] == [256, 100, 256, 88]

    request.num_computed_tokens, request.num_preemptions = 0, 1   # vLLM preempts
    assert reserve.replay_cap(request, 0, 200) == 0          # chunk 256 does not fit: wait
    assert reserve.replay_cap(request, 0, 702) == 256
    run(256)
    assert reserve.replay_cap(request, 256, 446) == 100
    run(100)
    assert reserve.replay_cap(request, 356, 346) == 256
    run(256)
    assert reserve.replay_cap(request, 612, 90) == 88
    run(88)
    assert reserve.replay_cap(request, 700, 2) == 1           # generated tokens: one per step
    assert reserve._chunks["r"] == [256, 100, 256, 88]      # replays are not recorded again
    reserve.forget_finished(SimpleNamespace(finished_req_ids={"r"}))
    assert "r" not in reserve._chunks


def test_growth_reserve_counts_the_draft_slots_of_speculative_decoding():
    """A last verification step holds K draft slots past max_tokens: the reserve counts them,
    so an admitted request is not preempted for them (capped at the model length)."""
    from types import SimpleNamespace

    from vllm_kvevict.integration.core.admission import GrowthReserve

    def need(num_spec_tokens, max_model_len=8192):
        reserve = GrowthReserve()
        request = SimpleNamespace(request_id="r", num_prompt_tokens=700,
                                  sampling_params=SimpleNamespace(max_tokens=64))
        reserve.scheduler = SimpleNamespace(
            requests={"r": request}, num_spec_tokens=num_spec_tokens, max_model_len=max_model_len,
            kv_cache_manager=SimpleNamespace(coordinator=SimpleNamespace(
                single_type_managers=[object()])))
        return reserve.final_need(request)

    assert need(0) == [764]
    assert need(3) == [767]
    assert need(3, max_model_len=765) == [765]
