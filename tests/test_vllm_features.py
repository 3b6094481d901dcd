"""vLLM features a user turns on next to a policy (issue: installing into the user's vLLM):
vLLM's compile mode (no --enforce-eager) and a KV connector of the user's own. Each composes
exactly (served tokens equal the reference oracle) or is refused at start-up."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from conftest import SERVED_NAME, start_server
from test_policies_vllm import CASES, flags, reference, source_prompts

pytestmark = pytest.mark.server

NEW_TOKENS = 12


def complete(server, prompt, max_tokens: int = NEW_TOKENS):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")
    r = client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=max_tokens,
                                  temperature=0)
    return r.choices[0].text, r.model_extra.get("kv_stats")


# a head-mask policy and a token-eviction one with patched question rows and 30 KV-cache groups.
# CI: a head mask with patched token eviction (head-mask rows and question rows through the
# compiled graph); all in the slow tier (CI's budget: 219 s on CI for the hybrid alone)
@pytest.mark.slow
@pytest.mark.parametrize("case", ["prulong-0.7", "pyramidkv-patched-0.7", "snapkv-naive-0.5-decode",
                                  "hybrid-prulong-0.5-snapkv-patched-0.5"])
def test_compiled_mode_matches_reference(case, bundled_model_dir, tokenizer, hf_model):
    """Without --enforce-eager vLLM compiles the model (torch.compile, piecewise around the
    attention op, which runs our backend eagerly): tokens must still be the reference's."""
    policy, chunk = CASES[case]
    server = start_server(bundled_model_dir, flags(policy, chunk), eager=False)
    log = server.log_path.read_text(errors="replace")
    compiled = re.search(r"saved AOT compiled function|Directly load AOT compilation", log)
    assert "enforce_eager=False" in log and compiled, "the server did not compile the model"
    for prompt in source_prompts(tokenizer, (700, 1600)):
        text, stats = complete(server, prompt)
        ref = reference(hf_model, bundled_model_dir, policy, prompt, chunk)
        assert text == tokenizer.decode(ref.token_ids), (case, len(prompt))
        assert stats is not None and stats["policy"] == policy["policy"]


@pytest.mark.slow
def test_compiled_mode_with_larger_full_blocks_matches_reference(bundled_model_dir, tokenizer,
                                                                 hf_model):
    """Compile mode with the full heads in 128-token blocks beside 32-token streaming blocks
    (`--kv-full-block-size`): block sizes stay outside the compiled graph (attention runs
    eagerly in our backend); tokens are the reference's."""
    policy = {"policy": "prulong", "sparsity": 0.7, "sink": 32, "window": 64,
              "eviction_chunk": 256, "full_block_size": 128}
    server = start_server(bundled_model_dir, [*flags(policy, 320), "--block-size", "32"],
                          eager=False)
    log = server.log_path.read_text(errors="replace")
    assert "enforce_eager=False" in log and "kv cache group sizes (128" in log
    for prompt in source_prompts(tokenizer, (700, 1100)):
        text, stats = complete(server, prompt)
        ends = list(range(256, len(prompt), 256)) + [len(prompt)]
        assert stats["chunk_boundaries"] == ends
        ref = reference(hf_model, bundled_model_dir, policy, prompt, ends)
        assert text == tokenizer.decode(ref.token_ids), len(prompt)


def example_connector(path: Path) -> str:
    return json.dumps({"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                       "kv_connector_extra_config": {"shared_storage_path": str(path)}})


def test_full_policy_with_the_users_kv_connector_keeps_kv_stats(bundled_model_dir, tokenizer,
                                                                  hf_model, tmp_path):
    """vLLM's ExampleConnector (saves every request's KV to disk, loads it back on a prefix
    match) beside our stats connector, through vLLM's MultiConnector: same tokens as the
    reference (i.e. stock vLLM), kv_stats on, the connector's files written, and a second run
    of the prompt (a cache hit) answers the same."""
    server = start_server(bundled_model_dir, ["--kv-policy", "full", "--kv-transfer-config",
                                              example_connector(tmp_path)])
    log = server.log_path.read_text(errors="replace")
    assert "MultiConnector" in log
    prompt = source_prompts(tokenizer, (600,))[0]
    ref = tokenizer.decode(reference(hf_model, bundled_model_dir, {"policy": "full"}, prompt,
                                     8192).token_ids)
    first, stats = complete(server, prompt)
    assert first == ref
    assert stats is not None and stats["policy"] == "full" and stats["prompt_tokens"] == 600
    assert any(tmp_path.iterdir()), "the ExampleConnector saved nothing: it did not run"
    again, stats = complete(server, prompt)
    assert again == ref and stats is not None
    info = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")
    assert info.get("/kv_stats", cast_to=dict)["enabled"] is True


def test_evicting_policy_with_a_kv_connector_is_refused_at_startup(bundled_model_dir, tmp_path):
    vllm = Path(sys.executable).parent / "vllm"
    proc = subprocess.run([str(vllm), "serve", str(bundled_model_dir), "--kv-policy", "prulong",
                           "--kv-transfer-config", example_connector(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("vllm-kvevict: error: --kv-transfer-config connector(s) "
                           "ExampleConnector cannot be combined with --kv-policy prulong"), last
    assert "Loading weights" not in proc.stderr + proc.stdout
