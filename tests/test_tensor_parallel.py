"""Tensor parallel: each rank serves its slice of the head mask and its share of token eviction.

Unit tests: the per-rank head split and its padding (vLLM wants one KV-cache spec per layer on
every rank), and per-rank bytes. Server tests: `vllm serve --tensor-parallel-size 2` of a tiny
random Qwen3 (4 KV heads, 2 per rank; vLLM's CPU TP on this 2-core machine with
VLLM_CPU_OMP_THREADS_BIND="0|1", one core per rank), its greedy tokens equal to the reference
oracle's (which the TP = 1 tests also equal), and kv_stats summing both ranks. CI runs prulong
0.7 on a mask whose full heads sit side by side (the balanced head order, head_order.py) and
patched snapkv on a 1-KV-head model (replicated heads, their scores gathered); the other
policies, vLLM's contiguous head order and the other replicated cases are slow.
scripts/tp_matrix.py serves each policy at TP = 1 and TP = 2 and compares them directly
(docs/results/tensor_parallel/).
"""

from __future__ import annotations

import openai
import pytest
import torch
from compat_matrix import HYBRID, TP_CI, TP_IDS, V2_TP, V2_TP_CI
from conftest import SERVED_NAME, pool_width, start_server
from test_model_families_vllm import NEW_TOKENS, random_mask, reference
from test_policies_vllm import flags, source_prompts

from vllm_kvevict.config import HEAD_MASK_POLICIES
from vllm_kvevict.integration.kv_cache.head_split import layer_heads
from vllm_kvevict.integration.kv_cache.specs import paged_spec
from vllm_kvevict.stats import ByteLayout

TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # one core per rank (vLLM asserts without it)

# -- the per-rank head split --------------------------------------------------------------------

# 3 layers x 4 KV heads; True = streaming
MASK = torch.tensor([[True, False, False, False],    # rank 0: 1 full, rank 1: 2 full
                     [True, True, True, True],       # no full head anywhere
                     [False, False, True, True]])    # rank 0: 2 full, rank 1: none


def test_each_rank_gets_its_contiguous_slice_with_local_indices():
    r0, r1 = layer_heads(MASK, 3, rank=0, world=2), layer_heads(MASK, 3, rank=1, world=2)
    assert [h.num_kv_heads for h in r0] == [2, 2, 2]
    assert [(h.full_kv, h.streaming_kv) for h in r0] == [((1,), (0,)), ((), (0, 1)),
                                                          ((0, 1), ())]
    assert [(h.full_kv, h.streaming_kv) for h in r1] == [((0, 1), ()), ((), (0, 1)),
                                                          ((), (0, 1))]
    assert r0[0].q_heads(r0[0].full_kv) == [3, 4, 5]  # local query heads of local KV head 1
    # one rank is the whole mask, unpadded
    whole = layer_heads(MASK, 3)
    assert [(len(h.full_kv), h.paged_heads) for h in whole] == [(3, 3), (0, 0), (2, 2)]


def test_every_rank_declares_the_same_padded_spec():
    """vLLM asserts one spec per layer across ranks: each declares the most full heads any rank
    holds in the layer (0 only where no rank has one: that layer shares another's cache)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    stock = FullAttentionSpec(block_size=128, num_kv_heads=2, head_size=64, dtype=torch.float32)
    specs = [[paged_spec(stock, h) for h in layer_heads(MASK, 3, rank=r, world=2)]
             for r in (0, 1)]
    assert specs[0] == specs[1]
    assert [s and s.num_kv_heads for s in specs[0]] == [2, None, 2]


def test_world_must_divide_the_kv_heads():
    with pytest.raises(ValueError, match="do not divide 4 KV heads"):
        layer_heads(MASK, 3, rank=0, world=3)


def test_replicated_kv_heads_give_each_rank_a_replica_and_its_share_of_queries():
    """Fewer KV heads than ranks: vLLM gives rank r KV head floor(r H / world) and
    1/(world / H) of its query heads; the replica is full or streaming as its head is."""
    mask = torch.tensor([[True, False], [False, True]])  # 2 layers x 2 KV heads, 4 ranks
    ranks = [layer_heads(mask, 6, rank=r, world=4) for r in range(4)]
    for r, heads in enumerate(ranks):
        head = r // 2
        assert [h.num_kv_heads for h in heads] == [1, 1]
        assert [h.queries_per_kv for h in heads] == [3, 3]
        assert [h.streaming_kv for h in heads] == [((0,) if mask[l, head] else ())
                                                   for l in range(2)]
        assert [h.paged_heads for h in heads] == [1, 1]  # some rank holds a full replica
    one = layer_heads(torch.tensor([[True], [False]]), 4, rank=1, world=2)
    assert [(h.full_kv, h.streaming_kv, h.queries_per_kv) for h in one] == [
        ((), (0,), 2), ((0,), (), 2)]
    assert one[0].streaming_q.tolist() == [0, 1] and one[1].full_q.tolist() == [0, 1]


def test_bytes_per_rank():
    # 3 blocks of 2000 bytes over both ranks: each rank holds half of every block
    layout = ByteLayout(block_size=128, group_bytes_per_block=(2000,), full_bytes_per_block=0,
                        ranks=2)
    assert layout.per_rank(6000) == [3000, 3000]
    assert ByteLayout(128, (10,), 0).per_rank(30) == [30]


# -- served at TP = 2 ---------------------------------------------------------------------------

CHUNK = 128
PROMPT_LENGTHS = (300, 340)
# compat-matrix column -> policy (its test ids and the CI set are compat_matrix's TP_IDS, TP_CI)
TP_POLICIES = {
    "full": {"policy": "full"},
    "streaming": {"policy": "streaming", "sink": 16, "window": 64},
    "duo 0.3": {"policy": "duo", "sparsity": 0.3, "sink": 16, "window": 64},
    "prulong 0.7": {"policy": "prulong", "sparsity": 0.7, "sink": 16, "window": 64},
    "snapkv naive": {"policy": "snapkv", "sparsity": 0.5, "eviction": "naive"},
    "snapkv patched": {"policy": "snapkv", "sparsity": 0.5, "eviction": "patched"},
    "pyramidkv naive": {"policy": "pyramidkv", "sparsity": 0.5, "eviction": "naive",
                        "tiers": 2},
    "pyramidkv patched": {"policy": "pyramidkv", "sparsity": 0.7, "eviction": "patched"},
    # decode-time eviction: each rank compresses its own KV heads with their own queries
    "snapkv naive + decode eviction": {"policy": "snapkv", "sparsity": 0.5, "eviction": "naive",
                                       "decode_budget": 64, "decode_interval": 4},
    # a head mask whose full heads evict tokens: each rank its slice of both (the ranks hold
    # different numbers of full heads: the paged cache padded to the fullest rank's)
    HYBRID: {"policy": "prulong", "sparsity": 0.5, "sink": 16, "window": 64,
             "token_policy": "snapkv", "token_sparsity": 0.5, "eviction": "patched"},
}
CASES = [pytest.param((4, TP_POLICIES[column]), id=test_id,
                      marks=[] if column in TP_CI else [pytest.mark.slow])
         for column, test_id in TP_IDS.items()]
# 2 KV heads: one per rank; 1 KV head: vLLM replicates it, a replica per rank
# vLLM's own head order: the clustered mask then pads each rank to the fullest rank's heads
CASES.append(pytest.param((4, {**TP_POLICIES["prulong 0.7"], "tp_head_order": "contiguous"}),
                          id="kv4-prulong-0.7-contiguous", marks=pytest.mark.slow))
CASES.append(pytest.param((2, TP_POLICIES["prulong 0.7"]), id="kv2-prulong-0.7",
                          marks=pytest.mark.slow))
# (token eviction: each replica scores with its half of the head's queries, the halves gathered;
# CI's replicated-heads case)
CASES.append(pytest.param((1, TP_POLICIES["snapkv patched"]),
                          id="kv1-replicated-snapkv-patched-0.5", marks=pytest.mark.slow))
CASES.append(pytest.param((1, TP_POLICIES["snapkv naive + decode eviction"]),
                          id="kv1-replicated-snapkv-decode", marks=pytest.mark.slow))
CASES.append(pytest.param((1, TP_POLICIES["prulong 0.7"]), id="kv1-replicated-prulong-0.7",
                          marks=pytest.mark.slow))


# prulong 0.7 with its sink in whole 64-token blocks and no --block-size: the fast layout
# (features.fast_layout; the window short enough that the test's prompts evict)
FAST_LAYOUT = {"policy": "prulong", "sparsity": 0.7, "sink": 64, "window": 64}

# 4 layers x 4 KV heads whose highest gates sit side by side: prulong 0.7 keeps heads {0, 1}
# of layers 0 and 2 and head 0 of layer 1 full, so vLLM's contiguous split puts two full heads
# on rank 0 and none on rank 1 in layers 0 and 2 (issue 47's padding)
CLUSTERED_GATES = torch.tensor([[0.9, 0.8, 0.1, 0.2], [0.85, 0.3, 0.2, 0.1],
                                [0.7, 0.75, 0.05, 0.15], [0.4, 0.35, 0.3, 0.25]])


def clustered_mask(model_dir):
    from vllm_kvevict.masks import HeadGates, save_head_gates

    path = model_dir.parent / f"{model_dir.name}-clustered-mask.json"
    save_head_gates(path, HeadGates(CLUSTERED_GATES, meta={"model": model_dir.name,
                                                           "objective": "clustered"}))
    return path


def _tp2_server(policy: dict, num_kv_heads: int, tiny_qwen3, env: dict | None = None,
                reuse: bool = False):
    """A TP 2 server of `policy` on the tiny Qwen3 with `num_kv_heads` KV heads (a head mask:
    a random one saved beside the model, for prulong 0.7 on 4 KV heads the clustered one):
    (server, HF model, model dir, served policy)."""
    from transformers import AutoModelForCausalLM

    model_dir = tiny_qwen3(num_kv_heads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    policy = dict(policy)
    if policy["policy"] in HEAD_MASK_POLICIES:
        clustered = policy["policy"] == "prulong" and policy["sparsity"] == 0.7 \
            and num_kv_heads == 4
        policy["mask_path"] = str(clustered_mask(model_dir) if clustered
                                  else random_mask(model_dir, model.config))
    server = start_server(model_dir, [*flags(policy, CHUNK), "--tensor-parallel-size", "2"],
                          env={**TP_ENV, **(env or {})}, reuse=reuse)
    log = server.log_tail(10 ** 7)
    assert "Worker_TP0" in log and "Worker_TP1" in log  # two worker processes, one per rank
    return server, model, model_dir, policy


def _served_equals_reference(server, model, model_dir, policy, tokenizer):
    """Each prompt's served tokens == the reference's; yields (prompt, kv_stats)."""
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")
    for prompt in source_prompts(tokenizer, PROMPT_LENGTHS):
        r = client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=NEW_TOKENS,
                                      temperature=0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
        stats = r.model_extra["kv_stats"]
        ref = reference(model, model_dir, policy, prompt, stats["chunk_boundaries"])
        assert r.choices[0].model_extra["token_ids"] == ref.token_ids, (policy, len(prompt))
        assert stats["tensor_parallel_size"] == 2
        yield prompt, stats


def _pool_bytes_are_the_plans(server, stats, block_size: int = 128) -> None:
    """Streaming heads in the pool: every group's block on each rank is the plan's width in
    head pages x K, V x block_size x 64 x 4 bytes (the ranks' slots padded alike: equal
    blocks)."""
    per_rank = stats["kv_bytes_peak_per_rank"]
    assert per_rank[0] == per_rank[1]
    assert stats["kv_bytes_peak"] == (2 * stats["blocks_held_peak"]
                                      * pool_width(server) * 2 * block_size * 64 * 4)


@pytest.mark.server
@pytest.mark.serial  # one rank per core: no other server may hold a core meanwhile
@pytest.mark.parametrize("case", CASES)
def test_tp2_serves_the_reference_tokens(case, tiny_qwen3, tokenizer, one_torch_thread):
    num_kv_heads, policy = case
    name = policy["policy"]
    server, model, model_dir, policy = _tp2_server(policy, num_kv_heads, tiny_qwen3)
    for prompt, stats in _served_equals_reference(server, model, model_dir, policy, tokenizer):
        per_rank = stats["kv_bytes_peak_per_rank"]
        assert len(per_rank) == 2 and sum(per_rank) == stats["kv_bytes_peak"]
        held = max(num_kv_heads, 2)  # (one KV head: stock vLLM holds a replica per rank)
        expect_full = (model.config.num_hidden_layers * 2 * held * 64 * 4
                       * 128 * -(-(len(prompt) + NEW_TOKENS - 1) // 128))
        assert stats["full_kv_bytes_peak"] == expect_full  # both ranks' heads
        if name == "full":
            assert stats["kv_bytes_peak"] == expect_full and per_rank[0] == per_rank[1]
        elif name in ("streaming", *HEAD_MASK_POLICIES):
            # (the hybrid too: its full heads' groups are compacted blocks of the same pool)
            _pool_bytes_are_the_plans(server, stats)
        else:
            assert stats["kv_bytes_peak"] < expect_full and per_rank[0] == per_rank[1]
    if "clustered" in policy.get("mask_path", ""):
        # the clustered mask's declared heads: balanced 3 full + 6 streaming per rank (tokens
        # above: the permuted weights serve the same model), vLLM's order 5 + 8
        log = server.log_tail(10 ** 7)
        if policy.get("tp_head_order") == "contiguous":
            assert "--kv-tp-head-order contiguous: KV heads in vLLM's order; balanced would " \
                "declare full heads 5 -> 3, streaming companions 8 -> 6" in log
            assert pool_width(server) == 5  # every pool block: 5 head pages
        else:
            assert pool_width(server) == 3
            assert "KV heads reordered so every rank holds its share of the full heads " \
                "(--kv-tp-head-order balanced): full heads 5 -> 3, streaming companions " \
                "8 -> 6 per rank" in log


@pytest.mark.server
@pytest.mark.serial
def test_tp2_short_soak(tiny_qwen3, tokenizer, one_torch_thread):
    """TP 2's short soak (`mechanism_soak.py`) on the CI case's server above (prulong 0.7, the
    clustered mask, balanced head order, 4 KV heads): its samples equal the reference's."""
    from mechanism_soak import short_soak

    server, model, model_dir, policy = _tp2_server(TP_POLICIES["prulong 0.7"], 4, tiny_qwen3,
                                                   reuse=True)
    short_soak(server, lambda prompt, ends, _: reference(model, model_dir, policy, prompt,
                                                         ends).token_ids,
               source_prompts(tokenizer, (300, 340)), new_tokens=NEW_TOKENS,
               xargs=[{"kv_teacher_forced": 4}])


@pytest.mark.server
@pytest.mark.serial
@pytest.mark.parametrize("v2", [pytest.param(False, id="v1", marks=pytest.mark.slow),
                                pytest.param(True, id="v2", marks=pytest.mark.slow)])
def test_tp2_fast_layout_serves_the_reference_tokens(v2, tiny_qwen3, tokenizer,
                                                     one_torch_thread):
    """A head mask whose sink is whole 64-token blocks, no --block-size: the fast layout under TP
    2 puts every group, full heads included, in 64-token blocks on both ranks (the streaming
    heads' decode reads the pool in place), under V1 and the V2 runner; tokens == the
    reference, each rank's pool the plan's width in 64-token blocks."""
    from triton_interpreter import runners_in, server_env

    server, model, model_dir, policy = _tp2_server(FAST_LAYOUT, 4, tiny_qwen3,
                                                   server_env() if v2 else None)
    log = server.log_tail(10 ** 7)
    assert "streaming heads in 64-token blocks (the fast layout;" in log
    v2_loads, v1_loads = runners_in(log)
    assert (v2_loads, v1_loads > 0) == ((1, False) if v2 else (0, True)), runners_in(log)
    for _, stats in _served_equals_reference(server, model, model_dir, policy, tokenizer):
        assert stats["measured_footprint"] < 1
        _pool_bytes_are_the_plans(server, stats, block_size=64)


@pytest.mark.server
@pytest.mark.serial
@pytest.mark.served_release
@pytest.mark.parametrize("column", [pytest.param(c, id=TP_IDS[c], marks=[] if c in V2_TP_CI
                                                 else [pytest.mark.slow]) for c in V2_TP])
def test_tp2_under_the_v2_runner_serves_the_reference_tokens(column, tiny_qwen3, tokenizer,
                                                            one_torch_thread):
    """vLLM's V2 model runner in both ranks (its Triton kernels in Triton's interpreter,
    `triton_interpreter.server_env`): each rank its slice of the heads, as under V1 (the
    clustered mask's balanced head order included), tokens == the reference."""
    from triton_interpreter import runners_in, server_env

    server, model, model_dir, policy = _tp2_server(TP_POLICIES[column], 4, tiny_qwen3,
                                                   server_env())
    assert runners_in(server.log_tail(10 ** 7)) == (1, 0)  # (logged by rank 0)
    assert len(list(_served_equals_reference(server, model, model_dir, policy, tokenizer))) \
        == len(PROMPT_LENGTHS)


@pytest.mark.server
@pytest.mark.serial
@pytest.mark.slow  # CI's budget; the engine-side cache is TP = 1's (tests/test_token_prefix_cache.py)
def test_tp2_prefix_caching_with_naive_token_eviction(tiny_qwen3, tokenizer, one_torch_thread):
    """`--enable-prefix-caching` with naive snapkv under TP 2: a prompt cold, again (a hit at
    its last chunk boundary, 256), and a prompt sharing its first 200 tokens (a hit at 128,
    whose row of 64 slots is a partial block: vLLM's copy-on-write on both ranks); each
    rank's worker starts its ledger at the hit; tokens == the reference at the same chunks."""
    policy = TP_POLICIES["snapkv naive"]
    model_dir = tiny_qwen3(4)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    server = start_server(model_dir, [*flags(policy, CHUNK), "--tensor-parallel-size", "2",
                                      "--enable-prefix-caching"], env=TP_ENV)
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")
    prompt, other = source_prompts(tokenizer, (340, 340))
    for ids, cached in ((prompt, 0), (prompt, 256), (prompt[:200] + other[200:], 128)):
        r = client.completions.create(model=SERVED_NAME, prompt=ids, max_tokens=NEW_TOKENS,
                                      temperature=0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
        stats = r.model_extra["kv_stats"]
        assert stats["cached_tokens"] == cached and stats["tensor_parallel_size"] == 2, stats
        ends = [e for e in range(CHUNK, len(ids), CHUNK)] + [len(ids)]
        ref = reference(model, model_dir, policy, ids, ends)
        assert r.choices[0].model_extra["token_ids"] == ref.token_ids, cached


def test_padding_is_what_the_ranks_declare():
    """Each rank's paged cache declares the most full heads any rank holds in the layer."""
    mask = ~torch.tensor([[True, False, True, True], [False, False, False, True]])
    per_rank = [[h.paged_heads for h in layer_heads(~mask, 1, rank=r, world=2)] for r in (0, 1)]
    padded = mask.view(2, 2, 2).sum(dim=2).max(dim=1).values.tolist()
    assert per_rank[0] == per_rank[1] == padded == [1, 2]
    # pool storage: each rank's streaming companion declares the most streaming heads a rank
    # holds in the layer (layer 0: rank 0 has one, rank 1 two; layer 1: none and one)
    companions = [[h.companion_heads for h in layer_heads(~mask, 1, rank=r, world=2)]
                  for r in (0, 1)]
    assert companions[0] == companions[1] == [2, 1]
    assert [len(h.streaming_kv) for h in layer_heads(~mask, 1, rank=0, world=2)] == [1, 0]


# -- the FlexAttention path at TP = 2 -----------------------------------------------------------

@pytest.mark.server
@pytest.mark.serial
@pytest.mark.slow  # CI's budget (181 s on CI): the CPU path's TP = 2 runs in CI
@pytest.mark.parametrize("column", ["prulong 0.7", "snapkv patched", HYBRID])
def test_tp2_flex_serves_the_reference_tokens(column, tiny_qwen3, tokenizer, one_torch_thread):
    """`--kv-attention-backend flex --tensor-parallel-size 2`: each rank masks its slice of the
    heads, its streaming heads in their groups of vLLM's pool (head masks), or compresses its
    heads' chunks (token eviction), or both (a head mask with a token policy, the ranks holding
    different numbers of full heads); the tokens are the reference's."""
    policy = {**TP_POLICIES[column], "attention_backend": "flex"}
    server, model, model_dir, policy = _tp2_server(policy, 4, tiny_qwen3)
    assert "attention_backend=flex" in server.log_tail(10 ** 7)
    for _, stats in _served_equals_reference(server, model, model_dir, policy, tokenizer):
        if policy["policy"] in HEAD_MASK_POLICIES:
            _pool_bytes_are_the_plans(server, stats)


def test_padding_script_counts_what_the_ranks_declare():
    """scripts/tp_padding.py's "contiguous" column is `layer_heads`' padding (every rank declares
    the layer's paged and companion heads), its "balanced" column ceil(heads / T) per layer."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "tp_padding.py"
    spec = importlib.util.spec_from_file_location("tp_padding", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    full = ~MASK  # 3 layers x 4 KV heads: full heads per layer 3, 0, 2
    for tp in (2, 4):
        declared = layer_heads(MASK, 3, rank=0, world=tp)  # (the same on every rank)
        p = script.padding(full, tp)
        assert p["full_contiguous"] == tp * sum(h.paged_heads for h in declared) / 5
        assert p["stream_contiguous"] == tp * sum(h.companion_heads for h in declared) / 7
    assert script.padding(full, 2)["full_balanced"] == 2 * (2 + 0 + 1) / 5
    # the "balanced" columns are what the ranks declare in the served order (head_order.py)
    from vllm_kvevict.integration.worker.head_order import balanced_order
    from vllm_kvevict.masks import duo_quantile_full_heads, load_head_gates

    gates = load_head_gates(path.parents[1] / "head_masks" / "Meta-Llama-3.1-8B-Instruct"
                            / "duo.json")
    for sparsity in (0.5, 0.7):
        full = duo_quantile_full_heads(gates, sparsity)
        for tp in (2, 4, 8):
            served = (~full).gather(1, balanced_order(~full, tp))
            declared = layer_heads(served, 4, rank=0, world=tp)
            p = script.padding(full, tp)
            assert p["full_balanced"] == pytest.approx(
                tp * sum(h.paged_heads for h in declared) / full.sum().item())
            assert p["stream_balanced"] == pytest.approx(
                tp * sum(h.companion_heads for h in declared) / (~full).sum().item())


# -- the balanced head order (integration/worker/head_order.py) ----------------------------------------

def test_balanced_order_gives_every_rank_its_share_of_each_layers_full_heads():
    from vllm_kvevict.integration.worker.head_order import balanced_order

    gen = torch.Generator().manual_seed(1)
    for world, heads in ((2, 4), (2, 8), (4, 8), (4, 16)):
        streaming = torch.rand(40, heads, generator=gen) < 0.6
        order = balanced_order(streaming, world)
        for layer, row in enumerate(order.tolist()):
            assert sorted(row) == list(range(heads))  # a permutation of the layer's heads
            served = streaming[layer, row].view(world, heads // world)
            full = (~served).sum(dim=1)
            assert full.max() - full.min() <= 1  # ceil or floor of the layer's full heads
            if row != list(range(heads)):  # only an unbalanced layer is reordered
                ranks = (~streaming[layer]).view(world, -1).sum(dim=1)
                assert ranks.max() - ranks.min() > 1


def test_the_order_is_chosen_only_where_it_declares_fewer_heads():
    from vllm_kvevict.integration.worker.head_order import choose

    streaming = ~(CLUSTERED_GATES >= 0.7)  # prulong 0.7's full heads of the clustered gates
    order, line = choose(streaming, 2, "balanced", None)
    assert order.tolist() == [[0, 2, 1, 3], [0, 1, 2, 3], [0, 2, 1, 3], [0, 1, 2, 3]]
    assert "full heads 5 -> 3, streaming companions 8 -> 6" in line
    assert choose(streaming, 2, "contiguous", None)[0] is None
    blocked = choose(streaming, 2, "balanced", "quantized weights (fp8)")
    assert blocked[0] is None and "(quantized weights (fp8))" in blocked[1]
    assert choose(streaming, 1, "balanced", None) == (None, None)  # no tensor parallel
    assert choose(streaming, 4, "balanced", None) == (None, None)  # one head per rank
    assert choose(MASK, 2, "balanced", None)[0] is not None  # (layer 2: ranks hold 2 and 0)
    assert choose(torch.tensor([[True, False, True, False]]), 2, "balanced", None) \
        == (None, None)  # already balanced


def test_permuted_projections_compute_the_same_attention():
    """GQA attention of one layer with its q/k/v rows and o_proj's columns permuted by KV head
    equals the original's (the model the reference runs)."""
    from vllm_kvevict.integration.worker.head_order import permute

    heads, group, dim, hidden, tokens = 4, 3, 8, 32, 7
    gen = torch.Generator().manual_seed(0)
    w = {p: torch.randn(heads * (group if p == "q_proj" else 1) * dim, hidden, generator=gen,
                        dtype=torch.float64) for p in ("q_proj", "k_proj", "v_proj")}
    w["o_proj"] = torch.randn(hidden, heads * group * dim, generator=gen, dtype=torch.float64)
    bias = torch.randn(heads * dim, generator=gen, dtype=torch.float64)
    x = torch.randn(tokens, hidden, generator=gen, dtype=torch.float64)

    def attention(w, k_bias):
        q = (x @ w["q_proj"].T).view(tokens, heads, group, dim)
        k = (x @ w["k_proj"].T + k_bias).view(tokens, heads, dim)
        v = (x @ w["v_proj"].T).view(tokens, heads, dim)
        causal = torch.ones(tokens, tokens, dtype=torch.bool).tril()
        s = torch.einsum("thgd,shd->hgts", q, k).masked_fill(~causal, float("-inf"))
        out = torch.einsum("hgts,shd->thgd", s.softmax(-1), v).reshape(tokens, -1)
        return out @ w["o_proj"].T

    order = torch.tensor([[2, 0, 3, 1]])
    name = "model.layers.0.self_attn.{}.{}"
    permuted = {p: permute(name.format(p, "weight"), t, order, group, dim) for p, t in w.items()}
    assert not torch.equal(permuted["k_proj"], w["k_proj"])
    k_bias = permute(name.format("k_proj", "bias"), bias, order, group, dim)
    assert torch.allclose(attention(permuted, k_bias), attention(w, bias), atol=1e-12)
    assert permute("model.layers.0.mlp.up_proj.weight", x, order, group, dim) is x
    with pytest.raises(RuntimeError, match="--kv-tp-head-order contiguous"):
        permute(name.format("k_proj", "weight"), torch.zeros(5, hidden), order, group, dim)


def test_the_head_order_flag():
    from vllm_kvevict.config import KVPolicyConfig, KVPolicyError
    from vllm_kvevict.flags import FLAGS

    assert FLAGS["--kv-tp-head-order"][0] == "tp_head_order"
    assert KVPolicyConfig(policy="prulong", tp_head_order="contiguous").tp_head_order \
        == "contiguous"
    with pytest.raises(KVPolicyError, match="valid: balanced, contiguous"):
        KVPolicyConfig(policy="prulong", tp_head_order="random")
    with pytest.raises(KVPolicyError, match="only applies to a head mask"):
        KVPolicyConfig(policy="snapkv", tp_head_order="contiguous")
