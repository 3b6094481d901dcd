"""From result records (one per setting and example) to score-vs-footprint curves per method,
chunk size and task category, with paired bootstrap resampling of examples.

A category's score at a setting is the mean over its tasks of the task's mean score (the paper
averages datasets within a category); its footprint is averaged the same way. The streaming
setting (every head streaming) is the sparsity-1.0 point of the duo and prulong curves, as in
the paper's grid (head sparsity 0.1 ... 1.0).

Bootstrap: one replicate draws, within each task, as many examples as it has, with replacement,
and uses the same draw for every setting and for full attention (paired: all settings answer
the same prompts). The threshold (90 % of full attention) is recomputed per replicate.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

from vllm_kvevict.config import HEAD_MASK_POLICIES as HEAD_MASK_METHODS
from vllm_kvevict.evaluation.critical import (FRACTION, Critical, critical_footprint,
                                              percentile_interval)

FOOTPRINT_METRICS = ("footprint", "measured_footprint", "peak_kv")


def method_label(record: dict) -> str:
    """`duo`, `prulong`, `snapkv-patched`, ... (eviction mode only where it exists), and a
    hybrid's fixed token sparsity (`prulong+snapkv-patched-t0.25`; none where p = s)."""
    label = record["method"]
    if record.get("eviction"):
        label = f"{label}-{record['eviction']}"
    if record.get("token_sparsity") is not None:
        label = f"{label}-t{record['token_sparsity']:g}"
    return label


def fixed_token(label: str) -> tuple[str, str] | None:
    """A hybrid label's fixed token sparsity, split off (`prulong+snapkv-patched-t0.25` ->
    (`prulong+snapkv-patched`, `0.25`)); None for any other label (the inverse of the suffix
    `method_label` adds)."""
    base, sep, token = label.rpartition("-t")
    return (base, token) if sep and "+" in base else None


@dataclass
class Curve:
    method: str
    chunk: int
    category: str
    sparsities: list[float]
    tasks: list[str]                      # task of each example column
    examples: list[str]                   # example ids (columns)
    scores: np.ndarray                    # [settings, examples]
    footprints: dict[str, np.ndarray]     # metric -> [settings, examples]
    full_scores: np.ndarray               # [examples]
    task_columns: dict[str, np.ndarray] = field(default_factory=dict)
    length: int = 0                       # prompt length of the examples (tokens)
    # mean log-prob of each example's gold answer [settings, examples] and under full
    # attention [examples]; None when some record lacks it (a run without log-probs)
    logprobs: np.ndarray | None = None
    full_logprobs: np.ndarray | None = None

    @property
    def section(self) -> tuple[int, int]:
        """(prompt length, chunk): the report's table sections and plot rows."""
        return self.length, self.chunk

    def __post_init__(self) -> None:
        self.task_columns = {t: np.array([i for i, u in enumerate(self.tasks) if u == t])
                             for t in dict.fromkeys(self.tasks)}

    def aggregate(self, matrix: np.ndarray, picks: dict[str, np.ndarray] | None = None
                  ) -> np.ndarray:
        """Mean over tasks of the per-task mean along the last axis; `picks` maps a task to
        column indices (a bootstrap draw), default all of the task's columns."""
        means = []
        for task, cols in self.task_columns.items():
            chosen = cols if picks is None else picks[task]
            means.append(matrix[..., chosen].mean(axis=-1))
        return np.mean(means, axis=0)

    def point_scores(self, picks=None) -> np.ndarray:
        return self.aggregate(self.scores, picks)

    def point_footprints(self, metric: str = "footprint", picks=None) -> np.ndarray:
        return self.aggregate(self.footprints[metric], picks)

    def full_score(self, picks=None) -> float:
        return float(self.aggregate(self.full_scores, picks))

    def critical(self, metric: str = "footprint", picks=None,
                 fraction: float = FRACTION) -> Critical:
        return critical_footprint(self.point_footprints(metric, picks), self.point_scores(picks),
                                  fraction * self.full_score(picks))

    def bootstrap(self, replicates: int, seed: int, metric: str = "footprint",
                  fraction: float = FRACTION) -> list[Critical]:
        return [self.critical(metric, picks, fraction)
                for picks in self.draws(replicates, seed)]

    def interval(self, replicates: int, seed: int, metric: str = "footprint",
                 level: float = 0.95) -> tuple[Critical, Critical]:
        return percentile_interval(self.bootstrap(replicates, seed, metric), level)

    def draws(self, replicates: int, seed: int) -> list[dict[str, np.ndarray]]:
        """The bootstrap's column draws (paired: every curve with the same examples and seed
        gets the same ones)."""
        rng = np.random.default_rng(seed)
        return [{t: rng.choice(cols, size=cols.size, replace=True)
                 for t, cols in self.task_columns.items()} for _ in range(replicates)]

    def logprob_gap(self, picks=None) -> np.ndarray:
        """Per point, the gold answer's mean log-prob minus full attention's (nats per token,
        aggregated as scores are: mean over tasks of task means; paired per example)."""
        return self.aggregate(self.logprobs - self.full_logprobs, picks)

    def logprob_at(self, footprints: np.ndarray, metric: str = "footprint",
                   picks=None) -> np.ndarray:
        """The log-prob gap read off the curve at the given footprints: linear between its
        points ordered by footprint (the Pareto plot's line), clamped at its ends."""
        x = self.point_footprints(metric, picks)
        order = np.argsort(x, kind="stable")
        return np.interp(footprints, x[order], self.logprob_gap(picks)[order])


    def restricted(self, examples: list[str]) -> "Curve":
        """The same curve on a subset of its examples, in the given order."""
        idx = [self.examples.index(e) for e in examples]
        cols = lambda m: None if m is None else m[..., idx]  # noqa: E731
        return Curve(self.method, self.chunk, self.category, self.sparsities,
                     [self.tasks[i] for i in idx], list(examples), self.scores[:, idx],
                     {k: v[:, idx] for k, v in self.footprints.items()},
                     self.full_scores[idx], length=self.length, logprobs=cols(self.logprobs),
                     full_logprobs=cols(self.full_logprobs))


def paired(a: Curve, b: Curve) -> tuple[Curve, Curve] | None:
    """Both curves on the examples both hold (in a's order), so that one bootstrap draw picks
    the same prompts for both; None if they share none. A 9-example and a 24-example curve
    are thus compared on their 9 common examples instead of not at all."""
    common = set(b.examples)
    shared = [e for e in a.examples if e in common]
    if not shared:
        return None
    if shared == a.examples == b.examples:
        return a, b
    return a.restricted(shared), b.restricted(shared)


def _sparsity_of(record: dict) -> float:
    return 1.0 if record["method"].partition("@")[0] == "streaming" else float(
        record["sparsity"])


def build_curves(records: Iterable[dict]) -> tuple[list[Curve], list[str]]:
    """Curves for every (method, chunk, category) with a full-attention reference at that
    chunk; examples are the ones every point of the curve and the reference answered (a
    partial run is reported on what it has, with a note)."""
    records = list(records)
    notes: list[str] = []
    # (label, chunk, prompt length) -> sparsity -> example -> record
    table: dict[tuple[str, int, int], dict[float, dict[str, dict]]] = defaultdict(
        lambda: defaultdict(dict))
    task_of: dict[str, tuple[str, str]] = {}
    replaced: set[tuple[str, int, float]] = set()

    def put(label: str, chunk: int, sparsity: float, r: dict) -> None:
        # Two settings on one curve point (e.g. a run with an older mask in the same file):
        # the newest run wins, and the report says so.
        old = table[(label, chunk, r["length"])][sparsity].get(r["example"])
        if old is not None and old["setting"] != r["setting"]:
            replaced.add((label, chunk, sparsity))
            if old.get("run", "") > r.get("run", ""):
                return
        table[(label, chunk, r["length"])][sparsity][r["example"]] = r

    for r in records:
        task_of[r["example"]] = (r["task"], r["category"])
        label = method_label(r)
        if label.partition("@")[0] == "streaming":  # closes the head-mask curves (same dtype)
            suffix = label[len("streaming"):]
            for m in HEAD_MASK_METHODS:
                put(m + suffix, r["chunk"], 1.0, r)
            continue
        put(label, r["chunk"], 0.0 if label.partition("@")[0] == "full" else _sparsity_of(r),
            r)
    notes += [f"{label} chunk {chunk} sparsity {s:g}: records of more than one setting "
              f"(different masks?); the newest run's are used" for label, chunk, s in
              sorted(replaced)]
    curves = []
    for (label, chunk, length), points in sorted(table.items()):
        if label == "full":
            continue
        full = table.get(("full", chunk, length), {}).get(0.0)
        if not full:
            notes.append(f"{label} at chunk {chunk}, {length} tokens: no full-attention run "
                         f"there; skipped")
            continue
        sparsities = sorted(points)
        if label.partition("@")[0] in HEAD_MASK_METHODS and sparsities == [1.0]:
            continue  # only the streaming point: no run of this method
        categories = sorted({task_of[e][1] for p in points.values() for e in p})
        for category in categories:
            common = set(full)
            for s in sparsities:
                common &= set(points[s])
            examples = sorted(e for e in common if task_of[e][1] == category)
            wanted = {e for s in sparsities for e in points[s] if task_of[e][1] == category}
            if len(examples) < len(wanted):
                notes.append(f"{label} chunk {chunk} {category}: {len(examples)} of "
                             f"{len(wanted)} examples answered at every point; using those")
            if not examples:
                continue
            scores = np.array([[points[s][e]["score"] for e in examples] for s in sparsities])
            foot = {m: np.array([[_metric(points[s][e], m) for e in examples]
                                 for s in sparsities]) for m in FOOTPRINT_METRICS}
            gold = [[points[s][e].get("gold_logprob") for e in examples] for s in sparsities]
            full_gold = [full[e].get("gold_logprob") for e in examples]
            measured = all(x is not None for row in gold + [full_gold] for x in row)
            curves.append(Curve(label, chunk, category, sparsities,
                                [task_of[e][0] for e in examples], examples, scores, foot,
                                np.array([full[e]["score"] for e in examples]), length=length,
                                logprobs=np.array(gold, dtype=float) if measured else None,
                                full_logprobs=np.array(full_gold, dtype=float)
                                if measured else None))
    return curves, notes


def _metric(record: dict, metric: str) -> float:
    value = record.get(metric)
    return float("nan") if value is None else float(value)
