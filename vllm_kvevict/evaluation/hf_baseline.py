"""Full-attention scores with transformers in float32 (greedy), no server needed.

Used to choose tasks and lengths: the bundled model must score well enough with full attention
for 90 % of that score to be measurable. The server's `full` policy computes the same greedy
tokens (tests/test_serve_full.py, tests/test_policies_vllm.py); the runner's `full` rows are
the numbers the report uses.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

from vllm_kvevict.evaluation.tasks import Example


@dataclass
class Scored:
    example: Example
    prediction: str
    score: float
    seconds: float


def load_model(model_dir: str, threads: int = 1):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                local_files_only=True).eval()


@torch.inference_mode()
def generate(model, tokenizer, example: Example) -> str:
    ids = torch.tensor([example.prompt_ids])
    if example.allowed_token_ids is not None:
        # The server restricts sampling to these tokens; greedy = the best-ranked of them.
        allowed = torch.tensor(example.allowed_token_ids)
        logits = model(ids).logits[0, -1, allowed]
        return tokenizer.decode([int(allowed[logits.argmax()])])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=example.max_tokens, pad_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def score_examples(model, tokenizer, examples: Iterable[Example]) -> Iterator[Scored]:
    """One row per example as soon as it is scored (a long baseline shows progress)."""
    for ex in examples:
        start = time.monotonic()
        prediction = generate(model, tokenizer, ex)
        yield Scored(ex, prediction, ex.score(prediction), time.monotonic() - start)
