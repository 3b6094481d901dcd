"""Decode-time eviction without a server: the schedule, the ledger both processes keep, the
admission peak, the footprint, the reference's cache, and the refusals."""

from __future__ import annotations

import pytest
import torch

from vllm_kvevict.config import KVPolicyConfig, KVPolicyError
from vllm_kvevict.features import decode_eviction_error
from vllm_kvevict.flags import FLAG_OF_FIELD, flag_message
from vllm_kvevict.footprint import kv_footprint
from vllm_kvevict.integration.worker.token_plan import TokenEvictionWorker
from vllm_kvevict.ledger import (LayerGroups, decode_group_budgets, decode_peak, eviction_chunk_len,
                                 group_evictions, peak_slots)
from vllm_kvevict.policies import build_policy


def policy_of(name="snapkv", p=0.5, budget=96, interval=32, obs=16, eviction="naive"):
    cfg = KVPolicyConfig(policy=name, sparsity=p, eviction=eviction, decode_budget=budget,
                         decode_interval=interval, obs_window=obs)
    return build_policy(cfg, 30, 3)


def test_compressions_fall_every_interval_after_the_prompt():
    cfg = policy_of().config
    n = 300
    ends = [e for e in range(n - 5, n + 200) if cfg.is_decode_compression(e, n)]
    assert ends == [n + 32, n + 64, n + 96, n + 128, n + 160, n + 192]
    assert not KVPolicyConfig(policy="snapkv").is_decode_compression(n + 128, n)
    assert cfg.decode_obs_rows == 16
    # k never exceeds the interval or the budget
    assert policy_of(budget=8, interval=32, obs=16).config.decode_obs_rows == 8
    assert policy_of(budget=96, interval=4, obs=16).config.decode_obs_rows == 4


def test_pyramid_spreads_the_decode_budget_over_the_layers():
    snap, pyr = policy_of(), policy_of("pyramidkv")
    assert {snap.decode_budget(l) for l in range(30)} == {96}
    budgets = [pyr.decode_budget(l) for l in range(30)]
    assert budgets == sorted(budgets, reverse=True) and budgets[-1] >= 16
    assert abs(sum(budgets) / 30 - 96) <= 16
    assert snap.decode_keep(0, 96) is None
    keep = snap.decode_keep(0, 130)
    assert (keep.chunk_len, keep.window, keep.selected) == (130, 16, 80)


def simulate(policy, n, chunks, decode, bs, groups):
    """The scheduler's blocks per group after every step, from the ledger's rules written out
    here: a chunk frees c - max kept; a compression cuts the group to min(length, budget)."""
    budgets = decode_group_budgets(policy, groups)
    evicted, computed, held = [0] * groups.num_groups, 0, []
    for c in chunks + [1] * decode:
        held.append([-(-(computed + c - e) // bs) for e in evicted])
        end = computed + c
        if policy.config.is_eviction_point(end, n):
            freed = group_evictions(policy, eviction_chunk_len(policy.config, computed, c),
                                    end == n, groups)
            evicted = [e + f for e, f in zip(evicted, freed)]
        elif policy.config.is_decode_compression(end, n):
            evicted = [e + max(end - e - b, 0) for e, b in zip(evicted, budgets)]
        computed = end
        held.append([-(-(computed - e) // bs) for e in evicted])
    return held


@pytest.mark.parametrize("name, tiers", [("snapkv", 1), ("pyramidkv", 30), ("pyramidkv", 3)])
def test_worker_drops_the_blocks_the_scheduler_frees(name, tiers):
    policy = policy_of(name)
    groups = LayerGroups.tiers(30, tiers)
    G, bs, n, decode = groups.num_groups, 16, 300, 100
    chunks = [128, 128, 44]
    expected = simulate(policy, n, chunks, decode, bs, groups)
    worker = TokenEvictionWorker(policy, bs, groups)
    blocks: list[list[int]] = [[] for _ in range(G)]
    next_id, computed, seen, jobs_at = 1, 0, [], []
    for c in chunks + [1] * decode:
        for g in range(G):
            while len(blocks[g]) < expected[len(seen)][g]:
                blocks[g].append(next_id)
                next_id += 1
        seen.append([len(b) for b in blocks])
        plan = worker.plan(["r"], [computed], [c], [n], [[list(b) for b in blocks]])
        if plan.decode.jobs:
            jobs_at.append(computed + c - n)
            # every layer above its budget compresses, from its whole physical length
            for layer, keep in enumerate(plan.decode.jobs[0].keep):
                length = int(plan.seq_lens[layer, 0])
                assert (keep is None) == (length <= policy.decode_budget(layer))
                assert keep is None or keep.chunk_len == length
        # the last k decode steps before each compression keep their queries, in order
        for _, token, slot in plan.decode.observe:
            assert token == 0 and slot == (computed + c - n - 1) % 32 - 16
        for layer in range(30):
            own = blocks[groups.of_layer[layer]]
            assert set((plan.slots[layer] // bs).tolist()) <= set(own), (layer, c)
        counts = [[len(b)] for b in blocks]
        worker.finish_step(plan, lambda r: blocks, counts)
        seen.append([len(b) for b in blocks])
        computed += c
    assert jobs_at == [32, 64, 96]
    assert seen[1::2] == expected[1::2]
    # flat: after the first compression no group holds more than its budget + an interval
    budgets = decode_group_budgets(policy, groups)
    assert all(h * bs <= b + 32 + bs for h, b in zip(seen[-1], budgets))


@pytest.mark.parametrize("kept, budget, interval", [(150, 96, 32), (40, 96, 32), (96, 96, 8),
                                                    (10, 200, 64), (300, 100, 1)])
def test_decode_peak_is_the_simulated_maximum(kept, budget, interval):
    for generated in (0, 1, 31, 32, 33, 100, 257, 1000):
        length, peak = kept, kept
        for j in range(1, generated + 1):
            length += 1
            peak = max(peak, length)
            if j % interval == 0:
                length = min(length, budget)
        assert decode_peak(kept, generated, budget, interval) == peak, generated
    assert decode_peak(kept, 100, None, interval) == kept + 100


def test_admission_peak_stays_flat_in_the_generated_length():
    policy = policy_of()
    groups = LayerGroups.single(30)

    def peak(num_tokens):
        return peak_slots(policy, 300, num_tokens, 128,
                          lambda c, final: group_evictions(policy, c, final, groups),
                          decode_group_budgets(policy, groups))[0]
    kept = sum(policy.chunk_keep(0, c, c == 44).kept for c in (128, 128, 44))  # 150
    assert peak(1300) == peak(5300) == peak(300 + 32 * 50) == max(peak(300), kept + 32)
    assert peak(310) == max(peak(300), kept + 10)
    without = policy_of(budget=None)
    assert peak_slots(without, 300, 5300, 128,
                      lambda c, final: group_evictions(without, c, final, groups))[0] > 5000


def test_footprint_counts_the_decode_compressions():
    """The footprint's decode term equals a step-by-step count of the layer's length."""
    policy = policy_of()
    n, bounds, m = 300, [128, 256, 300], 150
    result = kv_footprint(policy, n, bounds, m)
    per_layer = 0
    for layer in range(30):
        past, a, total = 0, 0, 0
        for i, b in enumerate(bounds):
            c = b - a
            total += c * (c + 1) // 2 + past * c
            past += policy.chunk_keep(layer, c, b == n).kept
            a = b
        for j in range(1, m + 1):
            past += 1
            total += past
            if j % 32 == 0:
                past = min(past, policy.decode_budget(layer))
        per_layer += total
    full = (n + m) * (n + m + 1) // 2
    assert result.footprint == pytest.approx(per_layer / 30 / full, rel=1e-12)
    assert result.footprint < kv_footprint(policy_of(budget=None), n, bounds, m).footprint


def test_reference_cache_stays_within_the_budget(hf_model):
    from vllm_kvevict.reference import ReferenceRunner

    policy = policy_of(budget=64, interval=16, obs=8)
    prompt = [100 + (7 * i) % 5000 for i in range(200)]
    out = ReferenceRunner(hf_model, policy).generate(prompt, 41, 128)
    lengths = out.cache.lengths()
    # 40 decode steps: compressions after 16 and 32, then 8 more tokens
    assert int(lengths.max()) == 64 + 8 and int(lengths.min()) == 64 + 8
    # the last k = 8 decode tokens before each compression (and after) are kept
    for head in range(3):
        kept = out.cache.kept_positions(0, head)
        assert kept[-16:] == list(range(200 + 40 - 16, 200 + 40))


def test_refusals_name_the_flag_and_the_valid_values():
    with pytest.raises(KVPolicyError) as exc:
        KVPolicyConfig(policy="prulong", decode_budget=128)
    assert flag_message(exc.value).startswith("--kv-decode-budget only applies to snapkv, "
                                              "pyramidkv")
    with pytest.raises(KVPolicyError) as exc:
        KVPolicyConfig(policy="snapkv", decode_budget=0)
    assert flag_message(exc.value) == "--kv-decode-budget must be an integer >= 1, got 0"
    with pytest.raises(KVPolicyError) as exc:
        KVPolicyConfig(policy="snapkv", decode_budget=64, decode_interval=0)
    assert flag_message(exc.value).startswith("--kv-decode-interval must be an integer >= 1")
    assert FLAG_OF_FIELD["decode_interval"] == "--kv-decode-interval"
    cfg = KVPolicyConfig(policy="snapkv", decode_budget=64)
    assert decode_eviction_error(cfg, None, "auto") is None
    assert "--speculative-config" in decode_eviction_error(cfg, "ngram", "auto")
    assert "valid with --kv-decode-budget: auto" in decode_eviction_error(cfg, None, "fp8")
    assert decode_eviction_error(KVPolicyConfig(policy="snapkv"), "ngram", "fp8") is None


def test_per_request_budget_and_interval():
    from vllm_kvevict.overrides import check_vllm_xargs, effective_config

    good = {"kv_decode_budget": 40, "kv_decode_interval": 24}
    assert check_vllm_xargs(good, "snapkv", 8192, decode_eviction=True) is None
    off = check_vllm_xargs(good, "snapkv", 8192)
    assert off.startswith("vllm_xargs key 'kv_decode_budget' needs a server started with "
                          "--kv-decode-budget")
    assert "only applies to token-eviction policies" in check_vllm_xargs(
        good, "prulong", 8192, decode_eviction=True)
    for bad in (0, -3, 2.5, True, "64"):
        message = check_vllm_xargs({"kv_decode_interval": bad}, "pyramidkv", 8192,
                                   decode_eviction=True)
        assert message.startswith(f"vllm_xargs['kv_decode_interval'] = {bad!r} is invalid: "
                                  "expected an integer >= 1"), message
    served = KVPolicyConfig(policy="snapkv", decode_budget=96)
    cfg, used = effective_config(served, good)
    assert (cfg.decode_budget, cfg.decode_interval, used) == (40, 24, good)
    # a server without decode-time eviction ignores them (the API server refused them already)
    assert effective_config(KVPolicyConfig(policy="snapkv"), good)[1] == {}


def test_a_teacher_forced_tail_stops_at_each_compression_point():
    """vLLM prefills a teacher-forced tail (decode tokens for the policy) in one step unless
    capped: under decode-time eviction a step ends at the next compression point, where the
    reference compresses between its forced decode steps."""
    from vllm_kvevict.ledger import cap_step_in_eviction_chunk

    policy, n = policy_of(interval=4), 300
    assert cap_step_in_eviction_chunk(policy, n, n, 10) == 4
    assert cap_step_in_eviction_chunk(policy, n, n + 4, 6) == 4
    assert cap_step_in_eviction_chunk(policy, n, n + 9, 1) == 1
    assert cap_step_in_eviction_chunk(policy, n, n + 6, 5) == 2
    assert cap_step_in_eviction_chunk(policy_of(budget=None), n, n, 10) == 10
    # the worker keeps the step's last k = 4 queries, token by token, and compresses after it
    worker = TokenEvictionWorker(policy, 16, LayerGroups.single(30))
    worker.plan(["r"], [0], [n], [n], [[list(range(1, 20))]])  # the prompt, one chunk
    plan = worker.plan(["r"], [n], [4], [n], [[list(range(1, 20))]])
    assert [(t, slot) for _, t, slot in plan.decode.observe] == [(0, 0), (1, 1), (2, 2), (3, 3)]
    assert [job.end for job in plan.decode.jobs] == [n + 4]


def test_continuation_report_pairs_documents_with_full(tmp_path):
    """The quality report: per setting the NLL difference from full attention, paired by
    document, with a bootstrap interval that contains it; a PNG by position."""
    import json
    from types import SimpleNamespace

    from vllm_kvevict.evaluation.continuation import report

    rng = torch.Generator().manual_seed(0)
    lines = []
    for d in range(12):
        base = (-torch.rand(60, generator=rng) * 3).tolist()
        worse = [lp - 0.1 - 0.002 * i for i, lp in enumerate(base)]  # loss grows along it
        for setting, lps, n in (("full", base, 0), ("snapkv:0.7:naive:d64e16", worse, 3)):
            lines.append(json.dumps({"setting": setting, "document": f"doc{d}", "logprobs": lps,
                                     "decode_compressions": n, "kv_bytes_peak": 10 + 90 * (not n),
                                     "full_kv_bytes_peak": 100, "footprint": 0.5}))
    (tmp_path / "results.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "command.txt").write_text("python -m vllm_kvevict.evaluation.continuation\n")
    report(SimpleNamespace(out_dir=tmp_path, buckets=3))
    table = (tmp_path / "table.md").read_text()
    row = next(line for line in table.splitlines() if line.startswith("| snapkv"))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[1] == "12" and cells[3].startswith("+0.159 [+0.159, +0.159]"), row
    assert cells[4] == "3" and cells[5] == "0.10"
    assert "| full | 12 |" in table and "+0.000 [+0.000, +0.000]" in table
    assert (tmp_path / "nll_by_position.png").stat().st_size > 1000


def test_worst_case_is_bounded_only_with_a_decode_budget():
    """What vLLM's start-up check asks to fit ("one request of max_model_len"): with a decode
    budget the largest peak over every prompt length, far below max_model_len; without, a
    short prompt's generation is never evicted, so max_model_len itself."""
    from vllm_kvevict.ledger import worst_case_slots

    snap = build_policy(KVPolicyConfig(policy="snapkv", sparsity=0.7, decode_budget=256), 30, 3)
    one = LayerGroups.single(30)
    worst = worst_case_slots(snap, 8192, 1024, one)[0]
    # the peak is a prompt's last chunk on top of what earlier chunks kept, plus its question
    assert worst == max(peak_slots(snap, n, 8192, 1024,
                                   lambda c, f: group_evictions(snap, c, f, one),
                                   decode_group_budgets(snap, one))[0]
                        for n in range(1, 8193))
    assert 3000 < worst < 3300
    assert worst_case_slots(policy_of(budget=None), 8192, 1024, one) == [8192]
    pyr = policy_of("pyramidkv", p=0.7, budget=256)
    per_layer = worst_case_slots(pyr, 8192, 1024, LayerGroups.tiers(30, 30))
    assert per_layer == sorted(per_layer, reverse=True) and per_layer[0] < 8192
