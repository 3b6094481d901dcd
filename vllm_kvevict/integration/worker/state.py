"""Worker side: the policy's per-process state (`WorkerState`, the attention context plus the
weights' load order) and the served kind's step planner, chosen once (`PLANNERS[kind]`): the
KV-cache specs the kind declares, what it installs on the loaded model, each step's plan. Our
worker class, `kvevict_worker.py`, builds the state, sets it as the attention context and calls
the planner around each step."""

from __future__ import annotations

import abc
import logging
from dataclasses import dataclass

import torch

from vllm_kvevict.integration.attention.context import HEAD_PAGE_BACKENDS, AttentionContext
from vllm_kvevict.integration.attention.step_plan import StepPlan, build_step_plan
from vllm_kvevict.integration.attention.token_step import TokenStepPlan
from vllm_kvevict.integration.kv_cache.head_split import layer_heads
from vllm_kvevict.integration.kv_cache.prefix_cache import prefix_specs
from vllm_kvevict.integration.kv_cache.sink_window import canonical_chunk
from vllm_kvevict.integration.kv_cache.specs import (declare_head_mask_specs,
                                                     declare_token_specs, layer_groups)
from vllm_kvevict.integration.worker import head_order, question_rows, runners
from vllm_kvevict.integration.worker.token_plan import TokenEvictionWorker
from vllm_kvevict.served import served_policy

logger = logging.getLogger("vllm.kvevict")  # under vLLM's logger: its handler and format


@dataclass
class WorkerState(AttentionContext):
    """What this worker serves: the attention context (the policy, this rank's heads and cache
    layout, the served kind's step planner) and how its weights load."""

    # tensor parallel: long [L, H], each layer's KV heads (original indices) in the served
    # order, the weights permuted to it at load (`head_order.py`); None: vLLM's order
    head_order: torch.Tensor | None = None
    base_load_format: str = "auto"  # the user's load format, under head_order's loader


class StepPlanner(abc.ABC):
    """One served kind's part of the worker: the KV-cache specs it declares, what it installs
    on the loaded model, and each step's plan (built once per step, shared by every layer),
    with the step bookkeeping every kind shares (`KVEvictWorker.execute_model` calls
    `begin_step` / `finish_step` around vLLM's step)."""

    declares_specs = True  # False: vLLM's own specs (and its sharing layers' entries) stand

    def __init__(self, state: WorkerState, vllm_config, rank: int, world: int) -> None:
        self.state = state
        self.runner = None
        self.step = 0
        self.in_step = False  # inside KVEvictWorker.execute_model (not a profile or dummy run)
        # request id -> its sampling params' extra_args (per-request overrides), from the
        # scheduler's output: neither of vLLM's runners needs to be asked for it
        self.extra_args: dict = {}
        self.plan: StepPlan | TokenStepPlan | None = None  # the current step's
        self._plan_key: tuple | None = None
        self._finished_key: tuple | None = None
        self._plan_anchor = None

    # -- the kind's parts (overridden) ---------------------------------------------------
    @abc.abstractmethod
    def declare_specs(self, runner, stock_specs) -> dict:
        """The layers' KV-cache specs of the kind (vLLM's `stock_specs` as the start)."""

    def after_load(self, runner) -> None:
        pass

    @abc.abstractmethod
    def build(self, req_ids, computed, q_lens, valid):
        """The step's plan of the kind for these rows."""

    def _begin(self, runner, scheduler_output) -> None:
        pass

    def release(self, req_ids) -> None:
        pass

    def book(self, plan) -> None:
        pass

    # -- per step --------------------------------------------------------------------------
    def begin_step(self, runner, scheduler_output) -> None:
        """Before vLLM's step: finished and preempted requests release their state."""
        self.runner = runner
        self.step += 1
        self.in_step = True
        for new in scheduler_output.scheduled_new_reqs:
            self.extra_args[new.req_id] = getattr(new.sampling_params, "extra_args", None)
        for req_id in scheduler_output.finished_req_ids:
            self.extra_args.pop(req_id, None)
        self._begin(runner, scheduler_output)
        self.release(scheduler_output.finished_req_ids)
        self.release(getattr(scheduler_output, "preempted_req_ids", None))

    def step_plan(self, common):
        """The plan of the step whose common attention metadata is `common` (built once: every
        KV-cache group's builder gets a shallow copy of one common metadata, sharing its
        query_start_loc tensor, which identifies the step; the key keeps it alive)."""
        key = (self.step, id(common.query_start_loc))
        if key == self._plan_key and self.plan is not None:
            return self.plan
        self._plan_anchor = common.query_start_loc  # alive while its id is the key
        num_reqs = common.num_reqs
        q_start = common.query_start_loc_cpu[: num_reqs + 1].tolist()
        q_lens = [q_start[i + 1] - q_start[i] for i in range(num_reqs)]
        seq_lens = common.seq_lens[:num_reqs].cpu().tolist()
        computed = [s - q for s, q in zip(seq_lens, q_lens)]
        req_ids = runners.row_requests(self.runner, common, num_reqs, self.in_step)
        valid = req_ids is not None
        req_ids = req_ids or []
        plan = self.build(req_ids[:num_reqs], computed, q_lens, valid)
        self._plan_key, self.plan = key, plan
        return plan

    def row_prompt_lens(self, common, num_reqs: int) -> list[int] | None:
        """Each of the step's rows' prompt as the policy serves it (None: the rows are not
        requests, as in warm-up runs; every query is then a prompt query of its step)."""
        req_ids = runners.row_requests(self.runner, common, num_reqs, self.in_step)
        return None if req_ids is None else self.prompt_lens(req_ids)

    def prompt_lens(self, req_ids) -> list[int]:
        """Each row's prompt as the policy serves it (a teacher-forced tail is decoded)."""
        return runners.policy_prompt_lens(self.runner, req_ids, self.extra_args)

    def finish_step(self) -> None:
        """End of an engine step (worker): book token evictions once per plan."""
        self.in_step = False
        plan = self.plan
        if (plan is None or not plan.valid or self._finished_key == self._plan_key
                or self._plan_key[0] != self.step):
            return
        self._finished_key = self._plan_key
        self.book(plan)


class FullPlanner(StepPlanner):
    """`full`: vLLM's own specs and attention (the flex path's builder still asks the rows'
    prompt lengths); nothing planned, nothing kept per request."""

    declares_specs = False

    def declare_specs(self, runner, stock_specs) -> dict:
        return stock_specs()

    def build(self, req_ids, computed, q_lens, valid) -> None:
        return None


class HeadMaskPlanner(StepPlanner):
    """Streaming heads (streaming, duo, prulong), in vLLM's pool: each step's read-back plan
    from it; nothing kept per request."""

    def __init__(self, state: WorkerState, vllm_config, rank: int, world: int) -> None:
        super().__init__(state, vllm_config, rank, world)
        if not state.head_pages and rank == 0:
            cfg = state.config
            for line in (in_place_hint(cfg.sink, cfg.window, state.block_size),
                         full_block_hint(state.block_size, cfg, world)):
                if line:
                    logger.info("vllm-kvevict: %s", line)

    def declare_specs(self, runner, stock_specs) -> dict:
        return declare_head_mask_specs(runner, stock_specs, self.state)

    def build(self, req_ids, computed, q_lens, valid) -> StepPlan:
        prompt_lens = self.prompt_lens(req_ids[:len(q_lens)]) if valid else None
        return self.plan_rows(computed, q_lens, prompt_lens, valid)

    def plan_rows(self, computed, q_lens, prompt_lens, valid, questions=()) -> StepPlan:
        state, cfg = self.state, self.state.config
        plan = build_step_plan(computed, q_lens, cfg.sink, cfg.window, state.block_size,
                               prompt_lens, questions, chunk=state.chunk or None)
        plan.valid = valid
        return plan


class TokenPlanner(StepPlanner):
    """Token eviction (snapkv, pyramidkv): each step's physical slots and chunks to compress
    from the per-request ledgers (`TokenEvictionWorker`), their evictions booked after it."""

    def __init__(self, state: WorkerState, vllm_config, rank: int, world: int) -> None:
        super().__init__(state, vllm_config, rank, world)
        served = state.served
        self.token = TokenEvictionWorker(served.policy, state.block_size,
                                         for_request=served.for_request)
        self.token.combine_scores = replica_scores(rank, world, served.shape.num_kv_heads)
        # (on only where settle_config kept it: naive token eviction, prefix_cache.py)
        self.token.reuses_prefixes = bool(vllm_config.cache_config.enable_prefix_caching)
        self.blocks = None  # runners.V1Blocks / V2Blocks, this runner's
        self._rows: list = []  # the plan's request id per row
        self._groups_of = None

    def declare_specs(self, runner, stock_specs) -> dict:
        return prefix_specs(declare_token_specs(runner, stock_specs, self.state), self.state,
                            runner.vllm_config)

    def after_load(self, runner) -> None:
        question_rows.install(runner, self.state)

    def _begin(self, runner, scheduler_output) -> None:
        if self.blocks is None or self.blocks.runner is not runner:
            self.blocks = runners.request_blocks(runner)
        self.blocks.update(scheduler_output)

    def release(self, req_ids) -> None:
        self.token.release(req_ids)

    def build(self, req_ids, computed, q_lens, valid) -> TokenStepPlan:
        self._ensure_groups()
        if not valid:  # profiling / warm-up: nothing to keep, nothing to evict
            n = len(q_lens)
            req_ids = [f"__dummy{i}" for i in range(n)]
            prompt_lens = [0] * n
            block_ids = [[[0]] * self.token.groups.num_groups] * n
        else:
            prompt_lens = self.prompt_lens(req_ids)
            block_ids = [self.blocks.block_ids(r) for r in req_ids]
        self._rows = req_ids
        extra_args = self.extra_args
        plan = self.token.plan(req_ids, computed, q_lens, prompt_lens, block_ids,
                               prompt_ids=lambda row: self.blocks.prompt_ids(req_ids[row]),
                               extra_args=lambda row: extra_args.get(req_ids[row]))
        plan.valid = valid
        if not valid:
            self.token.release(req_ids)
        return plan

    def _ensure_groups(self) -> None:
        """The token ledger's layer -> KV-cache group map, from the runner's KV cache config
        (known once vLLM has initialised the KV cache; the same map the scheduler uses)."""
        config = getattr(self.runner, "kv_cache_config", None)
        if config is None or self._groups_of is config:
            return
        groups = layer_groups(config, self.state.policy.num_layers)
        if groups != self.token.groups:
            if self.token.ledgers:
                raise RuntimeError("vllm-kvevict: KV-cache groups changed with requests running")
            self.token.groups = groups
            logger.info("vllm-kvevict: token eviction over %d KV-cache group(s)",
                        groups.num_groups)
        self._groups_of = config

    def book(self, plan) -> None:
        self.token.finish_step(plan, self.blocks.block_ids, self.blocks.row_counts(self._rows))


class HybridPlanner(TokenPlanner):
    """A head mask whose full heads evict tokens, composed: the token plan for its full heads,
    the head-mask plan (with patched scoring's question rows) for its streaming heads."""

    def __init__(self, state: WorkerState, vllm_config, rank: int, world: int) -> None:
        super().__init__(state, vllm_config, rank, world)
        self.streaming = HeadMaskPlanner(state, vllm_config, rank, world)

    def declare_specs(self, runner, stock_specs) -> dict:
        return prefix_specs(declare_head_mask_specs(runner, stock_specs, self.state),
                            self.state, runner.vllm_config)

    def build(self, req_ids, computed, q_lens, valid) -> TokenStepPlan:
        plan = super().build(req_ids, computed, q_lens, valid)
        plan.streaming = self.streaming.plan_rows(
            computed, q_lens, self.prompt_lens(req_ids[:len(q_lens)]) if valid else None, valid,
            [(j.row, len(j.question), j.question_start) for j in plan.jobs if j.question])
        return plan


# The step planner of each kind of policy, chosen once per process (`build_state`).
PLANNERS = {"full": FullPlanner, "head_mask": HeadMaskPlanner, "token": TokenPlanner,
            "hybrid": HybridPlanner}


def tensor_parallel_rank(vllm_config) -> tuple[int, int]:
    """(this worker's tensor-parallel rank, the TP size): which slice of the KV heads it holds."""
    world = int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1) or 1)
    if world == 1:
        return 0, 1
    from vllm.distributed import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank(), world


def build_state(vllm_config) -> WorkerState:
    """This worker's state, from the served policy (once per process, by the worker)."""
    served = served_policy(vllm_config)
    block_size = vllm_config.cache_config.block_size
    rank, world = tensor_parallel_rank(vllm_config)
    streaming = served.policy.streaming_heads()
    order, line = head_order.choose(streaming, world, served.config.tp_head_order,
                                    head_order.blocker(vllm_config))
    if line and rank == 0:
        logger.info("vllm-kvevict: %s", line)
    if order is not None:
        streaming = streaming.gather(1, order)
    state = WorkerState(
        served=served, heads=layer_heads(streaming, served.shape.queries_per_kv, rank, world),
        head_order=order, head_dim=served.shape.head_dim, block_size=block_size,
        chunk=canonical_chunk(vllm_config),
        head_pages=served.config.attention_backend in HEAD_PAGE_BACKENDS,
        in_place=in_place_hint(served.config.sink, served.config.window, block_size) is None)
    state.planner = PLANNERS[served.kind](state, vllm_config, rank, world)
    return state


def replica_scores(rank: int, world: int, num_kv_heads: int):
    """Replicated KV heads (world a multiple of the KV heads, R = world / H replicas each):
    rank r holds a replica of head r // R with 1/R of its query heads, and a SnapKV / PyramidKV
    score is a mean over the head's query heads (then a linear pooling): the head's score is the
    mean of its R replicas' scores, gathered over the tensor-parallel group. Every rank scores
    the same layers and chunks with equal shapes (the ledger depends on lengths only), so the
    collective lines up. None when each rank holds whole GQA groups."""
    if world <= num_kv_heads:
        return None
    replicas = world // num_kv_heads
    first = rank // replicas * replicas

    def combine(scores: torch.Tensor) -> torch.Tensor:
        if scores.numel() == 0:
            return scores
        from vllm.distributed import get_tp_group

        gathered = get_tp_group().all_gather(scores.contiguous(), dim=0)  # [world, n]
        return gathered[first:first + replicas].mean(dim=0, keepdim=True)
    return combine


def in_place_hint(sink: int, window: int, block_size: int) -> str | None:
    """What to pass for the streaming heads' decode to run in place over the pool
    (`step_plan.window_rows`: sink in whole blocks, window >= a block), when it does not."""
    if sink % block_size == 0 and window >= block_size:
        return None
    fits = [b for b in (128, 64, 32) if sink % b == 0 and window >= b]
    why = (f"the sink ({sink}) is not whole {block_size}-token blocks" if sink % block_size
           else f"the window ({window}) is shorter than a {block_size}-token block")
    return (f"decode reads each streaming head's sink + window back from the pool every step: "
            f"{why}" + (f"; --block-size {fits[0]} lets vLLM's kernel read them in place"
                        if fits else ""))


def full_block_hint(block_size: int, config, world: int = 1) -> str | None:
    """What to pass for a head mask's full heads to be read in 128-token blocks, when they are
    in smaller ones and the flag is served (`--kv-full-block-size`, `features.full_block_error`:
    one tensor-parallel rank)."""
    if config.full_block_size or config.policy == "streaming" or config.token_policy \
            or world > 1 \
            or block_size >= 128 or 128 % block_size or block_size % 32:
        return None
    return (f"full heads in {block_size}-token blocks: --kv-full-block-size 128 lets vLLM's CPU "
            f"kernel read them as fast as stock's 128-token cache (the streaming heads keep "
            f"--block-size {block_size})")
