"""Patched chunked eviction's question rows, under either of vLLM's model runners: the question
tokens ride along as extra rows after the step's (padded) tokens, and the attention backend
knows where they are from the step plan (`plan.question_offset`).

V1 runner: `_model_forward`, the override point vLLM documents for runner subclasses. V2
runner: it calls `self.model(**model_inputs)` directly, so the rows go in through its model
state's `prepare_inputs`, whose returned values override the input ids and positions (a
documented contract). vLLM builds both objects inline, with no class hook: `install` makes each
an instance of a subclass of its own class, scoped to that object. Design:
docs/design/worker.md, "vLLM's V2 model runner".
"""

from __future__ import annotations

import functools

import torch

from vllm_kvevict.integration.worker.runners import is_v2


def with_questions(plan, input_ids: torch.Tensor, positions: torch.Tensor):
    """(input_ids, positions) with the plan's question rows appended; None when the step has
    none."""
    if plan is None or not plan.valid or not plan.num_questions:
        return None
    plan.question_offset = input_ids.shape[0]
    return (torch.cat([input_ids, plan.question_ids.to(input_ids.device, input_ids.dtype)]),
            torch.cat([positions, plan.question_positions.to(positions.device,
                                                             positions.dtype)]))


class QuestionRowsRunner:
    """Mixed into vLLM's V1 model runner."""

    kv_state = None

    def _model_forward(self, input_ids=None, positions=None, *args, **kwargs):
        plan = self.kv_state.planner.plan
        rows = None if input_ids is None else with_questions(plan, input_ids, positions)
        if rows is None:
            return super()._model_forward(input_ids, positions, *args, **kwargs)
        out = super()._model_forward(*rows, *args, **kwargs)
        return out[: plan.question_offset] if isinstance(out, torch.Tensor) else out


def question_rows_model_state(cls: type) -> type:
    """A subclass of the V2 runner's model state class whose `prepare_inputs` appends the
    question rows. The extra rows' hidden states stay at the end of the model's output, past
    every index the V2 runner samples from. (Built as a direct subclass, not through a mixin:
    ModelState is an ABC, and a mixin ahead of it in the bases changes the instance layout,
    which `__class__` assignment refuses.)"""

    def prepare_inputs(self, input_batch, req_states):
        out = cls.prepare_inputs(self, input_batch, req_states)
        plan = self.kv_state.planner.plan
        if plan is None or not plan.valid or not plan.num_questions:
            return out
        if "positions" in out or input_batch.input_ids is None:
            # (M-RoPE positions or input embeddings: families start-up refuses already)
            raise RuntimeError("vllm-kvevict: question rows need token ids and 1-D positions")
        input_ids, positions = with_questions(plan, input_batch.input_ids, input_batch.positions)
        return {**out, "input_ids": input_ids, "positions": positions}

    return type(f"QuestionRows{cls.__name__}", (cls,), {"prepare_inputs": prepare_inputs})


@functools.cache
def _subclass(cls: type, v2: bool) -> type:
    if v2:
        return question_rows_model_state(cls)
    return type(f"QuestionRows{cls.__name__}", (QuestionRowsRunner, cls), {})


def install(runner, state) -> None:
    """Token eviction's question rows on this worker's runner (V1) or its model state (V2,
    which exists once the model is loaded)."""
    v2 = is_v2(runner)
    target = runner.model_state if v2 else runner
    if not type(target).__name__.startswith("QuestionRows"):
        target.__class__ = _subclass(type(target), v2)
    target.kv_state = state
