"""Worker-side state of the policy: the policy object, per-layer head splits, the streaming
stores, request -> store slot, and the current step's plan. One instance per worker process."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from vllm_kvevict.config import KVPolicyConfig
from vllm_kvevict.integration.head_split import LayerHeads, layer_heads
from vllm_kvevict.integration.streaming_store import StepPlan, StreamingStore, build_step_plan
from vllm_kvevict.integration.token_eviction import TokenEvictionWorker, TokenStepPlan
from vllm_kvevict.policies import KVPolicy, build_policy

logger = logging.getLogger("vllm_kvevict")


@dataclass
class WorkerState:
    config: KVPolicyConfig
    policy: KVPolicy
    heads: list[LayerHeads]
    head_dim: int
    dtype: torch.dtype
    block_size: int
    stores: dict[int, StreamingStore] = field(default_factory=dict)
    slot_of: dict[str, int] = field(default_factory=dict)
    free_slots: list[int] = field(default_factory=list)
    step: int = 0
    runner: object = None
    token: TokenEvictionWorker | None = None
    _plan_key: tuple | None = None
    plan: StepPlan | TokenStepPlan | None = None
    _finished_key: tuple | None = None
    _groups_of: object = None
    _plan_anchor: object = None

    # -- requests ------------------------------------------------------------------------
    def slot_for(self, req_id: str) -> int:
        if req_id not in self.slot_of:
            slot = self.free_slots.pop() if self.free_slots else len(self.slot_of)
            self.slot_of[req_id] = slot
            for store in self.stores.values():
                store.grow(slot + 1)
        return self.slot_of[req_id]

    def release(self, req_ids) -> None:
        if self.token is not None:
            self.token.release(req_ids)
        for req_id in req_ids or ():
            slot = self.slot_of.pop(req_id, None)
            if slot is not None:
                self.free_slots.append(slot)

    # -- per step ------------------------------------------------------------------------
    def step_plan(self, common) -> StepPlan:
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
        req_ids = list(getattr(getattr(self.runner, "input_batch", None), "req_ids", []) or [])
        valid = len(req_ids) >= num_reqs and all(r is not None for r in req_ids[:num_reqs])
        if self.token is not None:
            plan = self._token_plan(req_ids[:num_reqs], computed, q_lens, valid)
            self._plan_key, self.plan = key, plan
            return plan
        slots = [self.slot_for(r) for r in req_ids[:num_reqs]] if valid else [0] * num_reqs
        plan = build_step_plan(slots, computed, q_lens, self.config.sink, self.config.window,
                               self.block_size)
        plan.valid = valid
        self._plan_key, self.plan = key, plan
        return plan

    def _token_plan(self, req_ids, computed, q_lens, valid) -> TokenStepPlan:
        self._ensure_groups()
        if not valid:  # profiling / warm-up: nothing to keep, nothing to evict
            n = len(q_lens)
            req_ids = [f"__dummy{i}" for i in range(n)]
            prompt_lens = [0] * n
            block_ids = [[[0]] * self.token.groups.num_groups] * n
        else:
            batch = self.runner.input_batch
            prompt_lens = [int(x) for x in batch.num_prompt_tokens[: len(req_ids)]]
            block_ids = [self.runner.requests[r].block_ids for r in req_ids]
        requests = getattr(self.runner, "requests", {})
        plan = self.token.plan(req_ids, computed, q_lens, prompt_lens, block_ids,
                               prompt_ids=lambda row: requests[req_ids[row]].prompt_token_ids,
                               extra_args=lambda row: _extra_args(requests.get(req_ids[row])))
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
        from vllm_kvevict.integration.tiers import layer_groups

        groups = layer_groups(config, self.policy.num_layers)
        if groups != self.token.groups:
            if self.token.ledgers:
                raise RuntimeError("vllm-kvevict: KV-cache groups changed with requests running")
            self.token.groups = groups
            logger.info("vllm-kvevict: token eviction over %d KV-cache group(s)",
                        groups.num_groups)
        self._groups_of = config

    def finish_step(self) -> None:
        """End of an engine step (worker): book token evictions once per plan."""
        plan = self.plan
        if (self.token is None or plan is None or not plan.valid
                or self._finished_key == self._plan_key or self._plan_key[0] != self.step):
            return
        self._finished_key = self._plan_key
        requests = self.runner.requests
        counts = [t.num_blocks_per_row for t in self.runner.input_batch.block_table.block_tables]
        self.token.finish_step(
            plan, lambda r: requests[r].block_ids if r in requests else None, counts)

    def store(self, layer: int) -> StreamingStore:
        if layer not in self.stores:
            heads = self.heads[layer]
            self.stores[layer] = StreamingStore(
                len(heads.streaming_kv), self.head_dim, self.config.sink, self.config.window,
                self.dtype, slots=max(8, len(self.slot_of)))
        return self.stores[layer]

    def streaming_bytes_per_request(self) -> int:
        cap = self.config.sink + self.config.window
        heads = sum(len(h.streaming_kv) for h in self.heads)
        return 2 * cap * heads * self.head_dim * torch.tensor([], dtype=self.dtype).element_size()


_state: WorkerState | None = None


def _extra_args(request_state):
    params = getattr(request_state, "sampling_params", None)
    return getattr(params, "extra_args", None)


def get_state() -> WorkerState | None:
    return _state


def init_state(vllm_config) -> WorkerState | None:
    """Build the worker state from the VllmConfig (None for `full`: stock vLLM runs)."""
    global _state
    if _state is not None:
        return _state
    from vllm_kvevict.integration.validation import (model_shape, policy_config_of,
                                                     resolve_full_heads)

    cfg = policy_config_of(vllm_config)
    if cfg.policy == "full":
        return None
    hf = vllm_config.model_config.hf_config
    num_layers, num_kv_heads = model_shape(hf)
    text = getattr(hf, "get_text_config", lambda: hf)()
    queries_per_kv = text.num_attention_heads // num_kv_heads
    full_heads, source = None, ""
    if cfg.policy in ("duo", "prulong"):
        full_heads, source = resolve_full_heads(cfg, vllm_config.model_config.model,
                                                num_layers, num_kv_heads)
    policy = build_policy(cfg, num_layers, num_kv_heads, full_heads=full_heads,
                          mask_source=source)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    block_size = vllm_config.cache_config.block_size
    _state = WorkerState(config=cfg, policy=policy,
                         heads=layer_heads(policy.streaming_heads(), queries_per_kv),
                         head_dim=head_dim, dtype=vllm_config.model_config.dtype,
                         block_size=block_size,
                         token=TokenEvictionWorker(policy, block_size)
                         if policy.evicts_tokens else None)
    logger.info("vllm-kvevict: policy %s, %d of %d KV heads streaming (mask %s)", cfg.policy,
                int(policy.streaming_heads().sum()), num_layers * num_kv_heads, source or "-")
    return _state
