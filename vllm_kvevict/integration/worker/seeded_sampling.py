"""Seeded sampling on vLLM's CPU worker: a request with `seed` whose prompt prefills over
several steps must not stop the server.

vLLM samples a token for a prefill step that does not end the prompt, throws it away and
rewinds the request's generator (`GPUModelRunner._bookkeeping_sync`: `gen.set_offset(...)`, a
Philox offset on CUDA). torch's CPU generator has no offset and raises, which kills vLLM 0.32's
CPU worker and the server (stock vLLM too). Here a seeded request's CPU generator is a
`RewindableGenerator`: its state is saved right before the step samples (`prepare`) and the
rewind restores it, so the next step draws what the discarded one drew and a seeded request's
tokens do not depend on how its prompt was split. Design: docs/design/entrypoints.md,
"Reliability".
"""

from __future__ import annotations

import torch


class RewindableGenerator(torch.Generator):
    """A CPU generator whose `set_offset` undoes this step's draws (see the module doc)."""

    _mark: torch.Tensor | None = None

    def mark(self) -> None:
        self._mark = self.get_state()

    def get_offset(self) -> int:
        return 0  # vLLM only ever passes it back to set_offset, minus one draw

    def set_offset(self, offset: int) -> None:
        if self._mark is not None:
            self.set_state(self._mark)


def rewindable(generator: torch.Generator) -> RewindableGenerator:
    out = RewindableGenerator(device="cpu")
    out.set_state(generator.get_state())
    return out


def prepare(runner) -> None:
    """Before a step samples (its model forward is done): every seeded request's CPU generator
    rewindable, and its state saved. `input_batch.generators` (batch index -> generator) is the
    dict the sampler reads; the request's own record keeps the generator across preemption."""
    batch = getattr(runner, "input_batch", None)
    generators = getattr(batch, "generators", None)
    if not generators:
        return
    for index, generator in list(generators.items()):
        if not isinstance(generator, RewindableGenerator):
            if generator.device.type != "cpu":
                continue  # CUDA's Philox generator rewinds by offset itself
            generator = generators[index] = rewindable(generator)
            request = runner.requests.get(batch.req_ids[index])
            if request is not None:
                request.generator = generator
        generator.mark()
