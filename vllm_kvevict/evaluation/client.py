"""One greedy /v1/completions request with token-id prompts, and the record it yields.

Non-streaming, no stop strings: a stop string makes vLLM abort the engine request, and an
aborted request carries no kv_stats (server/README.md, known limits); EOS and max_tokens are
fine. The record keeps the kv_stats fields the report uses plus the chunk boundaries, so a
reader can check the chunking the footprint was computed for.
"""

from __future__ import annotations

import time

import httpx

from vllm_kvevict.evaluation.grid import Setting
from vllm_kvevict.evaluation.tasks import TASKS, Example

SERVED_NAME = "smollm2"
KV_FIELDS = ("footprint", "peak_kv", "kv_bytes_peak", "measured_footprint", "chunk_boundaries",
             "prompt_tokens", "completion_tokens", "decode_steps", "ttft_s", "e2e_s",
             "preemptions", "overrides", "params")


class RequestError(RuntimeError):
    pass


def complete(client: httpx.Client, base_url: str, example: Example, setting: Setting,
             retries: int = 1) -> dict:
    body = {"model": SERVED_NAME, "prompt": list(example.prompt_ids),
            "max_tokens": example.max_tokens, "temperature": 0.0}
    if example.allowed_token_ids is not None:
        body["allowed_token_ids"] = list(example.allowed_token_ids)
    if setting.vllm_xargs:
        body["vllm_xargs"] = setting.vllm_xargs
    return post(client, base_url, body, f"{example.key} on {setting.key}", retries)


def gold_logprobs(client: httpx.Client, base_url: str, example: Example, setting: Setting,
                  retries: int = 1) -> list[float]:
    """log p(gold token i | prompt, gold[:i]) under the setting's policy: one request of
    prompt + gold with the gold tokens teacher-forced (`vllm_xargs.kv_teacher_forced`: served
    as decode tokens, as a greedy answer would be) and their prompt log-probs returned."""
    gold = list(example.gold_ids)
    body = {"model": SERVED_NAME, "prompt": list(example.prompt_ids) + gold, "max_tokens": 1,
            "temperature": 0.0, "prompt_logprobs": 0,
            "vllm_xargs": {**(setting.vllm_xargs or {}), "kv_teacher_forced": len(gold)}}
    what = f"{example.key} on {setting.key} (gold log-prob)"
    response = post(client, base_url, body, what, retries)
    kv = response.get("kv_stats") or {}
    if kv.get("teacher_forced_tokens") != len(gold):
        raise RequestError(f"{what}: the server did not teacher-force the gold tokens "
                           f"(kv_stats {kv.get('teacher_forced_tokens')!r})")
    rows = response["choices"][0]["prompt_logprobs"][-len(gold):]
    return [row[str(token)]["logprob"] for row, token in zip(rows, gold)]


def post(client: httpx.Client, base_url: str, body: dict, what: str, retries: int = 1) -> dict:
    for attempt in range(retries + 1):
        try:
            resp = client.post(f"{base_url}/v1/completions", json=body)
        except httpx.HTTPError as exc:
            if attempt == retries:
                raise RequestError(f"{what}: {exc!r}") from exc
            time.sleep(2.0)
            continue
        if resp.status_code == 200:
            return resp.json()
        if resp.status_code < 500 or attempt == retries:
            raise RequestError(f"{what}: HTTP {resp.status_code} {resp.text[:500]}")
        time.sleep(2.0)
    raise AssertionError("unreachable")


def to_record(example: Example, setting: Setting, response: dict, run_id: str,
              gold: list[float] | None = None) -> dict:
    choice = response["choices"][0]
    kv = response.get("kv_stats")
    if not kv:
        raise RequestError(f"{example.key} on {setting.key}: response without kv_stats")
    if kv["prompt_tokens"] != len(example.prompt_ids):
        raise RequestError(f"{example.key}: server saw {kv['prompt_tokens']} prompt tokens, "
                           f"sent {len(example.prompt_ids)}")
    prediction = choice["text"]
    server = setting.server
    return {
        "setting": setting.key, "method": server.policy, "eviction": server.eviction,
        "sparsity": setting.sparsity, "token_sparsity": server.token_sparsity,
        "chunk": server.chunk,
        "mask": server.mask, "mask_digest": setting.mask_digest,
        "example": example_id(example), "task": example.task, "category": example.category,
        "length": example.length, "index": example.index,
        "answers": list(example.answers), "prediction": prediction,
        "finish_reason": choice.get("finish_reason"), "score": example.score(prediction),
        **{k: kv.get(k) for k in KV_FIELDS}, "run": run_id, **gold_fields(gold),
    }


def gold_fields(gold: list[float] | None) -> dict:
    """The record's continuous score: the gold answer's mean token log-prob (None: not
    measured) and its token count."""
    return {"gold_logprob": sum(gold) / len(gold) if gold else None,
            "gold_tokens": len(gold) if gold else None}


def example_id(example: Example) -> str:
    """Task, length and index plus a digest of the prompt: if task generation changes, old
    records no longer match and are re-run instead of silently reused."""
    import hashlib

    digest = hashlib.sha256(repr(example.prompt_ids).encode()).hexdigest()[:10]
    return f"{example.key}/{digest}"


def is_current(record: dict) -> bool:
    """Whether a greedy record is the answer its task's generation budget gives today: one
    that stopped by itself within the budget, or that the budget cut at exactly its length.
    A record cut by a smaller budget than today's is superseded (the runner asks again; the
    report skips it): raising a budget must not leave answers cut at the old one."""
    task = TASKS.get(record.get("task"))
    tokens = record.get("completion_tokens")
    if task is None or tokens is None:
        return True
    if record.get("finish_reason") == "length":
        return tokens == task.max_tokens
    return tokens <= task.max_tokens
