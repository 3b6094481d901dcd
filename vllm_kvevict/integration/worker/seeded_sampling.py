"""Seeded sampling on vLLM's CPU worker: a request with `seed` whose prompt prefills over
several steps must not stop the server.

vLLM samples a token for every scheduled request, also for a prefill step that does not end
the prompt, throws that token away and rewinds the request's generator so that the draw never
happened (`GPUModelRunner._bookkeeping_sync`: `gen.set_offset(gen.get_offset() - 4)`, the
Philox offset of one draw on CUDA). torch's CPU generator (mt19937) has no offset and raises
"CPU Generator does not use offset", which kills vLLM 0.32's CPU worker and with it the
server (stock vLLM too). Here a seeded request's CPU generator is a `RewindableGenerator`:
its state is saved right before the step samples (`prepare`, after the model ran), and the
rewind restores it, which is what the offset arithmetic means on CUDA: the next step draws
what the discarded one drew, so a seeded request's tokens do not depend on how its prompt was
split into steps.
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
