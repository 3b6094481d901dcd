"""What the policies read of vLLM's model runner, under either of its two runners.

- V1, `v1/worker/gpu_model_runner.py`: what vLLM's CPU worker builds by default. A persistent
  batch (`runner.input_batch`) whose row order the attention metadata follows, and a record per
  request (`runner.requests`).
- V2, `v1/worker/gpu/model_runner.py` (`VLLM_USE_V2_MODEL_RUNNER=1`; on CPU 0.32 it needs
  Triton's CPU backend; CUDA's default from vLLM 0.33): no persistent batch. Each step's rows
  name their request's slot in the runner's request table (`CommonAttentionMetadata.req_idx`,
  `runner.req_states`), and the layers sharing another's cache come from the config
  (`attn_utils.get_shared_kv_cache_layers`), not from the runner.

Everything here reads; nothing writes into either runner.
"""

from __future__ import annotations


def is_v2(runner) -> bool:
    """The V2 runner keeps its requests in `req_states`; the V1 runner has none."""
    return hasattr(runner, "req_states") and not hasattr(runner, "input_batch")


def shared_layers(runner, vllm_config) -> dict[str, str]:
    """Layer name -> the layer whose KV cache it reads (KV sharing)."""
    if not is_v2(runner):
        return dict(getattr(runner, "shared_kv_cache_layers", None) or {})
    from vllm.v1.worker.gpu.attn_utils import get_shared_kv_cache_layers

    return dict(get_shared_kv_cache_layers(vllm_config) or {})


def row_requests(runner, common, num_reqs: int, in_step: bool = True) -> list[str] | None:
    """The request id of each of the step's first `num_reqs` rows, in the attention metadata's
    order; None when the rows are not requests (vLLM's profile, warm-up and padding runs).
    `in_step`: the call comes from inside a scheduled step (`KVEvictWorker.execute_model`);
    the V2 runner's dummy runs number their rows 0..n-1 like real slots, so only that tells
    them apart."""
    if is_v2(runner):
        index = getattr(common, "req_idx", None)
        if not in_step or index is None or len(index) < num_reqs:
            return None
        names = runner.req_states.index_to_req_id
        req_ids = [names.get(int(i)) for i in index[:num_reqs]]
    else:
        req_ids = list(getattr(getattr(runner, "input_batch", None), "req_ids", []) or [])
        req_ids = req_ids[:num_reqs]
    if len(req_ids) < num_reqs or any(r is None for r in req_ids):
        return None
    return req_ids


def prompt_tokens(runner, req_ids: list[str]) -> list[int]:
    """Each request's prompt length in tokens, as vLLM's runner holds it."""
    if is_v2(runner):
        states = runner.req_states
        return [int(states.prompt_len.np[states.req_id_to_index[r]]) for r in req_ids]
    return [int(n) for n in runner.input_batch.num_prompt_tokens[: len(req_ids)]]
