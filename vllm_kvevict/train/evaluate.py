"""Held-out next-token loss of head masks at one head sparsity, in exact chunked inference mode.

    python -m vllm_kvevict.train.evaluate --model DIR --masks a.json b.json ... \
        --sparsity 0.7 --seq-len 4096 --num-seqs 4 --chunk 1024 [--sink 64 --window 256]

Sequences: the first `--num-seqs` of the held-out stream (`data.py`: sources held out by name,
every book among them; text and code drawn with probability 1/2 each, seeded), exactly
`--seq-len` tokens each, tokenized with the model's tokenizer. The held-out split must be the
one the masks were trained with (same `--held-out-fraction`, default 10 %).

Rows (each evaluated on the same sequences):
- `full`: every head full (the unmodified model);
- each mask file: its gates thresholded by `masks.full_heads_at_sparsity` (the round(S x N)
  lowest gates stream);
- `random(seed)`: uniform random gates from a seeded generator, thresholded the same way;
- `streaming`: every head streaming (unless `--no-streaming`), the floor.

Each row runs `ReferenceRunner.prefill(ids, chunk, all_logits=True)`, the reference oracle's
exact chunk loop with its explicit KV cache and evictions (`HeadMaskPolicy` through
`policies.build_policy`), not the trainer's one-pass form. Columns: mean next-token loss over
all n - 1 predictions; the same over the predictions made at positions >= chunk (the first
chunk is fully causal for every head, so only those can differ); perplexity; loss minus full.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

import vllm_kvevict.train.data as data_mod
from vllm_kvevict.config import DEFAULT_SINK, DEFAULT_WINDOW, KVPolicyConfig
from vllm_kvevict.masks import (HeadGates, check_shape, full_heads_at_sparsity,
                                load_head_gates)
from vllm_kvevict.policies import build_policy
from vllm_kvevict.reference import ReferenceRunner
from vllm_kvevict.train.trainer import DTYPES, load_model_and_tokenizer


@dataclass
class Method:
    name: str
    policy: str  # "full" | "streaming" | "prulong"
    full_heads: torch.Tensor | None = None  # bool [L, H] for "prulong"
    source: str = ""


@dataclass
class Result:
    name: str
    full_heads: int
    total_heads: int
    loss: float
    late_loss: float  # predictions at positions >= chunk; nan if none
    per_seq: list[float]

    @property
    def ppl(self) -> float:
        return math.exp(self.loss)


def held_out_sequences(encode: data_mod.Encode, eos_id: int, seq_len: int, num_seqs: int,
                       seed: int = 0, held_out_fraction: float = data_mod.DEFAULT_HELD_OUT_FRACTION,
                       sources: list[data_mod.Source] | None = None,
                       text_share: float = data_mod.DEFAULT_TEXT_SHARE
                       ) -> list[data_mod.PackedSequence]:
    if sources is None:
        sources = data_mod.discover_sources()
    _, held = data_mod.split_sources(sources, held_out_fraction)
    if not held:
        raise ValueError("no held-out sources")
    stream = data_mod.mixed_stream(held, encode, eos_id, seq_len, seed, text_share, "held-out",
                                   max_passes=1)
    return data_mod.take(stream, num_seqs)


def build_methods(num_layers: int, num_kv_heads: int, sparsity: float,
                  mask_paths: list[str], random_seed: int | None = 0,
                  with_streaming: bool = True) -> list[Method]:
    methods = [Method("full", "full")]
    for path in mask_paths:
        gates = load_head_gates(path)
        check_shape(gates, num_layers, num_kv_heads, str(path))
        methods.append(Method(f"{Path(path).parent.name}/{Path(path).name}", "prulong",
                              full_heads_at_sparsity(gates, sparsity), str(path)))
    if random_seed is not None:
        g = torch.Generator().manual_seed(random_seed)
        # drawn on the CPU (a CPU generator); the policy's masks stay on the CPU, the runner
        # moves what it needs to the model's device
        gates = HeadGates(gates=torch.rand(num_layers, num_kv_heads, generator=g,
                                           device="cpu"))
        methods.append(Method(f"random(seed={random_seed})", "prulong",
                              full_heads_at_sparsity(gates, sparsity)))
    if with_streaming:
        methods.append(Method("streaming (all heads)", "streaming"))
    return methods


def sequence_losses(runner: ReferenceRunner, ids: list[int], chunk: int) -> tuple[float, float, int]:
    """(sum of all n - 1 losses, sum over positions >= chunk, count of the latter)."""
    logits = runner.prefill(ids, chunk, all_logits=True).logits
    targets = torch.tensor(ids[1:], dtype=torch.long, device=logits.device)
    losses = F.cross_entropy(logits[:-1].float(), targets, reduction="none")
    late = losses[chunk:]
    return float(losses.sum()), float(late.sum()), late.numel()


def evaluate(model: torch.nn.Module, sequences: list[list[int]], methods: list[Method],
             chunk: int, sink: int, window: int, progress: bool = True) -> list[Result]:
    from tqdm import tqdm

    cfg = model.config
    num_layers, num_kv_heads = cfg.num_hidden_layers, cfg.num_key_value_heads
    results = []
    bar = tqdm(total=len(methods) * len(sequences), disable=not progress, desc="evaluate",
               unit="seq", dynamic_ncols=True)
    for method in methods:
        config = KVPolicyConfig(policy=method.policy, sink=sink, window=window)
        policy = build_policy(config, num_layers, num_kv_heads, full_heads=method.full_heads,
                              mask_source=method.source)
        runner = ReferenceRunner(model, policy, dtype=next(model.parameters()).dtype)
        total = late = 0.0
        count = late_count = 0
        per_seq = []
        for ids in sequences:
            s, s_late, n_late = sequence_losses(runner, list(ids), chunk)
            total, late = total + s, late + s_late
            count, late_count = count + len(ids) - 1, late_count + n_late
            per_seq.append(s / (len(ids) - 1))
            bar.update(1)
        full = int((~policy.streaming_heads()).sum())
        results.append(Result(method.name, full, num_layers * num_kv_heads, total / count,
                              late / late_count if late_count else float("nan"), per_seq))
    bar.close()
    return results


@dataclass(frozen=True)
class Paired:
    """Mean of a - b over sequences, its paired-bootstrap 95 % interval, and on how many
    sequences a is lower."""

    mean: float
    low: float
    high: float
    lower: int
    n: int

    def __str__(self) -> str:
        return (f"{self.mean:+.4f} [{self.low:+.4f}, {self.high:+.4f}], lower on "
                f"{self.lower}/{self.n}")


def paired_difference(a: list[float], b: list[float], replicates: int = 10000,
                      seed: int = 0, level: float = 0.95) -> Paired:
    """Per-sequence losses of two methods on the same sequences: resample sequences with
    replacement (the same draw for both), the percentile interval of the mean difference."""
    d = torch.tensor(a, dtype=torch.float64) - torch.tensor(b, dtype=torch.float64)
    n = len(d)
    idx = torch.randint(n, (replicates, n), generator=torch.Generator().manual_seed(seed))
    means = d[idx].mean(dim=1)
    tail = (1 - level) / 2
    low, high = torch.quantile(means, torch.tensor([tail, 1 - tail], dtype=torch.float64))
    return Paired(float(d.mean()), float(low), float(high), int((d < 0).sum()), n)


def format_paired(results: list[Result]) -> str:
    """Every method against full attention, and every pair of sparse methods, paired per
    sequence (a difference much smaller than the spread between sequences shows here)."""
    lines = ["paired loss differences, mean [95 % bootstrap interval] over sequences:"]
    full = next((r for r in results if r.name == "full"), None)
    sparse = [r for r in results if r.name != "full"]
    if full is not None:
        for r in sparse:
            lines.append(f"  {r.name} - full: {paired_difference(r.per_seq, full.per_seq)}")
    for i, a in enumerate(sparse):
        for b in sparse[i + 1:]:
            lines.append(f"  {a.name} - {b.name}: {paired_difference(a.per_seq, b.per_seq)}")
    return "\n".join(lines)


def format_table(results: list[Result], sparsity: float, chunk: int) -> str:
    base = results[0].loss if results and results[0].name == "full" else None
    head = (f"{'method':<34} {'full heads':>10} {'loss':>8} {'loss@>=' + str(chunk):>12} "
            f"{'ppl':>9} {'d loss':>8}")
    lines = [f"head sparsity {sparsity:g} (masks and random); chunk {chunk}", head,
             "-" * len(head)]
    for r in results:
        delta = "" if base is None else f"{r.loss - base:+.4f}"
        late = "-" if math.isnan(r.late_loss) else f"{r.late_loss:.4f}"
        lines.append(f"{r.name[:34]:<34} {f'{r.full_heads}/{r.total_heads}':>10} "
                     f"{r.loss:>8.4f} {late:>12} {r.ppl:>9.3f} {delta:>8}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vllm_kvevict.train.evaluate",
                                description="Held-out next-token loss of head masks (reference "
                                            "oracle, exact chunked prefill).")
    p.add_argument("--model", required=True)
    p.add_argument("--masks", nargs="*", default=[], help="mask files (any format masks reads)")
    p.add_argument("--sparsity", type=float, default=0.7)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--num-seqs", type=int, default=4)
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--sink", type=int, default=DEFAULT_SINK)
    p.add_argument("--window", type=int, default=DEFAULT_WINDOW)
    p.add_argument("--seed", type=int, default=0, help="held-out stream order")
    p.add_argument("--random-seed", type=int, default=0, help="seed of the random mask")
    p.add_argument("--no-random", action="store_true")
    p.add_argument("--no-streaming", action="store_true")
    p.add_argument("--held-out-fraction", type=float,
                   default=data_mod.DEFAULT_HELD_OUT_FRACTION)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default="cpu", help="torch device: cpu (default), cuda, ...")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    started = time.perf_counter()
    model, encode, eos = load_model_and_tokenizer(args.model, DTYPES[args.dtype])
    model = model.to(torch.device(args.device))
    cfg = model.config
    methods = build_methods(cfg.num_hidden_layers, cfg.num_key_value_heads, args.sparsity,
                            args.masks, None if args.no_random else args.random_seed,
                            not args.no_streaming)
    for path in args.masks:
        meta = load_head_gates(path).meta
        if meta.get("sink") not in (None, args.sink) or meta.get("window") not in (None,
                                                                                 args.window):
            print(f"note: {path} was trained with sink {meta.get('sink')} / window "
                  f"{meta.get('window')}; evaluating with {args.sink} / {args.window}")
    seqs = held_out_sequences(encode, eos, args.seq_len, args.num_seqs, args.seed,
                              args.held_out_fraction)
    print(f"{len(seqs)} held-out sequences of {args.seq_len} tokens: "
          + "; ".join(f"{s.kind} {'+'.join(s.sources)}" for s in seqs), flush=True)
    with torch.no_grad():
        results = evaluate(model, [list(s.ids) for s in seqs], methods, args.chunk, args.sink,
                           args.window, progress=not args.no_progress)
    print(format_table(results, args.sparsity, args.chunk))
    if len(seqs) > 1:
        print(format_paired(results))
    print(f"({time.perf_counter() - started:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "model": args.model, "sparsity": args.sparsity, "seq_len": args.seq_len,
            "chunk": args.chunk, "sink": args.sink, "window": args.window,
            "sequences": [{"kind": s.kind, "sources": list(s.sources)} for s in seqs],
            "results": [{**r.__dict__, "ppl": r.ppl} for r in results]}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
