"""vLLM's offline `LLM` class with a policy (no server): `LLM(model, additional_config={"kv_policy":
{...}})` goes through the same engine-config hook as `vllm serve`, serves the reference's
tokens, and each `RequestOutput` carries its kv_stats in `kv_transfer_params["kv_stats"]`.
A bad policy is refused when the `LLM` is built, naming the key."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from test_policies_vllm import CASES, reference, source_prompts
from vllm_kvevict.config import KVPolicyError

pytestmark = pytest.mark.server  # loads the model in this test's own engine

REPO = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""
    import json, sys
    from vllm import LLM, SamplingParams
    policy, chunk, prompt = json.loads(sys.argv[1])
    llm = LLM(model=sys.argv[2], additional_config={"kv_policy": policy}, enforce_eager=True,
              dtype="float32", max_model_len=4096, kv_cache_memory_bytes=256 << 20,
              max_num_batched_tokens=chunk, seed=0)
    [out] = llm.generate([{"prompt_token_ids": prompt}],
                         SamplingParams(temperature=0, max_tokens=12))
    print("RESULT " + json.dumps({"token_ids": list(out.outputs[0].token_ids),
                                  "kv_transfer_params": out.kv_transfer_params}))
""")


def run_llm(model_dir, policy, chunk, prompt) -> subprocess.CompletedProcess:
    """In a subprocess: vLLM's engine core and its plugin state belong to one process."""
    import json

    return subprocess.run([sys.executable, "-c", SCRIPT, json.dumps([policy, chunk, prompt]),
                           str(model_dir)], capture_output=True, text=True, timeout=900,
                          cwd=REPO, env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"})


def test_offline_llm_serves_the_reference_tokens_with_kv_stats(bundled_model_dir, tokenizer,
                                                               hf_model):
    import json

    policy, chunk = CASES["prulong-0.7"]
    [prompt] = source_prompts(tokenizer, (700,))
    proc = run_llm(bundled_model_dir, policy, chunk, prompt)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])
    ref = reference(hf_model, bundled_model_dir, policy, prompt, chunk)
    assert result["token_ids"][:len(ref.token_ids)] == list(ref.token_ids)
    stats = result["kv_transfer_params"]["kv_stats"]
    assert stats["policy"] == "prulong" and stats["prompt_tokens"] == 700
    assert 0 < stats["footprint"] < 1 and 0 < stats["measured_footprint"] < 1  # sink + window


def test_offline_llm_refuses_a_bad_policy_naming_the_key(bundled_model_dir):
    proc = run_llm(bundled_model_dir, {"policy": "prulong", "sparsity": 1.5}, 256, [1, 2, 3])
    assert proc.returncode != 0
    assert "sparsity" in proc.stderr and "RESULT" not in proc.stdout
    assert KVPolicyError.__name__ in proc.stderr, proc.stderr[-2000:]
