"""A heuristic head mask until trained ones exist: rank KV heads by long-range attention mass.

NOT trained. For each (layer, KV head) we measure how much attention probability the model puts
on keys that a streaming head would have evicted, on a fixed text, and rank the heads by it:
heads that look far back become full heads first. The gates are that rank, rescaled to [0, 1]
(gate = rank / (N - 1), N = L x H, rank 0 = least long-range mass), so that the global top-k of
the gates at any head sparsity gives exactly the heuristic ranking.

    python -m vllm_kvevict.heuristic_mask [--model DIR] [--out DIR] [--tokens 4096]
                                          [--sink 64] [--window 256]

writes `<out>/heuristic.json` (objective "heuristic"); `--out` defaults to
`head_masks/<model-key>/`, `--model` to the bundled model. It is never a policy's default mask
(the trained PruLong / DuoAttention masks are); serve it with `--kv-mask PATH`, and the held-out
evaluation (`vllm_kvevict.train.evaluate`) compares it with the trained ones.

The measure. A streaming head at query position q keeps the keys [0, sink) and
[q - window, q] (the sink, the last `window` tokens before q and q itself: the project's decode
semantics, `policies/streaming.py`), so it evicts [sink, q - window).
For a query head, the long-range mass at q is the softmax probability on those evicted keys
under full causal attention. A KV head's score is its mean over the query positions whose
evicted range is not empty (q > sink + window) and over the query heads of its GQA group.

The text. Fixed and read from this Python's standard library on disk, so it is the same on
every machine with the same Python version (its Python version and the SHA-256 of the token ids
are recorded in the file): half English prose (the Zen of Python, decoded from `this.py`, then
the topics of `pydoc_data/topics.py`, the language reference text behind `help()`, in sorted
topic order), half Python source (the `json` package, `textwrap.py`, `argparse.py`), each
in that order as far as the budget reaches (at 4096 tokens: the Zen, two topics and the first
2048 tokens of `json/__init__.py`). Each document is tokenized on its own, without special
tokens; prose takes the first tokens // 2 ids, code the rest.

A caveat: diffuse attention scores high without retrieving anything (a head attending
uniformly to its causal keys scores about 0.78 at 4096 tokens with sink 64 / window 256; the
file records that reference as `uniform_attention_mass`). On SmolLM2 layers 0-10 score 0.10-0.76
and layers 11-29 at most 0.27, so this ranking makes the early layers full first; a trained mask
may well disagree.

The forward. The model runs in float32 with a custom attention function (registered in
transformers' AttentionInterface for the duration of the run) that computes plain causal
softmax attention, as the "eager" implementation does, block by block over query rows, so
attention probabilities are never held for a whole layer (4096 tokens would need 600 MB per
layer, 8192 tokens 2.4 GB), and accumulates the mass on the way. Nothing is random; with the
same Python, model and thread count the result is bit-identical. Across machines, float
rounding could swap heads whose masses are nearly equal.
"""

from __future__ import annotations

import argparse
import ast
import codecs
import hashlib
import os
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vllm_kvevict.config import DEFAULT_SINK, DEFAULT_WINDOW
from vllm_kvevict.masks import (HEAD_MASKS_DIR, HeadGates,
                                duo_quantile_full_heads, full_heads_at_sparsity,
                                load_head_gates, model_key, save_head_gates)
from vllm_kvevict.model import ensure_bundled_model

OBJECTIVE = "heuristic"
FILE_NAME = "heuristic.json"
DEFAULT_TOKENS = 4096
ATTN_IMPLEMENTATION = "kvevict_long_range_mass"
REPORT_SPARSITIES = (0.5, 0.7)
CODE_FILES = ("json/__init__.py", "json/decoder.py", "json/encoder.py", "json/scanner.py",
              "json/tool.py", "textwrap.py", "argparse.py")
NOTES = ("NOT trained: heuristic long-range attention mass ranking. Each (layer, KV head) is "
         "scored by the mean attention probability (over query positions q > sink + window and "
         "over the query heads of its GQA group) on keys a streaming head would have evicted, "
         "i.e. positions in [sink, q - window), under full causal attention on a fixed text "
         "read from the Python standard library: half prose (the Zen of Python, then "
         "pydoc_data topics in sorted order), half code (the json package, textwrap.py, "
         "argparse.py), each in that order as far as the token budget reaches; "
         "extra.text_sources lists what was used). "
         "gate = rank / (N - 1) of that score among the N heads (0 = least long-range mass), so "
         "the top-k of the gates at any sparsity is the heuristic ranking; gates are ranks, not "
         "probabilities. Raw scores in extra.long_range_mass. Made by "
         "`python -m vllm_kvevict.heuristic_mask`; to be replaced by trained masks when "
         "available.")


class HeuristicMaskError(ValueError):
    """A setting or input the heuristic cannot work with; the message says why."""


# -- the text -----------------------------------------------------------------------------------

@dataclass
class Corpus:
    token_ids: list[int]
    sources: list[dict[str, Any]]  # {"name", "kind", "tokens_used"} in order

    @property
    def sha256(self) -> str:
        data = ",".join(map(str, self.token_ids)).encode()
        return hashlib.sha256(data).hexdigest()


def _stdlib_dir() -> Path:
    return Path(sysconfig.get_path("stdlib"))


def _assigned_literal(path: Path, name: str) -> Any:
    """The literal assigned to a top-level `name` in a Python file, without importing it."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError) as exc:
        raise HeuristicMaskError(f"cannot read {path} for the heuristic text: {exc}") from None
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise HeuristicMaskError(f"{path} has no top-level assignment to {name!r}")


def prose_documents(stdlib: Path | None = None) -> list[tuple[str, str]]:
    """(name, text): the Zen of Python, then every pydoc topic in sorted order."""
    stdlib = stdlib or _stdlib_dir()
    zen = codecs.decode(_assigned_literal(stdlib / "this.py", "s"), "rot13")
    topics = _assigned_literal(stdlib / "pydoc_data" / "topics.py", "topics")
    docs = [("this.py (Zen of Python, rot13-decoded)", zen)]
    docs += [(f"pydoc_data/topics.py[{key!r}]", topics[key]) for key in sorted(topics)]
    return docs


def code_documents(stdlib: Path | None = None) -> list[tuple[str, str]]:
    stdlib = stdlib or _stdlib_dir()
    docs = []
    for rel in CODE_FILES:
        try:
            docs.append((rel, (stdlib / rel).read_text(encoding="utf-8")))
        except OSError as exc:
            raise HeuristicMaskError(f"cannot read {stdlib / rel} for the heuristic text: "
                                     f"{exc}") from None
    return docs


def _take(tokenizer, docs: list[tuple[str, str]], kind: str, count: int,
          ids: list[int], sources: list[dict[str, Any]]) -> None:
    need = count
    for name, text in docs:
        if need <= 0:
            break
        doc_ids = tokenizer(text.strip() + "\n\n", add_special_tokens=False)["input_ids"]
        used = doc_ids[:need]
        ids.extend(used)
        sources.append({"name": name, "kind": kind, "tokens_used": len(used)})
        need -= len(used)
    if need > 0:
        raise HeuristicMaskError(f"the {kind} text has only {count - need} tokens, "
                                 f"{count} needed")


def build_corpus(tokenizer, num_tokens: int, stdlib: Path | None = None) -> Corpus:
    """Exactly num_tokens ids: num_tokens // 2 of prose, then the rest of code."""
    if num_tokens < 1:
        raise HeuristicMaskError(f"--tokens must be positive, got {num_tokens}")
    ids: list[int] = []
    sources: list[dict[str, Any]] = []
    prose = num_tokens // 2
    _take(tokenizer, prose_documents(stdlib), "prose", prose, ids, sources)
    _take(tokenizer, code_documents(stdlib), "code", num_tokens - prose, ids, sources)
    assert len(ids) == num_tokens
    return Corpus(ids, sources)


# -- the measure --------------------------------------------------------------------------------

def evicted_keys(query_pos: torch.Tensor, num_keys: int, sink: int, window: int) -> torch.Tensor:
    """Bool [Q, num_keys]: the keys a streaming head has evicted when query q runs, i.e.
    sink <= k < q - window (it keeps [0, sink) and [q - window, q])."""
    keys = torch.arange(num_keys).view(1, -1)
    return (keys >= sink) & (keys < query_pos.view(-1, 1) - window)


@dataclass
class _MassAccumulator:
    num_layers: int
    num_kv_heads: int
    sink: int
    window: int
    query_block: int
    mass_sum: torch.Tensor = field(init=False)   # float64 [L, H]
    count: torch.Tensor = field(init=False)      # int64 [L]: query positions x group size
    seen: list[bool] = field(init=False)

    def __post_init__(self) -> None:
        self.mass_sum = torch.zeros(self.num_layers, self.num_kv_heads, dtype=torch.float64)
        self.count = torch.zeros(self.num_layers, dtype=torch.int64)
        self.seen = [False] * self.num_layers

    def attention(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                  **kwargs):
        """Causal softmax attention (as transformers' eager), accumulating long-range mass.

        query [B, Hq, T, D], key/value [B, Hkv, T, D]; returns ([B, T, Hq, D], None).
        """
        batch, num_q_heads, num_queries, head_dim = query.shape
        num_kv_heads, num_keys = key.shape[1], key.shape[2]
        if batch != 1 or num_queries != num_keys:
            raise HeuristicMaskError("the heuristic runs one sequence at once, without a cache "
                                     f"(got batch {batch}, {num_queries} queries, {num_keys} "
                                     f"keys)")
        layer = module.layer_idx
        if self.seen[layer]:
            raise HeuristicMaskError(f"layer {layer} ran twice in one forward")
        self.seen[layer] = True
        group = num_q_heads // num_kv_heads
        scale = head_dim ** -0.5 if scaling is None else scaling
        q = query[0].reshape(num_kv_heads, group, num_queries, head_dim)
        k, v = key[0], value[0]
        out = torch.empty(num_kv_heads, group, num_queries, head_dim, dtype=query.dtype)
        first_counted = self.sink + self.window + 1  # q > sink + window: evicted range non-empty
        mass = torch.zeros(num_kv_heads, dtype=torch.float64)
        for start in range(0, num_queries, self.query_block):
            stop = min(start + self.query_block, num_queries)
            pos = torch.arange(start, stop)
            logits = torch.einsum("hgtd,hnd->hgtn", q[:, :, start:stop], k[:, :stop]) * scale
            if attention_mask is not None:
                logits = logits + attention_mask[0, :, start:stop, :stop]
            future = torch.arange(stop).view(1, -1) > pos.view(-1, 1)
            logits.masked_fill_(future, float("-inf"))
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32).to(query.dtype)
            out[:, :, start:stop] = torch.einsum("hgtn,hnd->hgtd", probs, v[:, :stop])
            if stop > first_counted:
                rows = slice(max(first_counted - start, 0), stop - start)
                evicted = evicted_keys(pos[rows], stop, self.sink, self.window).to(probs.dtype)
                per_query = torch.einsum("hgtn,tn->hgt", probs[:, :, rows], evicted)
                mass += per_query.to(torch.float64).sum(dim=(1, 2))
        self.mass_sum[layer] = mass
        self.count[layer] = max(num_queries - first_counted, 0) * group
        out = out.reshape(num_q_heads, num_queries, head_dim).transpose(0, 1).unsqueeze(0)
        return out.contiguous(), None

    def result(self) -> torch.Tensor:
        if not all(self.seen):
            missing = [i for i, s in enumerate(self.seen) if not s]
            raise HeuristicMaskError(f"layers {missing} did not run the custom attention")
        if int(self.count.min()) == 0:
            raise HeuristicMaskError("no query position lies beyond sink + window; use more "
                                     "tokens or a smaller sink/window")
        return self.mass_sum / self.count.to(torch.float64).view(-1, 1)


def long_range_mass(model, input_ids: list[int] | torch.Tensor, sink: int, window: int,
                    query_block: int = 256) -> torch.Tensor:
    """float64 [L, H]: each KV head's mean attention mass on keys a streaming head evicts."""
    from transformers import AttentionInterface

    if sink < 0 or window < 0:
        raise HeuristicMaskError(f"sink and window must be non-negative, got {sink}, {window}")
    config = model.config
    ids = torch.as_tensor(input_ids, dtype=torch.long).view(1, -1)
    if ids.shape[1] <= sink + window + 1:
        raise HeuristicMaskError(f"{ids.shape[1]} tokens leave no query position beyond "
                                 f"sink + window = {sink + window}")
    acc = _MassAccumulator(config.num_hidden_layers, config.num_key_value_heads, sink, window,
                           query_block)
    AttentionInterface.register(ATTN_IMPLEMENTATION, acc.attention)
    previous = config._attn_implementation
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    try:
        with torch.inference_mode():
            model(input_ids=ids, use_cache=False, logits_to_keep=1)
    finally:
        model.set_attn_implementation(previous)
    return acc.result()


def uniform_mass(num_tokens: int, sink: int, window: int) -> float:
    """The score a head would get by attending uniformly to all its causal keys: a reference
    point, since diffuse attention scores high without retrieving anything."""
    qs = range(sink + window + 1, num_tokens)
    return sum((q - window - sink) / (q + 1) for q in qs) / len(qs) if qs else 0.0


def rank_gates(mass: torch.Tensor) -> torch.Tensor:
    """float32 [L, H]: rank / (N - 1) of each head's mass, rank 0 = least; equal masses rank
    in flat (layer-major) index order, as `full_heads_at_sparsity` breaks ties."""
    flat = mass.flatten().to(torch.float64)
    order = torch.sort(flat, stable=True).indices
    ranks = torch.empty_like(order)
    ranks[order] = torch.arange(flat.numel())
    if flat.numel() == 1:
        return torch.ones(mass.shape, dtype=torch.float32)  # a lone head: full
    gates = ranks.to(torch.float64) / (flat.numel() - 1)
    return gates.to(torch.float32).view(mass.shape)


def build_head_gates(mass: torch.Tensor, model_name: str, sink: int, window: int,
                     corpus: Corpus | None = None, extra: dict[str, Any] | None = None) -> HeadGates:
    info: dict[str, Any] = {
        "heuristic": "long_range_attention_mass",
        "gate_definition": "rank / (N - 1) of long_range_mass, N = num_layers * num_kv_heads",
        "evicted_keys": "sink <= k < q - window, for query positions q > sink + window",
        "long_range_mass": [[float(x) for x in row] for row in mass.tolist()],
    }
    if corpus is not None:
        info.update(uniform_attention_mass=uniform_mass(len(corpus.token_ids), sink, window),
                    num_tokens=len(corpus.token_ids), token_ids_sha256=corpus.sha256,
                    python_version=".".join(map(str, sys.version_info[:3])),
                    text_sources=corpus.sources)
    info.update(extra or {})
    meta = {"model": model_name, "objective": OBJECTIVE, "sink": sink, "window": window,
            "train_sparsity": None, "notes": NOTES, "extra": info}
    return HeadGates(gates=rank_gates(mass), log_alphas=None, meta=meta)


def full_heads_per_layer(gates: HeadGates, sparsity: float) -> list[int]:
    """Full heads in each layer at a head sparsity (PruLong's top-k rule)."""
    return full_heads_at_sparsity(gates, sparsity).sum(dim=1).tolist()


# -- the command --------------------------------------------------------------------------------

def _load_model(model_dir: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="eager")
    model.eval()
    return model, tokenizer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_kvevict.heuristic_mask",
        description="Write heuristic (NOT trained) head masks ranking KV heads by long-range "
                    "attention mass.")
    parser.add_argument("--model", type=Path, default=None,
                        help="HF model directory (default: the bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--out", type=Path, default=None,
                        help="output directory (default: head_masks/<model-key>/)")
    parser.add_argument("--tokens", type=int, default=DEFAULT_TOKENS,
                        help="tokens of text to run, capped at the model's context "
                             f"(default {DEFAULT_TOKENS})")
    parser.add_argument("--sink", type=int, default=DEFAULT_SINK)
    parser.add_argument("--window", type=int, default=DEFAULT_WINDOW)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = parser.parse_args(argv)

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(args.threads)
    if args.model is None:
        args.model = ensure_bundled_model()
    name = model_key(str(args.model))
    out = args.out or HEAD_MASKS_DIR / name

    started = time.monotonic()
    model, tokenizer = _load_model(args.model)
    context = int(getattr(model.config, "max_position_embeddings", args.tokens))
    tokens = args.tokens
    if tokens > context:
        print(f"--tokens {tokens} exceeds the model's context; using {context}")
        tokens = context
    corpus = build_corpus(tokenizer, tokens)
    mass = long_range_mass(model, corpus.token_ids, args.sink, args.window)
    gates = build_head_gates(mass, name, args.sink, args.window, corpus)
    elapsed = time.monotonic() - started

    out.mkdir(parents=True, exist_ok=True)
    path = out / FILE_NAME
    save_head_gates(path, gates)
    back = load_head_gates(path)
    if not torch.equal(back.gates, gates.gates):
        raise HeuristicMaskError(f"{path}: gates did not round-trip")
    print(f"wrote {path}")

    num_layers, num_heads = gates.shape
    print(f"{name}: {num_layers} layers x {num_heads} KV heads, {tokens} tokens, sink "
          f"{args.sink}, window {args.window}, {elapsed:.1f} s")
    print(f"(a head attending uniformly to all causal keys would score "
          f"{uniform_mass(tokens, args.sink, args.window):.4f})")
    print("layer  long-range mass per KV head        gate (rank / (N-1))")
    for layer in range(num_layers):
        masses = " ".join(f"{m:.4f}" for m in mass[layer].tolist())
        ranks = " ".join(f"{g:.3f}" for g in gates.gates[layer].tolist())
        print(f"{layer:5d}  {masses:<34} {ranks}")
    for sparsity in REPORT_SPARSITIES:
        counts = full_heads_per_layer(gates, sparsity)
        same = torch.equal(full_heads_at_sparsity(gates, sparsity),
                           duo_quantile_full_heads(gates, sparsity))
        print(f"sparsity {sparsity}: {sum(counts)} full heads; per layer {counts}; layers with "
              f"0 full heads: {counts.count(0)}; DuoAttention quantile rule "
              f"{'selects the same heads' if same else 'DIFFERS'}")
    print(f"wall time {elapsed:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
