"""A head mask's quiet steps answered once for all KV-cache groups
(`integration/core/kv_cache_coordinator.py`) against vLLM's own per-group path: the same
requests served twice, once each way, must allocate, free and cache the very same blocks at
every step, and serve the same tokens and kv_stats."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from test_policies_vllm import source_prompts

pytestmark = pytest.mark.server  # loads the model in this test's own engines

REPO = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""
    import json, sys
    from vllm import LLM, SamplingParams
    from vllm_kvevict.integration.core.kvevict_scheduler import KVEvictScheduler
    policy, quiet, prompts, new_tokens = json.loads(sys.argv[1])
    KVEvictScheduler.quiet_steps = quiet
    llm = LLM(model=sys.argv[2], additional_config={"kv_policy": policy}, enforce_eager=True,
              dtype="float32", max_model_len=2048, kv_cache_memory_bytes=128 << 20,
              max_num_batched_tokens=256, enable_prefix_caching=True, seed=0)
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    coordinator = scheduler.kv_cache_manager.coordinator
    pool = scheduler.kv_cache_manager.block_pool
    order, steps, stock = {}, [], scheduler.schedule

    def schedule(*args, **kwargs):
        out = stock(*args, **kwargs)
        for new in out.scheduled_new_reqs:
            order.setdefault(new.req_id, len(order))
        steps.append({
            "free": pool.get_num_free_blocks(),
            "cached_hashes": len(pool.cached_block_hash_to_block._cache),
            "requests": {order[rid]: {
                "blocks": [[b.block_id for b in blocks] for blocks in coordinator.get_blocks(rid)],
                "cached": [m.num_cached_block.get(rid) for m in coordinator.single_type_managers]}
                for rid in out.num_scheduled_tokens}})
        return out

    scheduler.schedule = schedule
    # how often the streaming groups' managers are asked to free skipped blocks
    freeing = [0]
    for manager in coordinator.single_type_managers:
        if hasattr(manager, "freed_range"):
            def counted(*args, _f=manager.remove_skipped_blocks, **kwargs):
                freeing[0] += 1
                return _f(*args, **kwargs)
            manager.remove_skipped_blocks = counted
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    outs += llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)  # a hit
    print("RESULT " + json.dumps({
        "coordinator": type(coordinator).__name__, "groups": len(coordinator.single_type_managers),
        "steps": steps, "freeing_calls": freeing[0], "token_ids": [list(o.outputs[0].token_ids) for o in outs],
        "kv_stats": [o.kv_transfer_params["kv_stats"] for o in outs]}))
""")

# kv_stats that depend on the blocks held (none of the timing fields)
HELD = ("kv_bytes_peak", "kv_bytes_integral", "kv_bytes_end", "blocks_held_peak",
        "blocks_held_end", "blocks_freed", "cached_tokens", "footprint", "measured_footprint")


def serve(model_dir, policy, quiet, prompts, new_tokens) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps([policy, quiet, prompts, new_tokens]),
         str(model_dir)], capture_output=True, text=True, timeout=900, cwd=REPO,
        env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_quiet_steps_allocate_and_cache_as_every_group_would(bundled_model_dir, tokenizer):
    """prulong 0.7 at its defaults (the fast layout: streaming heads in 64-token blocks, full
    heads in 128, prefix caching on): three 900-token prompts sharing 400, 150 new tokens each
    (decode crosses both block sizes and moves every window), then the first prompt again
    (a prefix hit)."""
    [head, *tails] = source_prompts(tokenizer, (400, 500, 500, 500))
    prompts = [head + tail for tail in tails]
    policy = {"policy": "prulong", "sparsity": 0.7}
    quiet = serve(bundled_model_dir, policy, True, prompts, 150)
    stock = serve(bundled_model_dir, policy, False, prompts, 150)
    assert quiet["coordinator"] == "QuietSteps", quiet["coordinator"]
    assert stock["coordinator"] == "HybridKVCacheCoordinator"
    assert quiet["groups"] > 2
    assert len(quiet["steps"]) == len(stock["steps"]) > 2 * 150
    for i, (a, b) in enumerate(zip(quiet["steps"], stock["steps"])):
        assert a == b, f"step {i}: {a} != {b}"
    assert quiet["token_ids"] == stock["token_ids"]
    for a, b in zip(quiet["kv_stats"], stock["kv_stats"]):
        assert {k: a[k] for k in HELD} == {k: b[k] for k in HELD}
    assert quiet["kv_stats"][3]["cached_tokens"] > 0  # the hit happened
    # the streaming groups asked to free only when their freed range moves (a 64-token block)
    assert 0 < quiet["freeing_calls"] < stock["freeing_calls"] / 4, \
        (quiet["freeing_calls"], stock["freeing_calls"])
