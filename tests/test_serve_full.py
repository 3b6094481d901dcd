"""`vllm serve --kv-policy full` on the bundled model: a sensible chat answer through the official
`openai` client, and greedy outputs identical to stock vLLM (our plugin disabled)."""

from __future__ import annotations

import openai
import pytest

from conftest import SERVED_NAME, skip_without_fp8_kv_cache, start_server

pytestmark = pytest.mark.server

PROMPTS = [
    "The three primary colors are",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a village at the edge of a forest, there lived",
]


def greedy(base_url: str) -> list[tuple[list[int], list[float]]]:
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused")
    out = []
    for prompt in PROMPTS:
        r = client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=24,
                                      temperature=0, logprobs=1)
        lp = r.choices[0].logprobs
        out.append((lp.tokens, lp.token_logprobs))
    return out


@pytest.fixture(scope="module")
def stock_outputs(bundled_model_dir):
    # VLLM_PLUGINS names the plugins allowed to load; naming none of ours gives stock vLLM.
    server = start_server(bundled_model_dir, [], env={"VLLM_PLUGINS": "no-such-plugin"})
    return greedy(server.base_url)


@pytest.fixture(scope="module")
def full_server(bundled_model_dir, stock_outputs):
    # prompt-token details: the chat test reads vLLM's cached-token count
    return start_server(bundled_model_dir, ["--kv-policy", "full",
                                            "--enable-prompt-tokens-details"])


def test_chat_answer_is_sensible(full_server):
    client = openai.OpenAI(base_url=full_server.base_url + "/v1", api_key="unused")
    r = client.chat.completions.create(
        model=SERVED_NAME, temperature=0, max_tokens=16,
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "paris" in r.choices[0].message.content.lower()


def test_full_policy_is_bit_identical_to_stock(full_server, stock_outputs):
    ours = greedy(full_server.base_url)
    for (tok_a, lp_a), (tok_b, lp_b) in zip(ours, stock_outputs):
        assert tok_a == tok_b
        assert lp_a == lp_b  # bit for bit, not approximately


def test_multi_turn_chat_workload_hits_the_prefix_cache(full_server, tokenizer):
    """loadtest.chat on vLLM itself (`full` keeps vLLM's prefix caching): every turn is the
    previous prompt + its greedy answer + a new user text, and vLLM serves from its cache
    every whole 128-token block the conversation (or, on turn 1, the shared system prompt)
    already computed."""
    import asyncio

    from loadtest.chat import ChatShape, run_chat

    shape = ChatShape(conversations=2, turns=3, system_len=256, user_len=64, output_len=64)
    run = asyncio.run(run_chat(tokenizer, shape, base_url=full_server.base_url,
                               model=SERVED_NAME, concurrency=1, max_duration_s=300.0))
    turns = run["turns"]
    assert len(turns) == 6 and all(x["outcome"] == "ok" for x in turns)
    assert [x["prompt_tokens"] for x in turns] == [320, 448, 576] * 2
    # the previous turn computed its prompt and all but the last answer token: 320 + 63 ->
    # 2 blocks, 448 + 63 -> 3; conversation 1's first turn finds the system prompt
    assert [x["cached_tokens"] for x in turns] == [0, 256, 384, 256, 256, 384]
    assert all(len(x["answer_ids"]) == 64 and x["kv_bytes_peak"] > 0 for x in turns)
    # vLLM's own counters over the run: cached tokens / prompt tokens looked up
    assert run["server"]["prefix_cache_hit_rate"] == pytest.approx(1536 / 2688, abs=0.02)


@pytest.mark.slow
def test_full_policy_fp8_is_stock(bundled_model_dir):
    """An fp8 KV cache under `full` is stock vLLM's (same quantized attention), tokens and
    log-probs bit for bit; the evicting policies refuse fp8 at start-up (test_features.py)."""
    skip_without_fp8_kv_cache()
    fp8 = ["--kv-cache-dtype", "fp8"]
    stock = greedy(start_server(bundled_model_dir, fp8,
                                env={"VLLM_PLUGINS": "no-such-plugin"}).base_url)
    ours = greedy(start_server(bundled_model_dir, ["--kv-policy", "full", *fp8]).base_url)
    assert ours == stock
