"""The bookkeeping behind real memory, without a server: the streaming store's ring layout and
the token-eviction ledger that the scheduler and the worker must agree on."""

from __future__ import annotations

import random

import torch

from vllm_kvevict.config import KVPolicyConfig
from vllm_kvevict.integration.streaming_store import StreamingStore, build_step_plan
from vllm_kvevict.integration.token_eviction import (TokenEvictionWorker, allocation_eviction,
                                                     chunk_kept_per_layer)
from vllm_kvevict.policies import build_policy


def visible_before(a: int, sink: int, window: int) -> set[int]:
    """Positions a streaming head may see before a chunk starting at a (the paper's rule)."""
    lw = min(window, a)
    sk = min(sink, a - lw)
    return set(range(sk)) | set(range(a - lw, a))


def test_streaming_store_holds_exactly_the_visible_tokens():
    """Random chunk sizes for three requests: before every step the store's prefix holds
    exactly sink + last-window positions (each token's K is its position, so we can read it)."""
    rng = random.Random(0)
    sink, window, bs = 4, 9, 32
    store = StreamingStore(num_heads=1, head_dim=1, sink=sink, window=window,
                           dtype=torch.float32, slots=3)
    done = [0, 0, 0]
    for _ in range(40):
        q_lens = [rng.choice([1, 1, 2, 5, 13, 30]) for _ in range(3)]
        plan = build_step_plan([0, 1, 2], done, q_lens, sink, window, bs)
        keys = torch.cat([torch.arange(a, a + q, dtype=torch.float32)
                          for a, q in zip(done, q_lens)]).view(-1, 1, 1)
        laid_k, _ = store.lay_out(plan, keys, keys)
        start = 0
        for r, (a, q) in enumerate(zip(done, q_lens)):
            n = int(plan.seq_lens[r])
            row = laid_k[start:start + n].flatten().tolist()
            v = n - q
            assert set(int(x) for x in row[:v]) == visible_before(a, sink, window)
            assert row[v:] == list(range(a, a + q))  # the chunk, in order, at the end
            start += n
        store.commit(plan, keys, keys)
        done = [a + q for a, q in zip(done, q_lens)]


def test_scratch_slots_are_distinct_and_within_rows():
    plan = build_step_plan([0, 1], [500, 3], [1, 70], sink=8, window=16, block_size=32)
    assert plan.scratch_slots.unique().numel() == plan.scratch_slots.numel()
    assert int(plan.seq_lens[0]) == 8 + 16 + 1 and int(plan.seq_lens[1]) == 3 + 70


def simulate_scheduler(policy, prompt_len, chunks, decode, bs):
    """The scheduler's view: blocks held after every step (allocate, run, free the tail)."""
    evicted, computed, held = 0, 0, []
    for c in chunks + [1] * decode:
        need = -(-(computed + c - evicted) // bs)
        held.append(need)
        is_prefill = computed + c <= prompt_len
        if is_prefill:
            evicted += allocation_eviction(policy, c, computed + c == prompt_len)
        computed += c
        held.append(-(-(computed - evicted) // bs))
    return held


def test_worker_and_scheduler_keep_the_same_blocks():
    for name, p in [("snapkv", 0.7), ("pyramidkv", 0.5), ("snapkv", 0.0)]:
        policy = build_policy(KVPolicyConfig(policy=name, sparsity=p, eviction="naive"), 30, 3)
        bs, n = 32, 1000
        chunks = [256, 256, 100, 256, 132]
        expected = simulate_scheduler(policy, n, chunks, 5, bs)
        worker = TokenEvictionWorker(policy, bs)
        blocks: list[int] = []
        next_id, computed, seen = 1, 0, []
        for c in chunks + [1] * 5:
            need = expected[len(seen)]
            while len(blocks) < need:  # vLLM appends the scheduler's new blocks
                blocks.append(next_id)
                next_id += 1
            seen.append(len(blocks))
            plan = worker.plan(["r"], [computed], [c], [n], [list(blocks)])
            # every new token's slot lies inside a block the request owns this step
            assert set((plan.slots // bs).flatten().tolist()) <= set(blocks)
            counts = [len(blocks)]
            worker.finish_step(plan, lambda r: blocks, counts)
            assert counts == [len(blocks)]
            seen.append(len(blocks))
            computed += c
        assert seen == expected, name


def test_kept_counts_follow_the_policy():
    policy = build_policy(KVPolicyConfig(policy="pyramidkv", sparsity=0.7), 30, 3)
    kept = chunk_kept_per_layer(policy, 1024, is_final=False)
    assert kept[0] == max(kept) and kept[-1] == min(kept)
    assert allocation_eviction(policy, 1024, False) == 1024 - kept[0]
    # the mean over layers stays the chunk's capacity (patched, non-final: no window inside)
    assert abs(sum(kept) / len(kept) - round(0.3 * 1024)) <= 16
