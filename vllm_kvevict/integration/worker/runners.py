"""What the policies read of vLLM's model runner, under either of its two runners.

- V1 (`v1/worker/gpu_model_runner.py`, vLLM's CPU default): a persistent batch
  (`runner.input_batch`) whose row order the attention metadata follows, and `runner.requests`.
- V2 (`v1/worker/gpu/model_runner.py`, `VLLM_USE_V2_MODEL_RUNNER=1`; CUDA's default from 0.33):
  no persistent batch; each row names its request's slot (`CommonAttentionMetadata.req_idx`,
  `runner.req_states`), and the layers sharing another's cache come from the config.

The one thing written into a runner is token eviction's tail-block drop (`V1Blocks` /
`V2Blocks.row_counts`), mirroring what the scheduler frees. Design: docs/design/worker.md.
"""

from __future__ import annotations

from vllm_kvevict.overrides import policy_prompt_len


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


def policy_prompt_lens(runner, req_ids: list[str], extra_args: dict) -> list[int]:
    """Each request's prompt as the policy serves it (a teacher-forced tail is decoded);
    `extra_args`: request id -> its per-request overrides."""
    return [policy_prompt_len(n, extra_args.get(r))
            for r, n in zip(req_ids, prompt_tokens(runner, req_ids))]


def prompt_tokens(runner, req_ids: list[str]) -> list[int]:
    """Each request's prompt length in tokens, as vLLM's runner holds it."""
    if is_v2(runner):
        states = runner.req_states
        return [int(states.prompt_len.np[states.req_id_to_index[r]]) for r in req_ids]
    return [int(n) for n in runner.input_batch.num_prompt_tokens[: len(req_ids)]]


# -- token eviction: each request's blocks on the worker ----------------------------------------

def request_blocks(runner):
    return V2Blocks(runner) if is_v2(runner) else V1Blocks(runner)


class V1Blocks:
    """The V1 runner's per-request records (`runner.requests`) and persistent batch."""

    def __init__(self, runner) -> None:
        self.runner = runner

    def update(self, scheduler_output) -> None:
        pass  # the runner keeps its own records

    def block_ids(self, req_id: str) -> list[list[int]] | None:
        request = self.runner.requests.get(req_id)
        return None if request is None else request.block_ids

    def prompt_ids(self, req_id: str) -> list[int]:
        return self.runner.requests[req_id].prompt_token_ids

    def row_counts(self, req_ids: list[str]) -> list:
        """Per group: the batch's per-row block counts, by row (mutable)."""
        return [t.num_blocks_per_row for t in self.runner.input_batch.block_table.block_tables]


class V2Blocks:
    """The V2 runner holds block ids only in its block-table tensors (device memory on a GPU):
    a host copy per request, kept from the scheduler's output exactly as the runner keeps its
    tables (`add_requests` overwrites a new request's, `update_requests` appends), and the
    runner's per-slot block counts (`block_tables.num_blocks`, host side; copied to the device
    at the start of each step)."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.blocks: dict[str, list[list[int]]] = {}
        self.prompts: dict[str, list[int]] = {}

    def update(self, scheduler_output) -> None:
        for new in scheduler_output.scheduled_new_reqs:
            self.blocks[new.req_id] = [list(ids) for ids in new.block_ids]
            self.prompts[new.req_id] = new.prompt_token_ids
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, new_ids in zip(cached.req_ids, cached.new_block_ids):
            if new_ids is not None and req_id in self.blocks:
                for own, more in zip(self.blocks[req_id], new_ids):
                    own.extend(more)
        for req_id in scheduler_output.finished_req_ids:
            self.blocks.pop(req_id, None)
            self.prompts.pop(req_id, None)

    def block_ids(self, req_id: str) -> list[list[int]] | None:
        return self.blocks.get(req_id)

    def prompt_ids(self, req_id: str) -> list[int]:
        return self.prompts[req_id]

    def row_counts(self, req_ids: list[str]) -> list:
        slots = [self.runner.req_states.req_id_to_index[r] for r in req_ids]
        counts = self.runner.block_tables.num_blocks.np
        return [_SlotCounts(counts[g], slots) for g in range(counts.shape[0])]


class _SlotCounts:
    """One group's block counts, indexed by the step's row (the runner's are by slot)."""

    def __init__(self, counts, slots: list[int]) -> None:
        self.counts, self.slots = counts, slots

    def __setitem__(self, row: int, n: int) -> None:
        self.counts[self.slots[row]] = n
