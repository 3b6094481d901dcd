"""Prefix caching for naive token eviction (issue 46; integration/kv_cache/prefix_cache.py):
the start-up rules, the three places that count a hit's evicted slots (engine-core ledger,
worker ledger, the group's spec), the manager on vLLM's own block pool and requests, and
served: a cold request, a hit at a chunk boundary and a shorter shared prefix, each equal to
the reference at the same chunk boundaries."""

from __future__ import annotations

from types import SimpleNamespace

import openai
import pytest
import torch

from vllm_kvevict.config import KVPolicyConfig
from vllm_kvevict.features import prefix_caching_error, token_prefix_error
from vllm_kvevict.ledger import LayerGroups, group_evictions
from vllm_kvevict.policies import build_policy

E = 64  # the unit tests' canonical chunk
BS = 16


def naive(policy: str = "snapkv", **extra) -> KVPolicyConfig:
    return KVPolicyConfig.from_dict({"policy": policy, "sparsity": 0.5, "eviction": "naive",
                                     "obs_window": 8, "eviction_chunk": E, **extra})


# -- start-up ------------------------------------------------------------------------------

def test_prefix_caching_is_served_for_naive_token_eviction_only():
    assert prefix_caching_error(naive(), True) is None
    assert prefix_caching_error(naive("pyramidkv"), True) is None
    patched = prefix_caching_error(naive(eviction="patched"), True)
    assert patched.startswith("--enable-prefix-caching is not supported with --kv-policy "
                              "snapkv --kv-eviction patched yet (each chunk is scored")
    assert "--no-enable-prefix-caching" in patched
    decode = prefix_caching_error(naive(decode_budget=64), True)
    assert "--kv-decode-budget" in decode
    assert "--kv-attention-backend flex" in prefix_caching_error(
        naive(attention_backend="flex"), True)
    # a head mask's full heads with snapkv (pyramidkv's unequal layers: not built)
    hybrid = KVPolicyConfig.from_dict({"policy": "prulong", "token_policy": "snapkv",
                                       "eviction": "naive"})
    assert hybrid.caches_token_prefixes and prefix_caching_error(hybrid, True) is None
    pyramid = prefix_caching_error(hybrid.replace(token_policy="pyramidkv"), True)
    assert "--kv-token-policy pyramidkv" in pyramid and "not built" in pyramid
    ok = dict(prefix_caching=True, sizes={"tensor_parallel_size": 2}, speculative=None,
              lora=False, chunk=E, block_size=BS)
    assert "--tensor-parallel-size 2" in token_prefix_error(hybrid, **ok)
    # vLLM's default (not asked for) is switched off, not refused
    assert prefix_caching_error(naive(eviction="patched"), None) is None


def test_naive_prefix_caching_refuses_what_it_was_not_tested_with():
    ok = dict(prefix_caching=True, sizes={}, speculative=None, lora=False, chunk=E,
              block_size=BS)
    assert token_prefix_error(naive(), **ok) is None
    assert token_prefix_error(naive(), **{**ok, "prefix_caching": False}) is None
    assert token_prefix_error(naive(), **{**ok, "sizes": {"tensor_parallel_size": 2}}) is None
    assert token_prefix_error(naive(), **{**ok, "sizes": {"data_parallel_size": 2}}) is None
    pp = token_prefix_error(naive(), **{**ok, "sizes": {"pipeline_parallel_size": 2}})
    assert "--pipeline-parallel-size 2" in pp and "--no-enable-prefix-caching" in pp
    assert "speculative" in token_prefix_error(naive(), **{**ok, "speculative": "ngram"})
    assert token_prefix_error(naive(), **{**ok, "lora": True}) is None
    odd = token_prefix_error(naive(), **{**ok, "chunk": 100})
    assert "multiple of --block-size 16" in odd and "100" in odd


def test_patched_reuse_is_a_declared_opt_in():
    """Patched eviction caches prefixes only under --kv-prefix-reuse across-questions, which
    needs --enable-prefix-caching and means nothing for naive eviction or a head mask."""
    from vllm_kvevict.config import KVPolicyError
    from vllm_kvevict.flags import FLAGS

    across = naive(eviction="patched", prefix_reuse="across-questions")
    assert across.caches_token_prefixes and across.reuses_across_questions
    assert prefix_caching_error(across, True) is None
    refused = prefix_caching_error(naive(eviction="patched"), True)
    assert "--kv-prefix-reuse across-questions reuses it" in refused
    needs = prefix_caching_error(across, None)
    assert needs.startswith("--kv-prefix-reuse across-questions needs --enable-prefix-caching")
    assert FLAGS["--kv-prefix-reuse"][0] == "prefix_reuse"
    for bad, field in (({"prefix_reuse": "always"}, "exact, across-questions"),
                       ({"prefix_reuse": "across-questions", "eviction": "naive"}, "naive"),
                       ({"policy": "prulong", "prefix_reuse": "across-questions"}, "prulong")):
        with pytest.raises(KVPolicyError, match=field):
            KVPolicyConfig.from_dict({"policy": "snapkv", **bad})


def test_the_ledger_tells_which_reused_chunks_another_question_selected():
    """--kv-prefix-reuse across-questions on vLLM's BlockPool and Request: A's chunks are
    registered with A's question; B (same first 150 tokens, another question) reuses 2 chunks
    both selected under A's; C (A's prompt again) reuses 2 under its own; D reuses B's row
    at 192 (chunks 1-2 under A's question, 3 under B's): 3 reused, all another question's."""
    from vllm.utils.math_utils import cdiv
    from vllm.v1.core.block_pool import BlockPool

    from vllm_kvevict.integration.core.kv_cache_manager import bind
    from vllm_kvevict.integration.core.token_ledger import TokenEvictionLedger
    from vllm_kvevict.integration.kv_cache.prefix_cache import TokenPrefixManager, TokenPrefixSpec

    cfg = naive(eviction="patched", prefix_reuse="across-questions")
    policy = build_policy(cfg, 2, 1)
    kept = E - group_evictions(policy, E, False, LayerGroups.single(2))[0]
    spec = TokenPrefixSpec(block_size=BS, num_kv_heads=1, head_size=64, dtype=torch.float32,
                           prefix_chunk=E, chunk_kept=kept)
    pool = BlockPool(num_gpu_blocks=64, enable_caching=True, hash_block_size=BS)
    manager = TokenPrefixManager(spec, block_pool=pool, enable_caching=True,
                                 kv_cache_group_id=0, scheduler_block_size=BS)
    ledger = TokenEvictionLedger(policy, E)
    bind([manager], ledger)  # (as our scheduler binds its managers)
    ledger.scheduler = SimpleNamespace(
        requests={}, max_model_len=4096,
        kv_cache_manager=SimpleNamespace(coordinator=SimpleNamespace(
            single_type_managers=[manager])))

    def run(name, tokens, hit, chunks):
        """First allocation with a hit at `hit`, then prefill chunks ending at `chunks`."""
        req = vllm_request(name, tokens)
        ledger.scheduler.requests[name] = req
        ledger.on_prefix_hit(name, hit)
        manager.req_to_blocks[name] = pool.get_new_blocks(cdiv(spec.physical(hit), BS))
        for end in chunks:
            row = manager.req_to_blocks[name]
            row += pool.get_new_blocks(cdiv(end, BS) - len(row))
            req.num_computed_tokens = end
            ledger.pending[name] = (E, False, policy, end)
            ledger.before_schedule()
        return ledger.reuse_of(name)

    base = list(range(1000, 1300))
    a = base[:250]
    b = base[:150] + list(range(5000, 5100))
    assert run("A", a, 0, (64, 128, 192)) == (0, 0)
    assert run("B", b, 128, (192,)) == (2, 2)
    assert run("C", a, 128, ()) == (2, 0)
    assert run("D", b[:200] + [9] * 50, 192, ()) == (3, 3)
    assert ledger.chunk_questions["D"] == list(ledger.chunk_questions["B"])
    ledger.forget("D")
    assert ledger.reuse_of("D") is None and "D" not in ledger.chunk_questions


# -- the counts of a hit ---------------------------------------------------------------------

@pytest.mark.parametrize("policy,tiers", [("snapkv", 1), ("pyramidkv", 3)])
def test_a_hit_starts_both_ledgers_and_the_spec_at_the_same_rows(policy, tiers):
    """Engine core (`on_prefix_hit`), worker (`_new_ledger`) and the group's spec
    (`physical`, what the manager's lookup and copy-on-write use) agree at every boundary,
    and each equals what chunk-by-chunk compression leaves."""
    from vllm_kvevict.integration.core.token_ledger import TokenEvictionLedger
    from vllm_kvevict.integration.kv_cache.prefix_cache import TokenPrefixSpec
    from vllm_kvevict.integration.worker.token_plan import TokenEvictionWorker

    layers = 6
    policy = build_policy(naive(policy, tiers=tiers), layers, 2)
    groups = LayerGroups.tiers(layers, tiers)
    ledger = TokenEvictionLedger(policy, E, groups)
    worker = TokenEvictionWorker(policy, BS, groups)
    worker.reuses_prefixes = True
    freed = group_evictions(policy, E, False, groups)
    kept_layer = [policy.chunk_keep(l, E, False).kept for l in range(layers)]
    for k in range(1, 5):
        ledger.on_prefix_hit("r", k * E)
        led = worker._new_ledger(k * E)
        assert ledger.allocation_evicted["r"] == led.allocation_evicted == [k * f for f in freed]
        assert led.evicted == [k * (E - x) for x in kept_layer]
        for g in range(groups.num_groups):
            spec = TokenPrefixSpec(block_size=BS, num_kv_heads=2, head_size=64,
                                   dtype=torch.float32, tier=g, prefix_chunk=E,
                                   chunk_kept=E - freed[g])
            assert spec.physical(k * E) == k * E - ledger.allocation_evicted["r"][g]
            assert spec.physical(k * E) == max(k * kept_layer[l] for l in groups.layers(g))
    ledger.on_prefix_hit("r", 0)  # a first allocation without a hit: nothing evicted
    assert "r" not in ledger.allocation_evicted
    worker.reuses_prefixes = False  # without prefix caching a request starts empty
    assert worker._new_ledger(2 * E).evicted == [0] * layers


# -- the manager on vLLM's block pool --------------------------------------------------------

def vllm_request(request_id: str, tokens: list[int]):
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    return Request(request_id, tokens, SamplingParams(max_tokens=4), None,
                   block_hasher=get_request_block_hasher(BS, sha256))


def test_manager_hits_the_last_cached_boundary_and_copies_the_partial_tail():
    """A row registered at boundaries 64 and 128 (vLLM's real BlockPool, Request and block
    hashes): a request sharing 150 tokens hits 128, one sharing 100 hits 64, another prompt
    nothing; the hit's full blocks are shared, its partial tail goes through vLLM's
    copy-on-write, and the ledger starts from the boundary. Evicted blocks end the hits."""
    from vllm.utils.math_utils import cdiv
    from vllm.v1.core.block_pool import BlockPool

    from vllm_kvevict.integration.core.kv_cache_manager import bind, rule_of
    from vllm_kvevict.integration.core.token_ledger import TokenEvictionLedger
    from vllm_kvevict.integration.kv_cache.prefix_cache import (TokenPrefixManager, TokenPrefixSpec,
                                                                register_boundary)

    policy = build_policy(naive(sparsity=0.3), 2, 1)
    kept = E - group_evictions(policy, E, False, LayerGroups.single(2))[0]
    assert kept % BS, "the test needs a partial tail block"
    spec = TokenPrefixSpec(block_size=BS, num_kv_heads=1, head_size=64, dtype=torch.float32,
                           prefix_chunk=E, chunk_kept=kept)
    pool = BlockPool(num_gpu_blocks=40, enable_caching=True, hash_block_size=BS)
    manager = TokenPrefixManager(spec, block_pool=pool, enable_caching=True,
                                 kv_cache_group_id=0, scheduler_block_size=BS)
    ledger = TokenEvictionLedger(policy, E)
    bind([manager], ledger)
    prompt = list(range(1000, 1200))
    cold = vllm_request("cold", prompt)
    row = pool.get_new_blocks(cdiv(spec.physical(128), BS))
    manager.req_to_blocks["cold"] = row
    assert register_boundary(manager, cold, 64) == cdiv(kept, BS)
    assert register_boundary(manager, cold, 128) == len(row)

    def lookup(tokens, max_length):
        req = vllm_request("x", tokens)
        return manager.find_longest_cache_hit(req.block_hashes, max_length, [0], pool, spec,
                                              False, BS)

    (blocks,), hit = lookup(prompt[:150] + [7] * 50, 199)
    assert hit == 128 and blocks == row
    (blocks,), hit = lookup(prompt[:100] + [7] * 100, 199)
    assert hit == 64 and blocks == row[:cdiv(kept, BS)]
    assert lookup([7] + prompt[1:], 199)[1] == 0
    assert lookup(prompt, 100)[1] == 64  # never past max_length

    # the hit's allocation, with vLLM's logical counts through the plugin's wraps of the
    # manager (as served): full blocks shared, the partial tail copied, counts physical
    from vllm_kvevict.integration.plugins import contract, registration

    for wrap in contract.WRAPS:
        if "SingleTypeKVCacheManager." in wrap.target and wrap.target not in registration.applied:
            registration._apply(wrap)
    (blocks,), hit = lookup(prompt, 199)
    phys = spec.physical(hit)
    need = manager.get_num_blocks_to_allocate("hit", hit + 64, blocks, hit, hit, hit + 64)
    assert rule_of(manager) is ledger and manager.ledger is ledger
    assert ledger.allocation_evicted["hit"] == [hit - phys]
    assert need == cdiv(phys + 64, BS) - len(blocks) + 1  # + the copy of the tail
    manager.add_local_computed_blocks("hit", blocks, hit, 0)
    manager.allocate_new_blocks("hit", hit + 64, hit + 64)
    own = manager.req_to_blocks["hit"]
    tail = phys // BS
    assert own[:tail] == row[:tail] and all(b.ref_cnt == 2 for b in row[:tail])
    (copy,) = manager.take_pending_cow_copies()
    assert copy[0] is row[tail] and copy[1] is own[tail] and own[tail] is not row[tail]
    manager.cache_blocks(vllm_request("hit", prompt), phys + 64, replay_boundaries=[])
    assert all(b.block_hash is None for b in own[tail:])  # no logical hashes on our rows

    # both requests end; their blocks stay cached until the pool needs them
    manager.free("hit")
    pool.free_blocks([copy[0], copy[1]])  # (the copy's retained ends, as vLLM's scheduler)
    manager.free("cold")
    assert lookup(prompt, 199)[1] == 128
    pool.get_new_blocks(pool.get_num_free_blocks())
    assert lookup(prompt, 199)[1] == 0


# -- served ----------------------------------------------------------------------------------

CHUNK = 256  # --max-num-batched-tokens: the canonical eviction chunk the server pins


def served_cases():
    from test_policies_vllm import CASES

    cases = {case: CASES[case][0] for case in ("snapkv-naive-0.5", "pyramidkv-naive-0.5-tiers3")}
    # a head mask with token eviction on its full heads: its streaming heads' groups too
    hybrid = CASES["hybrid-prulong-0.5-snapkv-patched-0.5"][0]
    cases["hybrid-prulong-0.5-snapkv-naive-0.5"] = {**hybrid, "eviction": "naive"}
    return cases


@pytest.mark.server
@pytest.mark.parametrize("case", [pytest.param("snapkv-naive-0.5", marks=pytest.mark.slow),
                                  "pyramidkv-naive-0.5-tiers3",
                                  pytest.param("hybrid-prulong-0.5-snapkv-naive-0.5",
                                               marks=pytest.mark.slow)])
def test_prefix_hits_match_the_reference(case, bundled_model_dir, tokenizer, hf_model):
    """`--enable-prefix-caching` with naive token eviction: a prompt cold, the same prompt
    again (a hit at its last chunk boundary, 1024 of 1100 tokens) and a prompt sharing its
    first 600 tokens (a hit at 512): greedy tokens and top-20 log-probs equal the reference
    at the same chunks, and the hits are what kv_stats reports. (pyramidkv, 3 tiers: three
    KV-cache groups, vLLM's hybrid coordinator.)"""
    from conftest import start_server
    from test_policies_vllm import (LOGPROB_TOL, flags, reference, served_top_logprobs,
                                    source_prompts)

    policy = served_cases()[case]
    server = start_server(bundled_model_dir, [*flags(policy, CHUNK), "--enable-prefix-caching"])
    params = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused").get(
        "/kv_stats", cast_to=dict)["params"]
    assert params["prefix_caching"] is True and params["eviction_chunk"] == CHUNK, params
    prompt, other = source_prompts(tokenizer, (1100, 900))
    shared = prompt[:600] + other[600:]
    runs = [(prompt, 0), (prompt, 1024), (shared, 512)]
    results = [served_top_logprobs(server.base_url, p) for p, _ in runs]
    for (p, cached), (text, top, stats) in zip(runs, results):
        assert stats["cached_tokens"] == cached, (case, len(p), stats)
        ref = reference(hf_model, bundled_model_dir, policy, p, CHUNK)
        assert text == tokenizer.decode(ref.token_ids), (case, len(p), cached)
        for token, lp in top.items():
            assert abs(lp - float(ref.first_token_logprobs[token])) < LOGPROB_TOL, (case, cached)


@pytest.mark.server
@pytest.mark.slow  # CI's budget (76 s on CI; LoRA's prefix hits under a head mask: test_compat)
def test_prefix_hits_with_a_lora_adapter(bundled_model_dir, tokenizer, hf_model, lora_adapter,
                                         lora_model):
    """Naive snapkv with `--enable-prefix-caching --enable-lora`: vLLM's block hashes, and so
    the boundary keys, name the adapter and the salt. A prompt with the adapter cold, then
    again (a hit at 512), then without it (cold: the adapter's rows are not the base model's),
    then again (a hit), then with the adapter under a `cache_salt` (cold: another tenant's
    adapter rows), then again (a hit): each equals the reference of its model (the adapter
    merged, or not)."""
    from conftest import LORA_NAME, LORA_RANK, SERVED_NAME, start_server
    from test_policies_vllm import NEW_TOKENS, flags, reference, source_prompts

    policy = served_cases()["snapkv-naive-0.5"]
    server = start_server(bundled_model_dir, [
        *flags(policy, CHUNK), "--enable-prefix-caching", "--enable-lora", "--max-lora-rank",
        str(LORA_RANK), "--lora-modules", f"{LORA_NAME}={lora_adapter[0]}"])
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")
    (prompt,) = source_prompts(tokenizer, (700,))
    refs = {name: reference(model, bundled_model_dir, policy, prompt, CHUNK).token_ids
            for name, model in ((LORA_NAME, lora_model), (SERVED_NAME, hf_model))}
    assert refs[LORA_NAME] != refs[SERVED_NAME]  # (the adapter changes the answer)
    for name, cached, salt in ((LORA_NAME, 0, None), (LORA_NAME, 512, None),
                               (SERVED_NAME, 0, None), (SERVED_NAME, 512, None),
                               (LORA_NAME, 0, "tenant-b"), (LORA_NAME, 512, "tenant-b")):
        extra = {"return_token_ids": True, **({"cache_salt": salt} if salt else {})}
        r = client.completions.create(model=name, prompt=prompt, max_tokens=NEW_TOKENS,
                                      temperature=0, extra_body=extra)
        assert r.model_extra["kv_stats"]["cached_tokens"] == cached, (name, cached, salt)
        assert r.choices[0].model_extra["token_ids"] == refs[name], (name, cached, salt)


@pytest.mark.server
@pytest.mark.slow  # CI's budget: the served path is the naive one's (CI's tiers3 case) plus
# the questions' bookkeeping, which the ledger test above checks on vLLM's pool in CI
@pytest.mark.parametrize("case", ["snapkv-patched-0.5", "pyramidkv-patched-0.7",
                                  "hybrid-prulong-0.5-snapkv-patched-0.5"])
def test_patched_reuse_across_questions_matches_the_reference(case, bundled_model_dir,
                                                              tokenizer, hf_model):
    """`--kv-eviction patched --enable-prefix-caching --kv-prefix-reuse across-questions`:
    A cold (1100 tokens); B shares A's first 900 tokens and asks another question (a hit at
    768: chunks 1-3 selected under A's question); A again (a hit at 1024, every chunk under
    its own question: the plain reference); D shares B's first 1100 (a hit at 1024 on B's row:
    chunks 1-3 under A's question, 4 under B's). Each equals the reference given the question
    each reused chunk was selected under, and kv_stats declares the reuse."""
    from conftest import start_server
    from test_policies_vllm import (CASES, LOGPROB_TOL, NEW_TOKENS, flags, served_top_logprobs,
                                    source_prompts)

    from vllm_kvevict.masks import resolve_full_heads
    from vllm_kvevict.reference import ReferenceRunner

    policy = {**CASES[case][0], "prefix_reuse": "across-questions"}
    server = start_server(bundled_model_dir, [*flags(policy, CHUNK), "--enable-prefix-caching"])
    params = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused").get(
        "/kv_stats", cast_to=dict)["params"]
    assert params["prefix_caching"] is True and params["prefix_reuse"] == "across-questions"
    doc, other, third = source_prompts(tokenizer, (1100, 1200, 1300))
    a = doc
    b = doc[:900] + other[900:1150]
    d = b[:1100] + third[1100:1200]
    k = KVPolicyConfig.from_dict(policy).obs_window
    qa, qb = a[-k:], b[-k:]
    runs = [(a, 0, {}, (0, 0)),
            (b, 768, {256: qa, 512: qa, 768: qa}, (3, 3)),
            (a, 1024, {}, (4, 0)),
            (d, 1024, {256: qa, 512: qa, 768: qa, 1024: qb}, (4, 4))]
    cfg = KVPolicyConfig.from_dict(policy)
    full_heads = (resolve_full_heads(cfg, str(bundled_model_dir), 30, 3)[0]
                  if cfg.is_hybrid else None)
    runner = ReferenceRunner(hf_model, build_policy(cfg, 30, 3, full_heads=full_heads))
    for prompt, cached, questions, (reused, other_q) in runs:
        text, top, stats = served_top_logprobs(server.base_url, prompt)
        assert (stats["cached_tokens"], stats["reused_chunks"],
                stats["reused_chunks_other_question"]) == (cached, reused, other_q), stats
        ref = runner.generate(prompt, NEW_TOKENS, CHUNK, chunk_questions=questions)
        assert text == tokenizer.decode(ref.token_ids), (len(prompt), cached)
        for token, lp in top.items():
            assert abs(lp - float(ref.first_token_logprobs[token])) < LOGPROB_TOL, cached
    # the test tells the modes apart: B under its own question alone is another distribution
    own = torch.log_softmax(runner.prefill(b, CHUNK).logits[-1], dim=-1)
    reused = runner.prefill(b, CHUNK, chunk_questions=runs[1][2]).logits[-1]
    assert float((own - torch.log_softmax(reused, dim=-1)).abs().max()) > 10 * LOGPROB_TOL


@pytest.mark.parametrize("name,tiers", [("snapkv", 1), ("pyramidkv", 3)])
def test_vllm_groups_and_coordinator_serve_our_rows(name, tiers):
    """vLLM's own grouping keeps each tier's chunk and kept count, builds our manager per
    group, and its coordinator (unitary for one group, hybrid for tiers) finds the rows
    registered at a boundary: each group's own number of blocks."""
    import importlib

    from vllm.config import VllmConfig
    from vllm.utils.math_utils import cdiv
    from vllm.v1.core.kv_cache_coordinator import get_kv_cache_coordinator
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from vllm_kvevict.integration.kv_cache import prefix_cache
    from vllm_kvevict.integration.kv_cache.specs import layer_groups, tier_specs
    from vllm_kvevict.integration.plugins.versions import KV_CACHE_PLANNING

    planning = importlib.import_module(KV_CACHE_PLANNING)
    prefix_cache.register_manager()
    layers, chunk = 6, 4 * BS
    policy = build_policy(naive(name, sparsity=0.7, tiers=tiers, eviction_chunk=chunk), layers,
                          1)
    specs = {f"model.layers.{i}.self_attn.attn": FullAttentionSpec(
        block_size=BS, num_kv_heads=1, head_size=64, dtype=torch.float32) for i in range(layers)}
    index = {name: i for i, name in enumerate(specs)}
    freed = group_evictions(policy, chunk, False, LayerGroups.tiers(layers, tiers))
    assert all(0 < f < chunk for f in freed)
    vllm_config = VllmConfig()
    vllm_config.cache_config.kv_cache_layout = "LBHNC"
    vllm_config.cache_config.enable_prefix_caching = True
    state = SimpleNamespace(token=object(), config=policy.config, served=SimpleNamespace(
        policy=policy, shape=SimpleNamespace(num_layers=layers)))
    tagged = prefix_cache.prefix_specs(tier_specs(specs, index, layers, tiers), state,
                                       vllm_config)
    groups = planning.get_kv_cache_groups(vllm_config, dict(tagged))
    config = planning.get_kv_cache_config_from_groups(vllm_config, groups, 4 << 20)
    assert layer_groups(config, layers) == LayerGroups.tiers(layers, tiers)
    kept = [g.kv_cache_spec.chunk_kept for g in config.kv_cache_groups]
    assert kept == [chunk - f for f in freed]
    coordinator = get_kv_cache_coordinator(config, 1024, 256, False, True, False, 1, 1, BS, BS)
    managers = coordinator.single_type_managers
    assert all(type(m) is prefix_cache.TokenPrefixManager and m._reuses for m in managers)
    prompt = list(range(500, 800))
    cold = vllm_request("cold", prompt)
    for m in managers:  # the cold request's rows after its chunks up to 2 x chunk
        m.req_to_blocks["cold"] = m.block_pool.get_new_blocks(
            cdiv(m.kv_cache_spec.physical(2 * chunk), BS))
        prefix_cache.register_boundary(m, cold, chunk)
        prefix_cache.register_boundary(m, cold, 2 * chunk)
    blocks, hit, _ = coordinator.find_longest_cache_hit(vllm_request("x", prompt).block_hashes,
                                                        len(prompt) - 1)
    assert hit == 2 * chunk
    assert [len(b) for b in blocks] == [cdiv(k * 2, BS) for k in kept]
    assert all(b == m.req_to_blocks["cold"] for b, m in zip(blocks, managers))
    blocks, hit, _ = coordinator.find_longest_cache_hit(
        vllm_request("y", prompt[:chunk + 10] + [1] * 50).block_hashes, chunk + 59)
    assert hit == chunk and [len(b) for b in blocks] == [cdiv(k, BS) for k in kept]


def test_a_head_mask_with_a_token_policy_hits_every_group_at_one_boundary():
    """A head mask with snapkv on its full heads: vLLM's pool plan (our packing), grouping
    and hybrid coordinator over the full heads' `TokenPrefixSpec` groups and the streaming
    heads' `TokenPrefixSinkSpec` groups. Rows keyed at two boundaries hit at the later one
    (streaming rows: the sink's and the window's blocks, the gap null); a streaming window
    block evicted moves every group's hit back to the earlier boundary, never to a block
    between; patched rows keep the first request's row at a boundary, naive ones add."""
    import importlib

    from vllm.config import VllmConfig
    from vllm.utils.math_utils import cdiv
    from vllm.v1.core.kv_cache_coordinator import get_kv_cache_coordinator
    from vllm.v1.core.kv_cache_utils import (generate_scheduler_kv_cache_config,
                                             make_block_hash_with_group_id)

    from vllm_kvevict.integration.core.token_ledger import TokenEvictionLedger
    from vllm_kvevict.integration.kv_cache import pool_groups, prefix_cache
    from vllm_kvevict.integration.kv_cache.sink_window import (COMPANION_SUFFIX, PromptFullSpec,
                                                               SinkWindowSpec)
    from vllm_kvevict.integration.kv_cache.specs import layer_groups
    from vllm_kvevict.integration.plugins.versions import KV_CACHE_PLANNING

    planning = importlib.import_module(KV_CACHE_PLANNING)
    prefix_cache.register_manager()
    sink, window, chunk = BS, 2 * BS, 4 * BS
    cfg = KVPolicyConfig.from_dict({"policy": "prulong", "sparsity": 0.5, "sink": sink,
                                    "window": window, "token_policy": "snapkv",
                                    "token_sparsity": 0.5, "eviction": "naive",
                                    "obs_window": 8, "eviction_chunk": chunk})
    full = torch.tensor([[1, 0], [1, 1], [0, 1], [1, 0]])
    policy = build_policy(cfg, 4, 2, full_heads=full)
    specs = {}
    for i, row in enumerate(full.tolist()):
        name = f"model.layers.{i}.self_attn.attn"
        specs[name] = PromptFullSpec(block_size=BS, num_kv_heads=sum(row), head_size=64,
                                     dtype=torch.float32)
        if sum(row) < 2:
            specs[name + COMPANION_SUFFIX] = SinkWindowSpec(
                block_size=BS, num_kv_heads=2 - sum(row), head_size=64, dtype=torch.float32,
                sliding_window=window + 1, sink=sink, chunk=chunk, retention=0)
    vllm_config = VllmConfig()
    vllm_config.cache_config.kv_cache_layout = "BLHNC"
    vllm_config.cache_config.enable_prefix_caching = True
    state = SimpleNamespace(token=object(), config=cfg, served=SimpleNamespace(
        policy=policy, shape=SimpleNamespace(num_layers=4)))
    tagged = prefix_cache.prefix_specs(specs, state, vllm_config)
    plan_config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_batched_tokens=256),
                                  model_config=SimpleNamespace(max_model_len=1024))
    groups = pool_groups.kv_cache_groups(plan_config, tagged)
    config = generate_scheduler_kv_cache_config(
        [planning.get_kv_cache_config_from_groups(vllm_config, groups, 8 << 20)])
    coordinator = get_kv_cache_coordinator(config, 1024, 256, False, True, False, 1, 1, BS, BS)
    managers = coordinator.single_type_managers
    kinds = {type(m) for m in managers}
    assert kinds == {prefix_cache.TokenPrefixManager, prefix_cache.TokenPrefixSinkManager}
    assert all(m._reuses for m in managers)
    streaming = [m for m in managers if isinstance(m, prefix_cache.TokenPrefixSinkManager)]

    def rows_of(name, end):
        """A request's rows after its chunks up to `end`: full heads compacted, streaming
        heads holding the sink and the window before each chunk boundary (as they held when
        the ledger keyed each boundary; the rest null)."""
        for m in managers:
            spec = m.kv_cache_spec
            if m in streaming:
                need = {j for b in range(chunk, end + 1, chunk) for j in spec.boundary_blocks(b)}
                m.req_to_blocks[name] = [m.block_pool.get_new_blocks(1)[0] if j in need
                                         else m.block_pool.null_block for j in range(end // BS)]
            else:
                m.req_to_blocks[name] = m.block_pool.get_new_blocks(
                    cdiv(spec.physical(end), BS))

    prompt = list(range(500, 800))
    cold = vllm_request("cold", prompt)
    rows_of("cold", 2 * chunk)
    for m in managers:
        assert prefix_cache.register_boundary(m, cold, chunk) > 0
        assert prefix_cache.register_boundary(m, cold, 2 * chunk) > 0
    blocks, hit, _ = coordinator.find_longest_cache_hit(vllm_request("x", prompt).block_hashes,
                                                        len(prompt) - 1)
    assert hit == 2 * chunk
    for b, m in zip(blocks, managers):
        own = m.req_to_blocks["cold"]
        if m in streaming:  # sink block 0, window blocks 6-7 of 8
            assert [j for j, x in enumerate(b) if not x.is_null] == [0, 6, 7]
            assert [b[j] for j in (0, 6, 7)] == [own[j] for j in (0, 6, 7)]
        else:
            assert b == own
    # a window block of the later boundary evicted: every group hits the earlier one
    victim = streaming[0].req_to_blocks["cold"][7]
    streaming[0].block_pool.evict_blocks({victim.block_id})
    blocks, hit, _ = coordinator.find_longest_cache_hit(vllm_request("y", prompt).block_hashes,
                                                        len(prompt) - 1)
    assert hit == chunk
    for b, m in zip(blocks, managers):
        if m in streaming:
            assert len(b) == chunk // BS and [j for j, x in enumerate(b) if not x.is_null] == \
                [0, 2, 3]
        else:
            assert len(b) >= cdiv(m.kv_cache_spec.physical(chunk), BS)

    # registration through the ledger: naive rows add their blocks to a boundary's keys,
    # patched ones keep the first row keyed there
    sink_group = streaming[0]
    for patched in (False, True):
        served = policy if not patched else build_policy(
            cfg.replace(eviction="patched", prefix_reuse="across-questions"), 4, 2,
            full_heads=full)
        ledger = TokenEvictionLedger(served, chunk, layer_groups(config, 4))
        ledger.scheduler = SimpleNamespace(requests={}, max_model_len=1024,
                                           kv_cache_manager=SimpleNamespace(
                                               coordinator=coordinator))
        name = f"again-{patched}"
        req = vllm_request(name, prompt[:chunk + 20] + [3] * 30)
        ledger.scheduler.requests[name] = req
        if patched:
            ledger.note_reuse(name, 0)
        rows_of(name, chunk)
        req.num_computed_tokens = chunk
        ledger.pending[name] = (chunk, False, served, chunk)
        ledger.before_schedule()
        mine = sink_group.req_to_blocks[name]
        added = [sink_group.block_pool.cached_block_hash_to_block.contain(
            make_block_hash_with_group_id(key, sink_group.kv_cache_group_id), mine[j].block_id)
            for j, key in prefix_cache._boundary_keys(sink_group, req, chunk)]
        assert added == [not patched] * 3, (patched, added)
