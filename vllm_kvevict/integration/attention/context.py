"""What attention reads in a worker process: the served policy, this rank's heads and cache
layout, and the worker's step source (each step's plan, built once and shared by every layer).

vLLM's split of `CommonAttentionMetadata`: the worker builds, attention reads. `KVEvictWorker`
sets the context once (`set_attention_context`) before vLLM builds the model; impls and
metadata builders read it (`attention_context`) and never reach into the worker. No context in
a process means our worker did not run there: vLLM's own specs and classes (`attention_kind`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from vllm_kvevict.config import KVPolicyConfig
from vllm_kvevict.integration.kv_cache.head_split import LayerHeads
from vllm_kvevict.policies import KVPolicy
from vllm_kvevict.served import ServedPolicy


class StepSource(Protocol):
    """The worker's side of a step, as attention asks it (`worker/state.StepPlanner`)."""

    plan: object  # the current step's plan (StepPlan, TokenStepPlan or None)

    def step_plan(self, common): ...

    def row_prompt_lens(self, common, num_reqs: int) -> list[int] | None: ...


@dataclass
class AttentionContext:
    served: ServedPolicy
    heads: list[LayerHeads]  # per layer: this rank's full / streaming split
    head_dim: int
    block_size: int
    chunk: int = 0  # the canonical prefill chunk (sink_window.canonical_chunk; 0: the step)
    # --kv-attention-backend flex or triton: a cache layer per KV head (kv_cache/head_pages.py)
    head_pages: bool = False
    in_place: bool = False  # streaming decode in place over the pool (worker/state.in_place_hint)
    planner: StepSource | None = None  # the worker's, built once

    @property
    def config(self) -> KVPolicyConfig:
        return self.served.config

    @property
    def policy(self) -> KVPolicy:
        return self.served.policy

    @property
    def kind(self) -> str:
        return self.served.kind


# the paths that keep a cache layer per KV head; each its backend class, registered by the
# worker under vLLM's name (`flex_attention.use_head_pages_backend`)
HEAD_PAGE_BACKENDS = {
    "flex": "vllm_kvevict.integration.attention.flex_attention.KVEvictFlexBackend",
    "triton": "vllm_kvevict.integration.attention.triton_attention.KVEvictTritonBackend"}

_context: AttentionContext | None = None


def set_attention_context(context: AttentionContext) -> AttentionContext:
    """Once per worker process, by the worker, before the model is built."""
    global _context
    if _context is not None and _context is not context:
        raise RuntimeError("vllm-kvevict: the attention context is set once per process")
    _context = context
    return context


def attention_context() -> AttentionContext | None:
    return _context


def extend_metadata(metadata, cls: type, **fields):
    """vLLM's attention metadata as `cls`, our dataclass subclass of its class, with our
    `fields` beside vLLM's: its values copied, its `__init__` not run again (vLLM's
    `__post_init__` already ran on them)."""
    out = object.__new__(cls)
    out.__dict__.update(vars(metadata), **fields)
    return out


def attention_kind() -> str:
    """The served kind the factories choose by; `full` (vLLM's own path) with no context."""
    return "full" if _context is None else _context.kind
