"""The token-eviction step as attention reads it (snapkv, pyramidkv): the step's physical slots
and lengths per layer (`TokenStepPlan`), the chunks to compress after attention (`EvictionJob`)
and their compression (`compress_chunks`). The worker's ledgers build it each step
(`worker/token_plan.py`); each attention backend runs it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from vllm_kvevict.integration.attention.decode_eviction import DecodePlan
from vllm_kvevict.policies import KVPolicy


@dataclass
class EvictionJob:
    """One eviction chunk to compress after attention. Its last `end - start` tokens are this
    step's batch tokens [start, end); the `chunk_len - (end - start)` before them ran in earlier
    steps (decoupled eviction chunk) and are read back from the paged cache."""

    req_id: str
    row: int
    computed: int                 # logical tokens before this step
    start: int
    end: int
    is_final: bool
    phys_before: list[int]        # per layer: physical length before the eviction chunk
    keep: list                    # per layer: ChunkKeep
    chunk_len: int = 0            # tokens of the eviction chunk (this step's and earlier ones)
    question: list[int] = field(default_factory=list)  # patched: the prompt's last k tokens
    policy: KVPolicy | None = None  # the request's (served policy + its overrides)
    question_start: int = 0       # their rows in the extended token axis [T, T + Q)


@dataclass
class TokenStepPlan:
    num_reqs: int
    query_start_loc: torch.Tensor    # int32 [num_reqs + 1]
    block_table: torch.Tensor        # int32 [G, num_reqs, width]: the request's blocks per group
    seq_lens: torch.Tensor           # int32 [L, num_reqs]: physical length incl. this step
    slots: torch.Tensor              # int64 [L, T]: physical slot of each new token
    jobs: list[EvictionJob]
    block_size: int
    layer_group: tuple[int, ...] = ()  # KV-cache group (block table) of each layer
    valid: bool = True
    kernel_schedules: dict = field(default_factory=dict)
    # Patched scoring: the question tokens run as extra rows after the batch's T tokens.
    num_tokens: int = 0                    # T
    question_ids: torch.Tensor | None = None        # long [Q]
    question_positions: torch.Tensor | None = None  # long [Q]
    question_offset: int = 0               # where they sit in the model's token axis
    streaming: object = None  # a head mask with a token policy: its streaming heads' StepPlan
    decode: DecodePlan = field(default_factory=DecodePlan)  # decode-time eviction
    # tensor parallel with replicated KV heads: a rank's scores (from its share of the head's
    # queries) -> the head's (all its queries'); None: each rank holds whole GQA groups
    combine_scores: Callable[[torch.Tensor], torch.Tensor] | None = None

    _on_device: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def on_device(self, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """(query_start_loc, seq_lens, block_table) as int32 on `device` and the longest
        query run: copied once a step (every layer's launch reads them; built on the host, so
        no sync)."""
        key = str(device)
        if key not in self._on_device:
            q_lens = self.query_start_loc[1:] - self.query_start_loc[:-1]
            self._on_device[key] = (*(t.to(device=device, dtype=torch.int32) for t in (
                self.query_start_loc, self.seq_lens, self.block_table)),
                int(q_lens.max()) if len(q_lens) else 0)
        return self._on_device[key]

    def scores(self, policy, obs_q, keys, obs_offset: int, window: int) -> torch.Tensor:
        out = policy.score(obs_q, keys, obs_offset=obs_offset, window=window)
        return out if self.combine_scores is None else self.combine_scores(out)

    @property
    def num_questions(self) -> int:
        return 0 if self.question_ids is None else int(self.question_ids.shape[0])

    def with_questions(self, x: torch.Tensor) -> torch.Tensor:
        """The batch's tokens of `x` (the model's token axis) followed by the patched-scoring
        question rows (if any)."""
        n = self.num_tokens
        if not self.num_questions:
            return x[:n]
        off = self.question_offset
        if off == n:  # (right after the batch's tokens, as without padding: a view)
            return x[:n + self.num_questions]
        return torch.cat([x[:n], x[off:off + self.num_questions]])

    def table(self, layer: int) -> torch.Tensor:
        """[num_reqs, width]: the block rows of the layer's group."""
        return self.block_table[self.layer_group[layer]]

    def physical_slots(self, layer: int, row: int, positions: torch.Tensor) -> torch.Tensor:
        bs = self.block_size
        return self.table(layer)[row, positions // bs].long() * bs + positions % bs


def compress_chunks(plan: TokenStepPlan, layer: int, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, read_past: Callable[[EvictionJob, int], tuple]
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Score each prefill chunk of the plan by its observation window and keep the best KVs
    per KV head: (K [n, H, d], V [n, H, d], physical slots [n]) to write back, contiguous at
    the layer's physical end of the past (None: no chunk). `query`/`key`/`value` are the
    model's token axis (the patched questions' rows at `plan.question_offset`); `read_past(job,
    count)` -> (K, V) [count, H, d] of a decoupled chunk's earlier steps from the paged cache
    (each attention backend reads its own layout)."""
    kept_k, kept_v, kept_slots = [], [], []
    heads = torch.arange(key.shape[1])
    for job in plan.jobs:
        policy = job.policy
        keep = job.keep[layer]
        c, step = job.chunk_len, job.end - job.start
        chunk_k, chunk_v = key[job.start:job.end], value[job.start:job.end]
        if c > step:  # the chunk's earlier steps: read back from the paged cache
            past_k, past_v = read_past(job, c - step)
            chunk_k, chunk_v = torch.cat([past_k, chunk_k]), torch.cat([past_v, chunk_v])
        if job.question:  # patched: the question's queries, positioned after the chunk
            first = plan.question_offset + job.question_start - plan.num_tokens
            obs_q = query[first:first + len(job.question)].transpose(0, 1)
            obs_offset = c
        else:  # naive, and every final chunk: the chunk's own last k queries
            num_obs = policy.config.observation_rows(c)
            if num_obs > step:  # the scheduler's step_cap prevents this; never guess
                raise RuntimeError(f"vllm-kvevict: the last step of an eviction chunk ran "
                                   f"{step} tokens, fewer than its {num_obs} observation "
                                   f"queries")
            obs_q = query[job.end - num_obs:job.end].transpose(0, 1)
            obs_offset = c - num_obs
        scores = plan.scores(policy, obs_q, chunk_k.transpose(0, 1), obs_offset, keep.window)
        idx = policy.select(scores, keep.selected, c, keep.window)  # [H, kept]
        kept_k.append(chunk_k[idx.T, heads])                        # [kept, H, d]
        kept_v.append(chunk_v[idx.T, heads])
        positions = job.phys_before[layer] + torch.arange(idx.shape[1])
        kept_slots.append(plan.physical_slots(layer, job.row, positions))
    if not kept_k:
        return None
    return torch.cat(kept_k), torch.cat(kept_v), torch.cat(kept_slots)
