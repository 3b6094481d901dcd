"""Decode-time eviction's step (snapkv, pyramidkv with `decode_budget`): after every
`decode_interval`-th decode step of a request, each layer's whole KV is read back from the
paged cache, scored by the queries of the request's last k decode steps (the worker's ledger
keeps them), and its kept tokens rewritten from physical slot 0 of the layer's block row. The
scheduler frees the same tail blocks (`token_ledger.py`), the worker books them
(`TokenEvictionWorker.finish_step`); the shared maths is `vllm_kvevict/ledger.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from vllm_kvevict.policies import KVPolicy


@dataclass
class DecodeJob:
    """A decode-time compression after this step's attention: each layer's whole KV
    (`keep[l].chunk_len` tokens, this step's included) scored and cut to its decode budget."""

    req_id: str
    row: int
    end: int                      # logical tokens after this step
    keep: list                    # per layer: ChunkKeep, or None (the layer is within budget)
    policy: KVPolicy


@dataclass
class DecodePlan:
    """A step's decode-time eviction: the compressions after it, and the decode queries kept
    for them (`observe`: (req_id, token index in the step, slot); `observed[req_id][layer][slot]`
    holds query [Hq, d] of one of the request's last k decode steps (the layer's full heads'
    under a head mask); `rows[req_id]` = k)."""

    jobs: list[DecodeJob] = field(default_factory=list)
    observe: list[tuple] = field(default_factory=list)
    rows: dict[str, int] = field(default_factory=dict)
    observed: dict[str, dict[int, torch.Tensor]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.jobs or self.observe)

    def at_tokens(self, query_start: torch.Tensor, observed: dict) -> "DecodePlan":
        """`observe` by token index in the step (row start + offset), over the worker's
        buffers."""
        self.observe = [(req, int(query_start[row]) + j, slot)
                        for req, row, j, slot in self.observe]
        self.observed = observed
        return self


def plan_decode_row(policy: KVPolicy, req_id: str, row: int, start: int, end: int,
                    prompt_len: int, lengths: list[int], plan: DecodePlan) -> None:
    """A decode row whose step runs logical [start, end) (one generated token, or part of a
    teacher-forced tail, which the scheduler never lets cross a compression point), its layers
    then holding `lengths`: its tokens among the last k before a compression keep their
    queries; a step ending at a compression point compresses."""
    cfg = policy.config
    k, interval = cfg.decode_obs_rows, cfg.decode_interval
    for j, position in enumerate(range(start, end)):
        since = (position - prompt_len) % interval  # (generated in the cache after it) - 1
        if since >= interval - k:
            plan.observe.append((req_id, row, j, since - (interval - k)))
            plan.rows[req_id] = k
    if cfg.is_decode_compression(end, prompt_len):
        plan.jobs.append(DecodeJob(req_id=req_id, row=row, end=end, policy=policy,
                                   keep=[policy.decode_keep(layer, n)
                                         for layer, n in enumerate(lengths)]))


def compress_decode(plan, layer: int, query: torch.Tensor,
                    read_all: Callable[[DecodeJob, int], tuple]
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Decode-time eviction in one layer of a `TokenStepPlan`: keep this step's decode queries
    that a compression will score with, then compress each job's KV back to the layer's
    decode budget (the last k tokens always, the best-scored others): (K [n, H, d], V,
    physical slots [n]) to write, from slot 0 of the request's row (None: nothing to write).
    `read_all(job, count)` -> (K, V) [count, H, d]: the request's first `count` physical
    tokens of this layer from the paged cache (this step's token written already)."""
    decode = plan.decode
    for req_id, token, slot in decode.observe:
        # per layer: a head mask's layers hold different numbers of full (query) heads
        bufs = decode.observed.setdefault(req_id, {})
        if layer not in bufs:
            bufs[layer] = query.new_empty(decode.rows[req_id], *query.shape[1:])
        bufs[layer][slot] = query[token]
    out_k, out_v, out_slots = [], [], []
    for job in decode.jobs:
        keep = job.keep[layer]
        if keep is None:
            continue
        keys, values = read_all(job, keep.chunk_len)
        obs_q = decode.observed[job.req_id][layer].transpose(0, 1)        # [Hq, k, d]
        scores = plan.scores(job.policy, obs_q, keys.transpose(0, 1),
                             keep.chunk_len - keep.window, keep.window)
        idx = job.policy.select(scores, keep.selected, keep.chunk_len, keep.window)
        heads = torch.arange(keys.shape[1])
        out_k.append(keys[idx.T, heads])                                 # [kept, H, d]
        out_v.append(values[idx.T, heads])
        out_slots.append(plan.physical_slots(layer, job.row, torch.arange(idx.shape[1])))
    if not out_k:
        return None
    return torch.cat(out_k), torch.cat(out_v), torch.cat(out_slots)
