"""Chunked token eviction (snapkv, pyramidkv) with real memory: kept KVs are compacted forward
and the freed tail blocks go back to vLLM's block pool during the request.

Two sides agree on one deterministic ledger (`allocation_evicted`):
- scheduler (engine core): a request holds blocks for `computed - allocation_evicted` tokens
  (+ the chunk it runs); when a prefill chunk of length c has run, allocation_evicted grows by
  c - max_l kept_l and the tail blocks past the new physical length are freed.
- worker: per layer the physical length (kept tokens). New tokens are written at physical
  positions, the kernel sees physical seq_lens, and after each prefill chunk a layer rewrites
  its kept tokens (per KV head, gathered from the forward's own K/V tensors, RoPE already
  applied) at [phys_before, phys_before + kept). At the end of the step the worker drops the
  same tail blocks from vLLM's (append-only) worker-side block lists, so both sides keep
  identical block lists and vLLM appends the next step's blocks after the kept ones.
Logical positions (RoPE of new tokens) are vLLM's own and never change.

PyramidKV's layers keep different counts; they share one block row sized for the largest layer
(layer 0), each layer using its own physical length. Per-layer-tier block tables would return
the difference too; that is not done yet.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vllm_kvevict.policies import KVPolicy


class RequestPolicies:
    """The served policy, with a request's `vllm_xargs` overrides (kv_sparsity, kv_obs_window)
    applied; one policy object per distinct setting."""

    def __init__(self, policy: KVPolicy):
        self.base = policy
        self._cache: dict = {}

    def __call__(self, extra_args) -> KVPolicy:
        from vllm_kvevict.integration.request_stats import effective_config
        from vllm_kvevict.policies import build_policy

        cfg, overrides = effective_config(self.base.config, extra_args)
        if not overrides:
            return self.base
        key = tuple(sorted(overrides.items()))
        if key not in self._cache:
            self._cache[key] = build_policy(cfg, self.base.num_layers, self.base.num_kv_heads)
        return self._cache[key]


def chunk_kept_per_layer(policy: KVPolicy, chunk_len: int, is_final: bool) -> list[int]:
    return [policy.chunk_keep(layer, chunk_len, is_final).kept
            for layer in range(policy.num_layers)]


def allocation_eviction(policy: KVPolicy, chunk_len: int, is_final: bool) -> int:
    """Tokens of a prefill chunk whose slots the request gives back (same in both processes)."""
    return chunk_len - max(chunk_kept_per_layer(policy, chunk_len, is_final))


# ------------------------------------------------------------------------------------------
# worker side
# ------------------------------------------------------------------------------------------
@dataclass
class RequestLedger:
    """Worker-side record of one request."""

    evicted: list[int]            # per layer: logical - physical tokens
    allocation_evicted: int = 0   # the scheduler's count (slots given back)


@dataclass
class EvictionJob:
    """One prefill chunk to compress after attention: batch tokens [start, end)."""

    req_id: str
    row: int
    computed: int
    start: int
    end: int
    is_final: bool
    phys_before: list[int]        # per layer
    keep: list                    # per layer: ChunkKeep
    question: list[int] = field(default_factory=list)  # patched: the prompt's last k tokens
    policy: KVPolicy | None = None  # the request's (served policy + its overrides)
    question_start: int = 0       # their rows in the extended token axis [T, T + Q)


@dataclass
class TokenStepPlan:
    num_reqs: int
    query_start_loc: torch.Tensor    # int32 [num_reqs + 1]
    block_table: torch.Tensor        # int32 [num_reqs, width]: the request's blocks
    seq_lens: torch.Tensor           # int32 [L, num_reqs]: physical length incl. this step
    slots: torch.Tensor              # int64 [L, T]: physical slot of each new token
    jobs: list[EvictionJob]
    block_size: int
    valid: bool = True
    kernel_schedules: dict = field(default_factory=dict)
    # Patched scoring: the question tokens run as extra rows after the batch's T tokens.
    num_tokens: int = 0                    # T
    question_ids: torch.Tensor | None = None        # long [Q]
    question_positions: torch.Tensor | None = None  # long [Q]
    question_offset: int = 0               # where they sit in the model's token axis

    @property
    def num_questions(self) -> int:
        return 0 if self.question_ids is None else int(self.question_ids.shape[0])

    def physical_slots(self, row: int, positions: torch.Tensor) -> torch.Tensor:
        bs = self.block_size
        return self.block_table[row, positions // bs].long() * bs + positions % bs


class TokenEvictionWorker:
    def __init__(self, policy: KVPolicy, block_size: int):
        self.policy = policy
        self.policy_for = RequestPolicies(policy)
        self.block_size = block_size
        self.ledgers: dict[str, RequestLedger] = {}

    def release(self, req_ids) -> None:
        for req_id in req_ids or ():
            self.ledgers.pop(req_id, None)

    def plan(self, req_ids: list[str], computed: list[int], query_lens: list[int],
             prompt_lens: list[int], block_ids: list[list[int]],
             prompt_ids=None, extra_args=None) -> TokenStepPlan:
        """prompt_ids(row) -> the row's prompt token ids (needed by patched scoring only);
        extra_args(row) -> the request's sampling extra_args (per-request overrides)."""
        L, bs = self.policy.num_layers, self.block_size
        rows, jobs = len(req_ids), []
        seq_lens = torch.zeros(L, rows, dtype=torch.int32)
        phys_before = torch.zeros(L, rows, dtype=torch.long)
        for r, (req_id, a, c, n) in enumerate(zip(req_ids, computed, query_lens, prompt_lens)):
            led = self.ledgers.get(req_id)
            if led is None or a == 0:  # new, or restarted after preemption
                led = self.ledgers[req_id] = RequestLedger(evicted=[0] * L)
            before = torch.tensor([a - e for e in led.evicted])
            phys_before[:, r] = before
            seq_lens[:, r] = (before + c).int()
            if a + c <= n and self.policy.evicts_tokens:  # a prefill chunk: compress it
                policy = self.policy_for(extra_args(r) if extra_args else None)
                is_final = a + c == n
                question = []
                if policy.config.patched and not is_final:
                    question = list(prompt_ids(r)[n - min(policy.config.obs_window, n):])
                jobs.append(EvictionJob(
                    req_id=req_id, row=r, computed=a, start=0, end=0, is_final=is_final,
                    phys_before=before.tolist(), question=question, policy=policy,
                    keep=[policy.chunk_keep(l, c, is_final) for l in range(L)]))
        width = max((len(b) for b in block_ids), default=1) or 1
        table = torch.zeros(rows, width, dtype=torch.int32)
        for r, b in enumerate(block_ids):
            table[r, : len(b)] = torch.tensor(b, dtype=torch.int32)
        q_start = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(),
                               dtype=torch.int32)
        for job in jobs:
            job.start, job.end = int(q_start[job.row]), int(q_start[job.row + 1])
        token_row = torch.repeat_interleave(torch.arange(rows), torch.tensor(query_lens))
        token_off = torch.arange(len(token_row)) - q_start[:-1].long()[token_row]
        pos = phys_before[:, token_row] + token_off            # [L, T]
        plan = TokenStepPlan(num_reqs=rows, query_start_loc=q_start, block_table=table,
                             seq_lens=seq_lens, slots=None, jobs=jobs, block_size=bs,
                             num_tokens=len(token_row))
        patched = [j for j in jobs if j.question]
        if patched:
            self._add_questions(plan, patched, token_row, pos, phys_before)
        else:
            plan.slots = table[token_row.expand(L, -1), pos // bs].long() * bs + pos % bs
        return plan

    def _add_questions(self, plan, patched, token_row, pos, phys_before) -> None:
        """Patched scoring: each non-final chunk's question (the prompt's last k tokens) runs as
        extra rows at logical positions right after the chunk and physical slots right after
        it (the scheduler reserved them); the kernel sees them as extra sequences that share
        their request's block row. Their KVs end up past the kept length: dropped."""
        L, bs = self.policy.num_layers, self.block_size
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
        plan.slots = (plan.block_table[all_rows.expand(L, -1), all_pos // bs].long() * bs
                      + all_pos % bs)
        plan.question_ids = torch.tensor(ids, dtype=torch.long)
        plan.question_positions = torch.tensor(positions, dtype=torch.long)
        ends = plan.query_start_loc[-1].item() + torch.tensor(q_lens).cumsum(0)
        plan.query_start_loc = torch.cat([plan.query_start_loc, ends.int()])
        plan.seq_lens = torch.cat([plan.seq_lens, torch.stack(seq_extra, 1).int()], dim=1)
        plan.block_table = torch.cat([plan.block_table,
                                      plan.block_table[[j.row for j in patched]]])
        plan.num_reqs += len(patched)

    def finish_step(self, plan: TokenStepPlan, request_block_ids, row_block_counts) -> None:
        """After the forward: book the compressed chunks and drop the tail blocks from vLLM's
        worker-side block lists, exactly as the scheduler frees them before its next step.

        request_block_ids(req_id) -> the request's block-id list (mutable);
        row_block_counts: the persistent batch's per-row block counts (mutable)."""
        bs = self.block_size
        for job in plan.jobs:
            led = self.ledgers[job.req_id]
            c = job.end - job.start
            kept = [k.kept for k in job.keep]
            led.evicted = [e + c - k for e, k in zip(led.evicted, kept)]
            led.allocation_evicted += c - max(kept)
            own = -(-(job.computed + c - led.allocation_evicted) // bs)
            ids = request_block_ids(job.req_id)
            if ids is not None and len(ids) > own:
                del ids[own:]
                row_block_counts[job.row] = own


# ------------------------------------------------------------------------------------------
# scheduler side
# ------------------------------------------------------------------------------------------
class TokenEvictionScheduler:
    """Engine-core side of the ledger: translates vLLM's logical token counts to physical ones
    for block allocation, frees tail blocks after each compressed chunk, caps admission."""

    def __init__(self, policy: KVPolicy, chunk_size: int):
        self.policy = policy
        self.policy_for = RequestPolicies(policy)
        self.chunk_size = chunk_size
        self.allocation_evicted: dict[str, int] = {}
        self.pending: dict[str, tuple[int, bool, KVPolicy]] = {}
        self.scheduler = None

    def physical(self, req_id: str, num_tokens: int) -> int:
        return num_tokens - self.allocation_evicted.get(req_id, 0)

    def peak_tokens(self, request, num_tokens: int) -> int:
        """Peak slots a request of `num_tokens` tokens needs: the compressed prompt before a
        chunk, that chunk and its patched question, and every token after the prompt (decode
        tokens are never evicted)."""
        n, c = request.num_prompt_tokens, self.chunk_size
        policy = self.request_policy(request)
        question = min(policy.config.obs_window, n) if policy.config.patched else 0
        done, kept, peak = 0, 0, 0
        while done < n:
            step = min(c, n - done)
            final = done + step == n
            peak = max(peak, kept + step + (0 if final else question))
            kept += step - allocation_eviction(policy, step, final)
            done += step
        return min(num_tokens, max(peak, kept + num_tokens - n))

    def final_need(self, request) -> int:
        """Slots a request needs at its largest: its peak including all max_tokens outputs."""
        params = getattr(request, "sampling_params", None)
        max_new = getattr(params, "max_tokens", None) or 0
        return self.peak_tokens(request, request.num_prompt_tokens + max_new)

    def admission_tokens(self, req_id: str, num_tokens: int) -> int:
        """What admitting a request must find free: its own final need, plus the blocks the
        running evicting requests still have to grow by to reach theirs (vLLM reserves nothing
        for in-flight requests, and with eviction a request's need is not its length). This
        keeps admitted requests from being preempted, whose recompute would not be exact."""
        request = self.scheduler.requests.get(req_id) if self.scheduler else None
        if request is None:
            return num_tokens
        manager = self.scheduler.kv_cache_manager.coordinator.single_type_managers[0]
        bs = manager.block_size
        growth_blocks = 0
        for other in self.scheduler.running:
            if other.request_id == req_id:
                continue
            held = len(manager.req_to_blocks.get(other.request_id, ()))
            growth_blocks += max(-(-self.final_need(other) // bs) - held, 0)
        return self.final_need(request) + growth_blocks * bs

    def before_schedule(self) -> None:
        """Apply the evictions of the chunks scheduled last step (their forward precedes any
        forward of this step, so the freed blocks are safe to hand out now)."""
        if self.scheduler is None:
            return
        manager = self.scheduler.kv_cache_manager.coordinator.single_type_managers[0]
        bs = manager.block_size
        for req_id, (chunk_len, is_final, policy) in list(self.pending.items()):
            del self.pending[req_id]
            request = self.scheduler.requests.get(req_id)
            blocks = manager.req_to_blocks.get(req_id)
            if request is None or not blocks:
                self.allocation_evicted.pop(req_id, None)
                continue
            self.allocation_evicted[req_id] = (self.allocation_evicted.get(req_id, 0)
                                               + allocation_eviction(policy, chunk_len,
                                                                     is_final))
            keep = -(-self.physical(req_id, request.num_computed_tokens) // bs)
            if len(blocks) > keep:
                tail = blocks[keep:]
                del blocks[keep:]
                manager.block_pool.free_blocks(reversed(tail))

    def after_schedule(self, scheduler_output) -> None:
        for req_id in getattr(scheduler_output, "preempted_req_ids", None) or ():
            self.allocation_evicted.pop(req_id, None)
            self.pending.pop(req_id, None)
        for req_id in scheduler_output.finished_req_ids:
            self.allocation_evicted.pop(req_id, None)
            self.pending.pop(req_id, None)
        for req_id, c in scheduler_output.num_scheduled_tokens.items():
            request = self.scheduler.requests.get(req_id)
            if request is None:
                continue
            before = request.num_computed_tokens - c
            if before == 0:
                self.allocation_evicted.pop(req_id, None)
            if before + c <= request.num_prompt_tokens:
                self.pending[req_id] = (c, before + c == request.num_prompt_tokens,
                                        self.request_policy(request))

    def request_policy(self, request) -> KVPolicy:
        params = getattr(request, "sampling_params", None)
        return self.policy_for(getattr(params, "extra_args", None))
