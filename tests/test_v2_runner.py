"""vLLM's V2 model runner (`vllm/v1/worker/gpu/model_runner.py`, CUDA's default from vLLM 0.33)
serving head-mask policies, executed here: vLLM 0.32's CPU worker builds it when Triton is on,
and its Triton kernels run in Triton's interpreter (`triton_interpreter.py`). Tokens ==
the plain-PyTorch reference, for a batch whose rows the V2 runner orders itself, and again for
a prefix-cache hit; on vLLM's CPU attention and on the portable FlexAttention path. What the
plugin does not serve under the V2 runner yet (token eviction) is refused at start-up."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from test_policies_vllm import CASES, reference, source_prompts

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
    policy, chunk, prompts, new_tokens = json.loads(sys.argv[1])
    llm = LLM(model=sys.argv[2], additional_config={"kv_policy": policy}, enforce_eager=True,
              dtype="float32", max_model_len=4096, kv_cache_memory_bytes=256 << 20,
              max_num_batched_tokens=chunk, enable_prefix_caching=True, seed=0)
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    params = SamplingParams(temperature=0, max_tokens=new_tokens)
    batch = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    [again] = llm.generate([{"prompt_token_ids": prompts[0]}], params)  # a prefix-cache hit
    print("RESULT " + json.dumps({
        "runner": type(runner).__module__,
        "token_ids": [list(o.outputs[0].token_ids) for o in batch + [again]],
        "kv_stats": [o.kv_transfer_params["kv_stats"] for o in batch + [again]]}))
""")


def run_v2(model_dir, policy, chunk, prompts) -> subprocess.CompletedProcess:
    """In a subprocess: Triton's interpreter must be on before vLLM is imported, and vLLM's
    engine core and its plugin state belong to one process."""
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "VLLM_USE_V2_MODEL_RUNNER": "1",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    return subprocess.run([sys.executable, "-c", SCRIPT,
                           json.dumps([policy, chunk, prompts, NEW_TOKENS]), str(model_dir),
                           str(TESTS)], capture_output=True, text=True, timeout=1200, cwd=REPO,
                          env=env)


def result_of(proc) -> dict:
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


@pytest.mark.parametrize("case, backend", [
    ("prulong-0.7", "cpu"), ("prulong-0.7", "flex"),
    pytest.param("full", "cpu", marks=pytest.mark.slow),
    pytest.param("streaming", "cpu", marks=pytest.mark.slow),
    pytest.param("duo-0.3", "cpu", marks=pytest.mark.slow)])
def test_v2_runner_serves_head_masks_as_the_reference(bundled_model_dir, tokenizer, hf_model,
                                                      case, backend):
    policy, chunk = CASES.get(case, ({"policy": "full"}, 256))
    policy = {**policy, "attention_backend": backend}
    prompts = source_prompts(tokenizer, (700, 1600, 1000))
    result = result_of(run_v2(bundled_model_dir, policy, chunk, prompts))
    assert result["runner"] == "vllm.v1.worker.cpu.model_runner"  # the V2 runner, not V1's
    for prompt, got in zip(prompts + prompts[:1], result["token_ids"]):
        ref = reference(hf_model, bundled_model_dir, policy, prompt, chunk, NEW_TOKENS)
        assert got == list(ref.token_ids)
    stats = result["kv_stats"]
    assert stats[-1]["cached_tokens"] > 0  # the repeat was served from cached blocks
    for s in stats:  # full attention holds what it reads; a head mask holds less
        assert s["measured_footprint"] == 1 if case == "full" else 0 < s["measured_footprint"] < 1


def test_v2_runner_refuses_token_eviction_at_start_up(bundled_model_dir):
    policy, chunk = CASES["snapkv-naive-0.5"]
    proc = run_v2(bundled_model_dir, policy, chunk, [[1, 2, 3]])
    assert proc.returncode != 0 and "RESULT" not in proc.stdout
    assert "VLLM_USE_V2_MODEL_RUNNER" in proc.stderr and "--kv-policy snapkv" in proc.stderr
