"""vLLM's V2 model runner (`vllm/v1/worker/gpu/model_runner.py`, CUDA's default from vLLM 0.33)
serving the policies, executed here: vLLM 0.32's CPU worker builds it when Triton is on, and
its Triton kernels run in Triton's interpreter (`triton_interpreter.py`). Tokens == the
plain-PyTorch reference for a batch whose rows the V2 runner orders itself, and again for the
first prompt repeated (a prefix-cache hit where the policy caches prefixes), on vLLM's CPU
attention and on the portable FlexAttention path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from compat_matrix import V2_CI, V2_COMPILED, V2_SLOW
from test_policies_vllm import CASES, reference, source_prompts
from vllm_kvevict.config import KVPolicyConfig
from vllm_kvevict.footprint import eviction_boundaries

pytestmark = pytest.mark.server  # loads the model in its own engine

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
NEW_TOKENS = 12

SCRIPT = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[3])
    import triton_interpreter
    triton_interpreter.enable()
    from vllm import LLM, SamplingParams
    policy, chunk, prompts, new_tokens, caching, more = json.loads(sys.argv[1])
    llm = LLM(model=sys.argv[2], additional_config={"kv_policy": policy}, **{
              "enforce_eager": True, "dtype": "float32", "max_model_len": 4096,
              "kv_cache_memory_bytes": 256 << 20, "max_num_batched_tokens": chunk,
              "enable_prefix_caching": caching, "seed": 0, **more})
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    params = SamplingParams(temperature=0, max_tokens=new_tokens)
    batch = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    [again] = llm.generate([{"prompt_token_ids": prompts[0]}], params)  # a prefix-cache hit
    print("RESULT " + json.dumps({
        "runner": type(runner).__module__,
        "compilation_mode": int(llm.llm_engine.vllm_config.compilation_config.mode),
        "block_size": llm.llm_engine.vllm_config.cache_config.block_size,
        "token_ids": [list(o.outputs[0].token_ids) for o in batch + [again]],
        "kv_stats": [o.kv_transfer_params["kv_stats"] for o in batch + [again]]}))
""")


def run_v2(model_dir, policy, chunk, prompts, caching=None, new_tokens=NEW_TOKENS,
           **more) -> subprocess.CompletedProcess:
    """In a subprocess: Triton's interpreter must be on before vLLM is imported, and vLLM's
    engine core and its plugin state belong to one process."""
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "VLLM_USE_V2_MODEL_RUNNER": "1",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    return subprocess.run([sys.executable, "-c", SCRIPT,
                           json.dumps([policy, chunk, prompts, new_tokens, caching, more]),
                           str(model_dir),
                           str(TESTS)], capture_output=True, text=True, timeout=1200, cwd=REPO,
                          env=env)


def result_of(proc) -> dict:
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


slow = pytest.mark.slow
# (which cases CI serves: compat_matrix.py, beside the other rows')
V2_CASES = V2_CI + [pytest.param(c, b, marks=slow) for c, b in V2_SLOW]


@pytest.mark.parametrize("case, backend", V2_CASES)
def test_v2_runner_serves_the_reference(bundled_model_dir, tokenizer, hf_model, case, backend):
    check_v2(bundled_model_dir, tokenizer, hf_model, case, backend)


@pytest.mark.slow
@pytest.mark.parametrize("case", V2_COMPILED)
def test_v2_runner_compiled_serves_the_reference(bundled_model_dir, tokenizer, hf_model, case):
    """Without --enforce-eager: vLLM compiles the model (torch.compile, piecewise around the
    attention op) and the V2 runner calls it through its compiled path."""
    result = check_v2(bundled_model_dir, tokenizer, hf_model, case, "cpu", enforce_eager=False)
    assert result["compilation_mode"] != 0


# prulong 0.7 at the bundled mask's defaults (sink 64, window 256) with no --block-size: the fast
# layout, every group in 64-token blocks under V2 (validation.choose_fast_layout)
FAST_LAYOUT = "prulong-0.7-fast-layout"


@pytest.mark.parametrize("case", [FAST_LAYOUT])
def test_v2_runner_fast_layout_serves_the_reference(bundled_model_dir, tokenizer, hf_model,
                                                    case):
    assert check_v2(bundled_model_dir, tokenizer, hf_model, case, "cpu")["block_size"] == 64


def check_v2(bundled_model_dir, tokenizer, hf_model, case, backend, **more) -> dict:
    policy, chunk = {**CASES, FAST_LAYOUT: ({"policy": "prulong", "sparsity": 0.7}, 256)}.get(
        case, ({"policy": "full"}, 256))
    policy = {**policy, "attention_backend": backend}
    config = KVPolicyConfig.from_dict(policy)
    # prefix caching where the policy serves it without more flags (docs/design/kv_cache.md)
    caching = not config.patched and config.decode_budget is None
    prompts = source_prompts(tokenizer, (700, 1600, 1000))
    result = result_of(run_v2(bundled_model_dir, policy, chunk, prompts, caching, **more))
    assert result["runner"] == "vllm.v1.worker.cpu.model_runner"  # the V2 runner, not V1's
    stats = result["kv_stats"]
    for prompt, got, s in zip(prompts + prompts[:1], result["token_ids"], stats):
        # token eviction: at the eviction chunks among the steps the batch was split into (a
        # pinned eviction chunk, as naive eviction's prefix caching pins, or every step's end;
        # a head mask's stats give its canonical chunks, whatever the split)
        chunks = eviction_boundaries(s["chunk_boundaries"], len(prompt),
                                     s["params"]["eviction_chunk"])
        ref = reference(hf_model, bundled_model_dir, policy, prompt, chunks, NEW_TOKENS)
        assert got == list(ref.token_ids), (len(prompt), s["chunk_boundaries"], chunks)
    # the batch's prompts share no prefix; the repeat is served from cached blocks
    assert [s["cached_tokens"] for s in stats[:3]] == [0, 0, 0]
    assert (stats[-1]["cached_tokens"] > 0) == caching
    for s in stats:  # full attention holds what it reads; the policies hold less
        assert s["measured_footprint"] == 1 if case == "full" else 0 < s["measured_footprint"] < 1
    return result


def test_v2_runner_refuses_untested_features(bundled_model_dir):
    """A feature not yet served under the V2 runner is refused when the engine is built, naming
    its flag (the rule: features.model_runner_error; every feature: tests/test_features.py)."""
    policy, chunk = CASES["snapkv-patched-0.5"]
    proc = run_v2(bundled_model_dir, policy, chunk, [[1, 2, 3]], kv_cache_dtype="fp8")
    assert proc.returncode != 0 and "RESULT" not in proc.stdout
    assert ("KVPolicyError: VLLM_USE_V2_MODEL_RUNNER=1 (vLLM's V2 model runner) with --kv-policy "
            "snapkv is not supported with --kv-cache-dtype fp8 yet (untested)") in proc.stderr, \
        proc.stderr[-3000:]


@pytest.mark.parametrize("policy, max_len, pool_mib, new_tokens", [
    # token eviction: its blocks as the V2 runner's tables hold them (`runners.V2Blocks`)
    pytest.param({"policy": "snapkv", "sparsity": 0.9, "eviction": "patched"}, 640, 40, 100,
                 id="snapkv-patched", marks=slow),  # (CI's budget: 250 s on CI)
    # a head mask, prefix caching on: the recompute may hit the request's own prompt blocks
    pytest.param({"policy": "prulong", "sparsity": 0.7, "sink": 16, "window": 64}, 2048, 64,
                 200, id="prulong", marks=slow),
])
def test_v2_runner_preemption_replays_exactly(bundled_model_dir, tokenizer, hf_model, policy,
                                              max_len, pool_mib, new_tokens):
    """Stock admission (`--kv-admission vllm`) in a pool too small for six requests' decode
    growth (each step runs in Triton's interpreter, so the CI case is small): vLLM preempts, and the V2 runner gets a preempted request back as a new one
    (its block table overwritten; contract-tested). A preempted request's tokens are still the
    reference's at the chunks it reports (its recompute replays its first run's)."""
    policy = {**policy, "admission": "vllm"}
    caching = not KVPolicyConfig.from_dict(policy).patched
    prompts = source_prompts(tokenizer, [500] * 6)
    result = result_of(run_v2(bundled_model_dir, policy, 256, prompts, caching,
                              new_tokens=new_tokens, kv_cache_memory_bytes=pool_mib << 20,
                              max_model_len=max_len))
    assert result["runner"] == "vllm.v1.worker.cpu.model_runner"
    preempted = [(p, ids, s) for p, ids, s in zip(prompts, result["token_ids"],
                                                  result["kv_stats"]) if s["preemptions"]]
    assert preempted, [s["preemptions"] for s in result["kv_stats"]]
    prompt, got, stats = preempted[0]  # (a reference decode is slow: one)
    ref = reference(hf_model, bundled_model_dir, policy, prompt, stats["chunk_boundaries"],
                    new_tokens)
    assert got == list(ref.token_ids), stats["chunk_boundaries"]
