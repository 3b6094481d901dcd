"""Worker side of chunked token eviction (snapkv, pyramidkv): the per-request ledgers, which
build each step's plan (`attention/token_step.py`: physical slots and lengths per layer, the
chunks to compress, the patched question rows) and book each compressed chunk, dropping the
same tail blocks from vLLM's worker-side block lists as the scheduler frees
(`token_ledger.py`). The shared maths is `vllm_kvevict/ledger.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from vllm_kvevict.integration.attention.decode_eviction import DecodePlan, plan_decode_row
from vllm_kvevict.integration.attention.token_step import EvictionJob, TokenStepPlan
from vllm_kvevict.ledger import (LayerGroups, cached_decode_group_budgets, decode_group_evictions,
                                 evicted_at_boundary, eviction_chunk_len, group_evictions_of)
from vllm_kvevict.policies import KVPolicy


@dataclass
class RequestLedger:
    """Worker-side record of one request."""

    evicted: list[int]              # per layer: logical - physical tokens
    allocation_evicted: list[int]   # per KV-cache group: the scheduler's count (slots given back)


class TokenEvictionWorker:
    def __init__(self, policy: KVPolicy, block_size: int, groups: LayerGroups | None = None,
                 for_request: Callable[[Any], KVPolicy] | None = None):
        self.policy = policy
        # extra_args -> the request's policy (ServedPolicy.for_request; overrides applied)
        self.policy_for = for_request or (lambda extra_args: policy)
        self.block_size = block_size
        self.groups = groups or LayerGroups.single(policy.num_layers)
        self.ledgers: dict[str, RequestLedger] = {}
        self.decode_queries: dict[str, dict] = {}  # req_id -> {layer: [k, Hq, d]}
        self.combine_scores = None  # (TokenStepPlan.combine_scores; set by the worker state)
        self.reuses_prefixes = False  # vLLM's prefix caching on (prefix_cache.py)

    def release(self, req_ids) -> None:
        for req_id in req_ids or ():
            self.ledgers.pop(req_id, None)
            self.decode_queries.pop(req_id, None)

    def plan(self, req_ids: list[str], computed: list[int], query_lens: list[int],
             prompt_lens: list[int], block_ids: list[list[list[int]]],
             prompt_ids=None, extra_args=None) -> TokenStepPlan:
        """block_ids[row][group]: the row's block ids in each KV-cache group;
        prompt_ids(row) -> the row's prompt token ids (needed by patched scoring only);
        extra_args(row) -> the request's sampling extra_args (per-request overrides)."""
        L, bs, G = self.policy.num_layers, self.block_size, self.groups.num_groups
        rows, jobs, decode = len(req_ids), [], DecodePlan()
        seq_lens = torch.zeros(L, rows, dtype=torch.int32)
        phys_before = torch.zeros(L, rows, dtype=torch.long)
        for r, (req_id, a, c, n) in enumerate(zip(req_ids, computed, query_lens, prompt_lens)):
            led = self.ledgers.get(req_id)
            if led is None or a == 0:  # new, restarted after preemption, or a prefix hit
                led = self.ledgers[req_id] = self._new_ledger(a if a < n else 0)
            before = torch.tensor([a - e for e in led.evicted])
            phys_before[:, r] = before
            seq_lens[:, r] = (before + c).int()
            if a + c > n:  # decode
                if self.policy.config.decode_budget is not None:  # (a server setting)
                    plan_decode_row(self.policy_for(extra_args(r) if extra_args else None),
                                    req_id, r, a, a + c, n, (before + c).tolist(), decode)
                continue
            chunk_len = eviction_chunk_len(self.policy.config, a, c)  # raises on a crossing
            if self.policy.config.is_eviction_point(a + c, n):  # compress the chunk
                policy = self.policy_for(extra_args(r) if extra_args else None)
                is_final = a + c == n
                k = 0 if is_final else policy.config.question_rows(n)
                question = list(prompt_ids(r)[n - k:n]) if k else []
                jobs.append(EvictionJob(
                    req_id=req_id, row=r, computed=a, start=0, end=0, is_final=is_final,
                    phys_before=(before - (chunk_len - c)).tolist(), question=question,
                    policy=policy, chunk_len=chunk_len,
                    keep=[policy.chunk_keep(l, chunk_len, is_final) for l in range(L)]))
        width = max((len(b) for row in block_ids for b in row), default=1) or 1
        table = torch.zeros(G, rows, width, dtype=torch.int32)
        for r, row in enumerate(block_ids):
            for g, b in enumerate(row[:G]):
                table[g, r, : len(b)] = torch.tensor(b, dtype=torch.int32)
        q_start = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(),
                               dtype=torch.int32)
        for job in jobs:
            job.start, job.end = int(q_start[job.row]), int(q_start[job.row + 1])
        token_row = torch.repeat_interleave(torch.arange(rows), torch.tensor(query_lens))
        token_off = torch.arange(len(token_row)) - q_start[:-1].long()[token_row]
        pos = phys_before[:, token_row] + token_off            # [L, T]
        plan = TokenStepPlan(num_reqs=rows, query_start_loc=q_start, block_table=table,
                             seq_lens=seq_lens, slots=None, jobs=jobs, block_size=bs,
                             layer_group=self.groups.of_layer, num_tokens=len(token_row),
                             decode=decode.at_tokens(q_start, self.decode_queries),
                             combine_scores=self.combine_scores)
        patched = [j for j in jobs if j.question]
        if patched:
            self._add_questions(plan, patched, token_row, pos, phys_before)
        else:
            plan.slots = self._slots(table, token_row, pos)
        return plan

    def _new_ledger(self, computed: int) -> RequestLedger:
        """A request first seen with `computed` tokens done: 0, or a prefix hit at a chunk
        boundary (prefix_cache.py; warm-up rows, which hold nothing, start at 0 too)."""
        chunk = self.policy.config.eviction_chunk
        if not (self.reuses_prefixes and computed and chunk) or computed % chunk:
            return RequestLedger([0] * self.policy.num_layers, [0] * self.groups.num_groups)
        return RequestLedger(*evicted_at_boundary(self.policy, computed, self.groups))

    def _slots(self, table: torch.Tensor, token_row: torch.Tensor, pos: torch.Tensor):
        """[L, T] physical slots: token t of layer l at pos[l, t] in its row of l's group."""
        bs = self.block_size
        group = torch.tensor(self.groups.of_layer, dtype=torch.long).unsqueeze(1)   # [L, 1]
        blocks = table[group, token_row.unsqueeze(0), pos // bs]                    # [L, T]
        return blocks.long() * bs + pos % bs

    def _add_questions(self, plan, patched, token_row, pos, phys_before) -> None:
        """Patched scoring: each non-final chunk's question (the prompt's last k tokens) runs as
        extra rows at logical positions right after the chunk and physical slots right after
        it (the scheduler reserved them); the kernel sees them as extra sequences that share
        their request's block rows. Their KVs end up past the kept length: dropped."""
        ids, positions, rows, offs = [], [], [], []
        q_lens, seq_extra = [], []
        start = plan.num_tokens
        for job in patched:
            k, c = len(job.question), job.end - job.start
            job.question_start = start
            start += k
            ids += job.question
            positions += range(job.computed + c, job.computed + c + k)
            rows += [job.row] * k
            offs.append(torch.arange(k) + c)
            q_lens.append(k)
            seq_extra.append(phys_before[:, job.row] + c + k)
        rows_t = torch.tensor(rows)
        q_pos = phys_before[:, rows_t] + torch.cat(offs)                    # [L, Q]
        all_rows = torch.cat([token_row, rows_t])
        all_pos = torch.cat([pos, q_pos], dim=1)
        plan.slots = self._slots(plan.block_table, all_rows, all_pos)
        plan.question_ids = torch.tensor(ids, dtype=torch.long)
        plan.question_positions = torch.tensor(positions, dtype=torch.long)
        ends = plan.query_start_loc[-1].item() + torch.tensor(q_lens).cumsum(0)
        plan.query_start_loc = torch.cat([plan.query_start_loc, ends.int()])
        plan.seq_lens = torch.cat([plan.seq_lens, torch.stack(seq_extra, 1).int()], dim=1)
        plan.block_table = torch.cat([plan.block_table,
                                      plan.block_table[:, [j.row for j in patched]]], dim=1)
        plan.num_reqs += len(patched)

    def finish_step(self, plan: TokenStepPlan, request_block_ids, row_block_counts) -> None:
        """After the forward: book the compressed chunks and drop the tail blocks from vLLM's
        worker-side block lists, exactly as the scheduler frees them before its next step.

        request_block_ids(req_id) -> the request's block-id lists, one per group (mutable);
        row_block_counts[g]: the persistent batch's per-row block counts of group g (mutable)."""
        for job in plan.jobs:
            led = self.ledgers[job.req_id]
            c, chunk_len = job.end - job.start, job.chunk_len
            kept = [k.kept for k in job.keep]
            led.evicted = [e + chunk_len - k for e, k in zip(led.evicted, kept)]
            freed = group_evictions_of(kept, chunk_len, self.groups)
            led.allocation_evicted = [a + f for a, f in zip(led.allocation_evicted, freed)]
            self._drop_tail_blocks(led, job.req_id, job.row, job.computed + c,
                                   request_block_ids, row_block_counts)
        for job in plan.decode.jobs:
            led = self.ledgers[job.req_id]
            end = job.end
            led.evicted = [e if k is None else e + k.chunk_len - k.kept
                           for e, k in zip(led.evicted, job.keep)]
            freed = decode_group_evictions(cached_decode_group_budgets(job.policy, self.groups),
                                           [end - a for a in led.allocation_evicted])
            led.allocation_evicted = [a + f for a, f in zip(led.allocation_evicted, freed)]
            self._drop_tail_blocks(led, job.req_id, job.row, end, request_block_ids,
                                   row_block_counts)

    def _drop_tail_blocks(self, led: RequestLedger, req_id: str, row: int, end: int,
                          request_block_ids, row_block_counts) -> None:
        """Drop, from vLLM's worker-side block lists of every group, the blocks past the
        request's physical length after a step that ended at logical `end`."""
        per_group = request_block_ids(req_id)
        if per_group is None:
            return
        for g, ids in enumerate(per_group):
            own = -(-(end - led.allocation_evicted[g]) // self.block_size)
            if len(ids) > own:
                del ids[own:]
                row_block_counts[g][row] = own
