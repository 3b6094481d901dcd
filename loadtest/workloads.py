"""Seeded prompts of exact token length for the workloads where KV eviction matters.

- rag: long prompt, short answer (prefill-heavy; eviction shrinks the prompt's KV).
- cot: short prompt, long answer (decode-heavy; eviction has to keep up with generated KV).
- mix: each request is rag or cot, drawn with a seeded coin.

Exactness comes from the token ids: text made of seeded words is encoded, the ids are cut or
extended to the target length, and the ids themselves are sent (`"prompt": [ids]`), so no
re-tokenisation on the server can change the length. The decoded text is kept for logs only.
Any tokenizer with `encode(text)` and `decode(ids)` works (a transformers tokenizer, a stub).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Plain, common words: most tokenizers map each to one or two tokens, so the text is cheap
# to encode and its length in tokens is close to the word count.
WORDS = tuple("""
the of and to in is was for on that with as by at from this be are or an it which his her
their they were has had have not but all one two three first new also after other time year
city river water house school table report study data model memory cache token answer question
paper result method value number system market country world people group member field page
line word book story music light power energy space earth green blue red black white small large
long short early late north south east west open close start end build write read find give
keep show take make move turn hold bring carry speak learn teach grow fall rise stand walk
""".split())

# Default (input_len, output_len) of each request kind.
DEFAULT_SHAPES = {"rag": (7000, 64), "cot": (128, 1024)}
WORKLOADS = ("rag", "cot", "mix")


@dataclass(frozen=True)
class Shape:
    kind: str
    input_len: int
    output_len: int
    weight: float = 1.0


@dataclass(frozen=True)
class Prompt:
    index: int
    kind: str
    token_ids: list[int]
    output_len: int
    text: str


def make_shapes(workload: str, input_len: int | None = None, output_len: int | None = None,
                rag_fraction: float = 0.5) -> list[Shape]:
    """Request shapes of a workload.

    For rag and cot, input_len/output_len replace the defaults. For mix they set the long side
    of each kind: the rag prompt length and the cot answer length; the short sides keep the
    defaults (rag answers 64 tokens, cot prompts 128 tokens).
    """
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; choose one of {', '.join(WORKLOADS)}")
    if workload == "mix":
        if not 0.0 <= rag_fraction <= 1.0:
            raise ValueError(f"rag_fraction must be in [0, 1], got {rag_fraction}")
        rag_in, rag_out = DEFAULT_SHAPES["rag"]
        cot_in, cot_out = DEFAULT_SHAPES["cot"]
        shapes = [Shape("rag", input_len or rag_in, rag_out, rag_fraction),
                  Shape("cot", cot_in, output_len or cot_out, 1.0 - rag_fraction)]
    else:
        default_in, default_out = DEFAULT_SHAPES[workload]
        shapes = [Shape(workload, input_len or default_in, output_len or default_out)]
    for s in shapes:
        if s.input_len < 1 or s.output_len < 1:
            raise ValueError(f"token lengths must be >= 1, got {s}")
    return shapes


def _encode(tokenizer, text: str) -> list[int]:
    """Encode without BOS/EOS where the tokenizer supports it: specials would break exactness."""
    try:
        return list(tokenizer.encode(text, add_special_tokens=False))
    except TypeError:
        return list(tokenizer.encode(text))


def exact_length_ids(tokenizer, n_tokens: int, rng: np.random.Generator) -> list[int]:
    """Token ids of seeded word text, cut or extended to exactly n_tokens."""
    if n_tokens < 1:
        raise ValueError(f"n_tokens must be >= 1, got {n_tokens}")
    ids: list[int] = []
    while len(ids) < n_tokens:
        missing = n_tokens - len(ids)
        words = rng.choice(WORDS, size=missing + 8)
        text = " ".join(words)
        chunk = _encode(tokenizer, text if not ids else " " + text)
        if not chunk:
            raise ValueError("tokenizer encoded a non-empty text to no tokens")
        ids.extend(chunk)
    return ids[:n_tokens]


def build_prompts(tokenizer, shapes: list[Shape], num_requests: int, seed: int) -> list[Prompt]:
    """num_requests prompts; request i depends only on (seed, i), never on earlier requests."""
    weights = np.array([s.weight for s in shapes], dtype=float)
    if weights.sum() <= 0:
        raise ValueError("shape weights must not all be zero")
    weights /= weights.sum()
    prompts = []
    for i in range(num_requests):
        rng = np.random.default_rng([seed, i])
        shape = shapes[rng.choice(len(shapes), p=weights)]
        ids = exact_length_ids(tokenizer, shape.input_len, rng)
        prompts.append(Prompt(i, shape.kind, ids, shape.output_len, tokenizer.decode(ids)))
    return prompts
