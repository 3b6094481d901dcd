"""The paper's critical-KV-footprint table (Markdown) and its Figure-3-style plot (PNG), from a
results JSONL written by the runner.

    python -m vllm_kvevict.evaluation report --results R.jsonl --out-dir docs/results/evaluation

table.md: per chunk size, one row per method (the paper's order: DuoAttention -> PruLong,
PyramidKV naive -> patched, SnapKV naive -> patched), one column per task category, each cell
the critical footprint in % with its bootstrap 95 % interval; then the same for the measured
footprint (real KV bytes), full attention's scores, and every curve point.
pareto.png: score vs KV footprint per category (columns) and (prompt length, chunk) (rows),
full attention's score (gray) and 90 % of it (red) as horizontal dashed lines.
logprob.png: the same axes with the gold answer's log-prob gap to full attention (runs that
scored log-probs).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from vllm_kvevict.evaluation.critical import FRACTION
from vllm_kvevict.evaluation.curves import Curve, build_curves, fixed_token, paired
from vllm_kvevict.evaluation.runner import ResultStore

ROW_ORDER = ("duo", "prulong", "pyramidkv-naive", "pyramidkv-patched", "snapkv-naive",
             "snapkv-patched")
DISPLAY = {"duo": "DuoAttention", "prulong": "→ PruLong",
           "pyramidkv-naive": "PyramidKV (naive)", "pyramidkv-patched": "→ PyramidKV (patched)",
           "snapkv-naive": "SnapKV (naive)", "snapkv-patched": "→ SnapKV (patched)",
           "prulong+snapkv-patched": "PruLong + SnapKV (patched), head = token sparsity",
           "prulong+pyramidkv-patched": "PruLong + PyramidKV (patched), head = token sparsity",
           "full@fp8": "full attention, fp8 KV", "prulong@fp8": "→ PruLong, fp8 KV"}
COLORS = {"duo": "tab:blue", "prulong": "tab:green", "pyramidkv-naive": "tab:orange",
          "pyramidkv-patched": "tab:red", "snapkv-naive": "tab:purple",
          "snapkv-patched": "tab:brown", "prulong+snapkv-patched": "black",
          "prulong+pyramidkv-patched": "tab:gray", "full@fp8": "tab:pink",
          "prulong@fp8": "tab:olive"}


def display(method: str) -> str:
    """A curve's row name; a hybrid at a fixed token sparsity (`...-t0.25`) is named by it."""
    fixed = fixed_token(method)
    if fixed and fixed[0] in DISPLAY:
        return DISPLAY[fixed[0]].replace("head = token sparsity", f"token sparsity {fixed[1]}")
    return DISPLAY.get(method, method)


def line_style(method: str) -> tuple[str | None, str]:
    """(color, line style) of a curve: a hybrid at a fixed token sparsity is drawn dashed in
    its s = p curve's color, so no curve falls back to a color another method already has."""
    fixed = fixed_token(method)
    if fixed and fixed[0] in COLORS:
        return COLORS[fixed[0]], "--"
    return COLORS.get(method), "-"


def parts(method: str) -> tuple[str, str] | None:
    """A hybrid curve's two parts (`prulong+snapkv-patched-t0.25` -> `prulong`,
    `snapkv-patched`), None for any other curve."""
    fixed = fixed_token(method)
    head, plus, token = (fixed[0] if fixed else method).partition("+")
    return (head, token) if plus else None


CATEGORY_ORDER = ("recall", "tracing", "aggregation", "icl")
CATEGORY_TITLES = {"recall": "Recall", "tracing": "Tracing", "aggregation": "Aggregation",
                   "icl": "ICL"}
METRIC_TITLES = {"footprint": "KV footprint", "measured_footprint": "measured footprint "
                 "(real KV bytes)", "peak_kv": "peak KV"}


def load_records(path: Path) -> list[dict]:
    """Every record of a results file, superseded ones included."""
    records = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut by a killed run; the runner redoes that request
    return records


# A task enters the curves at a prompt length only where full attention answers it well there
# (the evaluation issue's bar: a column must not rest on a task the model cannot do at all).
FULL_SCORE_BAR = {"icl": 0.6}
DEFAULT_BAR = 0.8


def headline_records(records: Sequence[dict]) -> tuple[list[dict], list[str]]:
    """The records of the (task, prompt length) pairs on which full attention scores at least
    its category's bar (each example's score averaged over the chunk sizes full ran it at),
    and a note per pair left out. A pair without a full-attention record stays (the curves
    need full attention anyway and say so)."""
    per: dict[tuple[str, int, str], dict[str, list[float]]] = defaultdict(
        lambda: defaultdict(list))
    for r in records:
        if r["method"] == "full":
            per[(r["task"], r["length"], r["category"])][r["example"]].append(r["score"])
    dropped, notes = set(), []
    for (task, length, category), examples in sorted(per.items()):
        bar = FULL_SCORE_BAR.get(category, DEFAULT_BAR)
        score = float(np.mean([np.mean(v) for v in examples.values()]))
        if score < bar:
            dropped.add((task, length))
            notes.append(f"{task} at {length} tokens is left out of the curves: full attention "
                         f"scores {100 * score:.1f} % on it ({len(examples)} examples), below "
                         f"the {100 * bar:.0f} % bar for {category} tasks (its records stay "
                         f"in the results file and in the full-attention table)")
    return [r for r in records if (r["task"], r["length"]) not in dropped], notes


def categories_of(curves: Sequence[Curve]) -> list[str]:
    """The paper's column order: recall first."""
    present = {c.category for c in curves}
    return [c for c in CATEGORY_ORDER if c in present] + sorted(present - set(CATEGORY_ORDER))


def _order(curves: Sequence[Curve]) -> list[str]:
    present = {c.method for c in curves}
    return [m for m in ROW_ORDER if m in present] + sorted(present - set(ROW_ORDER))


def sections(curves: Sequence[Curve]) -> list[tuple[int, int]]:
    """(prompt length, chunk) pairs, in order."""
    return sorted({c.section for c in curves})


def section_title(section: tuple[int, int]) -> str:
    length, chunk = section
    return f"{length}-token prompts, prefill chunk {chunk}"


def critical_table(curves: Sequence[Curve], metric: str, replicates: int, seed: int) -> str:
    lines = []
    categories = categories_of(curves)
    by_key = {(c.method, c.section, c.category): c for c in curves}
    for section in sections(curves):
        lines += [f"**{section_title(section)}** — critical {METRIC_TITLES[metric]} (%) ↓, "
                  f"bootstrap 95 % interval in brackets, examples paired across the "
                  f"curve's points in parentheses", "",
                  "| Method | " + " | ".join(CATEGORY_TITLES.get(c, c) for c in categories)
                  + " |",
                  "|---|" + "---:|" * len(categories)]
        for method in _order([c for c in curves if c.section == section]):
            cells = []
            for category in categories:
                curve = by_key.get((method, section, category))
                if curve is None:
                    cells.append("–")
                    continue
                point = curve.critical(metric)
                lo, hi = curve.interval(replicates, seed, metric)
                cells.append(f"{point.format()} [{lo.format()}, {hi.format()}] "
                             f"({len(curve.examples)})")
            lines.append(f"| {display(method)} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def full_scores_table(records: Sequence[dict]) -> str:
    per: dict[tuple[int, int, str, str], list[dict]] = defaultdict(list)
    for r in records:
        if r["method"] == "full":
            per[(r["length"], r["chunk"], r["category"], r["task"])].append(r)
    lines = ["| prompt | chunk | category | task | examples | full-attention score (%) | "
             "gold log-prob (nats/token) |", "|---:|---:|---|---|---:|---:|---:|"]
    for (length, chunk, category, task), rs in sorted(per.items()):
        gold = [r["gold_logprob"] for r in rs if r.get("gold_logprob") is not None]
        lines.append(f"| {length} | {chunk} | {category} | {task} | {len(rs)} | "
                     f"{100 * np.mean([r['score'] for r in rs]):.1f} | "
                     f"{f'{np.mean(gold):.3f}' if gold else '–'} |")
    return "\n".join(lines)


def points_table(curves: Sequence[Curve]) -> str:
    lines = ["| prompt | chunk | method | category | sparsity | examples | footprint % | "
             "measured % | peak KV % | score % | % of full | log-prob - full |",
             "|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for c in sorted(curves, key=lambda c: (c.section, _order(curves).index(c.method),
                                           c.category)):
        full = c.full_score()
        foot, meas, peak = (c.point_footprints(m) for m in
                            ("footprint", "measured_footprint", "peak_kv"))
        gap = c.logprob_gap() if c.logprobs is not None else None
        for i, s in enumerate(c.sparsities):
            score = c.point_scores()[i]
            rel = f"{100 * score / full:.0f}" if full > 0 else "n/a"
            lp = "–" if gap is None else f"{gap[i]:+.3f}"
            lines.append(f"| {c.length} | {c.chunk} | {c.method} | {c.category} | {s:g} | "
                         f"{len(c.examples)} | {100 * foot[i]:.1f} | {100 * meas[i]:.1f} | "
                         f"{100 * peak[i]:.1f} | {100 * score:.1f} | {rel} | {lp} |")
    return "\n".join(lines)


# The paper's comparisons and fp8 against the model's dtype: (candidate, baseline); then
# every hybrid curve against each of its parts (`parts`).
PAIRS = (("prulong", "duo"), ("pyramidkv-patched", "pyramidkv-naive"),
         ("snapkv-patched", "snapkv-naive"), ("prulong@fp8", "prulong"))


def probability_lower(a: Curve, b: Curve, replicates: int, seed: int,
                      metric: str = "footprint") -> float | None:
    """Share of paired bootstrap replicates in which `a` has the lower critical footprint
    (ties, e.g. both censored at the same end, count one half). Same seed and same example
    columns give both curves the same draws. None if the curves answered different examples."""
    if a.examples != b.examples:
        return None
    xs = [c.sort_value for c in a.bootstrap(replicates, seed, metric)]
    ys = [c.sort_value for c in b.bootstrap(replicates, seed, metric)]
    wins = sum(1.0 if x < y else 0.5 if x == y else 0.0 for x, y in zip(xs, ys))
    return wins / len(xs)


def pairs(curves: Sequence[Curve]) -> Iterator[tuple[Curve, Curve]]:
    """(candidate, baseline) curves of each of PAIRS, per section and category, where both
    were run."""
    by_key = {(c.method, c.section, c.category): c for c in curves}
    hybrids = [(m, part) for m in _order(curves) for part in parts(m) or ()]
    for section in sections(curves):
        for category in categories_of(curves):
            for cand, base in list(PAIRS) + hybrids:
                a = by_key.get((cand, section, category))
                b = by_key.get((base, section, category))
                if a is not None and b is not None:
                    yield a, b


def _pair_cells(a: Curve, b: Curve) -> str:
    return f"| {a.length} | {a.chunk} | {a.category} | {a.method} | {b.method} |"


def comparisons_table(curves: Sequence[Curve], replicates: int, seed: int) -> str:
    lines = ["| prompt | chunk | category | candidate | baseline | critical % (candidate / "
             "baseline) on the examples both answered | P(candidate lower) |",
             "|---:|---:|---|---|---|---|---:|"]
    for a, b in pairs(curves):
        both = paired(a, b)
        if both is None:
            lines.append(f"{_pair_cells(a, b)} no example in common | n/a |")
            continue
        a, b = both
        p = probability_lower(a, b, replicates, seed)
        lines.append(f"{_pair_cells(a, b)} {a.critical().format()} / {b.critical().format()} "
                     f"({len(a.examples)}) | {p:.2f} |")
    return "\n".join(lines) if len(lines) > 2 else ""


MATCHED_POINTS = 21  # footprints at which two curves are compared, evenly over their overlap
SAME_FOOTPRINT = 0.02  # footprints this close at every shared sparsity count as matched


def matched_footprint_difference(a: Curve, b: Curve, picks=None, metric: str = "footprint"
                                 ) -> tuple[float, float, float] | None:
    """(low, high, difference): over the footprint range both curves span, the mean of
    (candidate's log-prob gap - baseline's), each read off its curve at the same footprints.
    Equal sparsity is not equal memory for every pair (naive eviction's observation-window
    floor keeps more at high sparsity than patched); this compares what each keeps for the
    same KV. None if the ranges do not overlap."""
    fa, fb = a.point_footprints(metric, picks), b.point_footprints(metric, picks)
    low, high = max(fa.min(), fb.min()), min(fa.max(), fb.max())
    if not low < high:
        return None
    grid = np.linspace(low, high, MATCHED_POINTS)
    diff = a.logprob_at(grid, metric, picks) - b.logprob_at(grid, metric, picks)
    return float(low), float(high), float(np.mean(diff))


def _interval_cells(point: float, reps: Sequence[float]) -> str:
    if not reps:
        return f"{point:+.4f} | n/a"
    lo, hi = np.percentile(reps, [2.5, 97.5])
    return f"{point:+.4f} [{lo:+.4f}, {hi:+.4f}] | {float(np.mean(np.array(reps) > 0)):.2f}"


def logprob_comparisons_table(curves: Sequence[Curve], replicates: int, seed: int) -> str:
    """The same pairs on the continuous score, two ways, each with a paired bootstrap
    interval over examples and the share of replicates in which the candidate is higher:
    at equal sparsity (the mean over the sparsities both ran of candidate's gold log-prob -
    baseline's, nats per token) and at matched footprint (`matched_footprint_difference`)."""
    lines = ["| prompt | chunk | category | candidate | baseline | sparsities | at equal "
             "sparsity [95 %] | P(higher) | footprint range (%) | at matched footprint "
             "[95 %] | P(higher) |", "|---:|---:|---|---|---|---|---|---:|---|---|---:|"]
    for a, b in pairs(curves):
        both = paired(a, b)
        if both is None or a.logprobs is None or b.logprobs is None:
            continue
        a, b = both
        shared = sorted(set(a.sparsities) & set(b.sparsities) - {1.0})
        if not shared:
            continue
        ia = [a.sparsities.index(x) for x in shared]
        ib = [b.sparsities.index(x) for x in shared]
        diff = lambda picks=None: float(np.mean(a.logprob_gap(picks)[ia]
                                                - b.logprob_gap(picks)[ib]))
        draws = a.draws(replicates, seed)
        cells = _interval_cells(diff(), [diff(p) for p in draws])
        matched = matched_footprint_difference(a, b)
        apart = np.max(np.abs(a.point_footprints()[ia] - b.point_footprints()[ib]))
        if apart <= SAME_FOOTPRINT:
            # Equal sparsity is already equal memory (two head masks): reading one curve's
            # chords against the other's measured points would only add interpolation bias.
            cells += f" | same (≤ {100 * apart:.1f} apart) | as at equal sparsity | –"
        elif matched is None:
            cells += " | no overlap | – | –"
        else:
            low, high, point = matched
            reps = [m[2] for m in (matched_footprint_difference(a, b, p) for p in draws)
                    if m is not None]
            cells += f" | {100 * low:.1f}–{100 * high:.1f} | {_interval_cells(point, reps)}"
        lines.append(f"{_pair_cells(a, b)} {', '.join(f'{x:g}' for x in shared)} | {cells} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def chunk_sensitivity_table(curves: Sequence[Curve], replicates: int = 1000,
                            seed: int = 0) -> str:
    """Score at the smallest chunk minus the score at the largest, at the sparsities both ran
    (the paper's Figure 4, left: smaller chunks lose score at equal settings), with paired
    bootstrap intervals over the examples both chunks answered (the same draws for both),
    the same for the gold answer's log-prob, and the share of replicates in which the small
    chunk's critical footprint is the higher one."""
    by_key = {(c.method, c.length, c.chunk, c.category): c for c in curves}
    lines = ["| prompt | method | category | sparsities | chunks (small, large) | score, small "
             "- large (points) [95 %] | P(small lower) | footprint, small - large (points) | "
             "gold log-prob, small - large [95 %] | P(small lower) | critical % (small / "
             "large) on the examples both answered | P(small's higher) |",
             "|---:|---|---|---|---|---|---:|---:|---|---:|---|---:|"]
    for length in sorted({c.length for c in curves}):
        chunks = sorted({c.chunk for c in curves if c.length == length})
        if len(chunks) < 2:
            continue
        small, large = chunks[0], chunks[-1]
        for method in _order(curves):
            for category in categories_of(curves):
                a = by_key.get((method, length, small, category))
                b = by_key.get((method, length, large, category))
                if a is not None and b is not None:
                    row = _sensitivity_row(a, b, replicates, seed)
                    if row:
                        lines.append(f"| {length} | {display(method)} | {category} "
                                     f"| {row[0]} | {small}, {large} | {row[1]} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def _sensitivity_row(a: Curve, b: Curve, replicates: int, seed: int) -> tuple[str, str] | None:
    """(sparsities both ran, the row's other cells): small chunk `a` minus large chunk `b`,
    on the examples both answered."""
    shared = sorted(set(a.sparsities) & set(b.sparsities))
    both = paired(a, b)
    if not shared or both is None:
        return None
    a, b = both
    ia = [a.sparsities.index(s) for s in shared]
    ib = [b.sparsities.index(s) for s in shared]
    # gold log-probs at the shared sparsities < 1, as the pairs' table (a head mask's
    # streaming point is a different policy, streaming)
    lp = [(i, j) for i, j, s in zip(ia, ib, shared) if s < 1.0]
    score = lambda p=None: float(np.mean(a.point_scores(p)[ia] - b.point_scores(p)[ib]))  # noqa: E731
    gold = lambda p=None: float(np.mean([a.logprob_gap(p)[i] - b.logprob_gap(p)[j]  # noqa: E731
                                         for i, j in lp]))
    d_foot = np.mean(a.point_footprints()[ia] - b.point_footprints()[ib])
    draws = a.draws(replicates, seed)
    score_cells = _lower_cells(score(), [score(p) for p in draws], 100, 1)
    gold_cells = ("n/a | –" if a.logprobs is None or b.logprobs is None or not lp else
                  _lower_cells(gold(), [gold(p) for p in draws], 1, 4))
    higher = probability_lower(b, a, replicates, seed)  # a higher = b lower
    crit = f"{a.critical().format()} / {b.critical().format()} ({len(a.examples)})"
    return (", ".join(f"{s:g}" for s in shared),
            f"{score_cells} | {100 * d_foot:+.1f} | {gold_cells} | {crit} | {higher:.2f}")


def _lower_cells(point: float, reps: Sequence[float], scale: float, digits: int) -> str:
    """A difference (times `scale`) with its bootstrap interval, and the share of replicates
    below 0."""
    f = lambda x: f"{scale * x:+.{digits}f}"  # noqa: E731
    if not reps:
        return f"{f(point)} | n/a"
    lo, hi = np.percentile(reps, [2.5, 97.5])
    return f"{f(point)} [{f(lo)}, {f(hi)}] | {float(np.mean(np.array(reps) < 0)):.2f}"


def write_table(records: Sequence[dict], curves: Sequence[Curve], notes: Sequence[str],
                path: Path, replicates: int, seed: int, command: str | None,
                superseded: int = 0) -> str:
    n_examples = len({r["example"] for r in records})
    text = [
        "# Critical KV footprint on the bundled model (SmolLM2-135M-Instruct)", "",
        f"Smallest KV footprint at which a method keeps {100 * FRACTION:.0f} % of full "
        "attention's score (the paper's Table 2), by linear interpolation between measured "
        "points; `<x`: reached at every measured point (the true value lies below the grid), "
        "`>x`: not reached even at the largest measured footprint. Intervals: "
        f"{replicates} bootstrap replicates over examples (seed {seed}), paired across "
        "settings. Head-mask curves end at the streaming point (head sparsity 1.0).", "",
        f"Records: {len(records)}; distinct examples: {n_examples}"
        + (f"; {superseded} more lines superseded, not used (cut by a smaller generation "
           "budget than the task's today, or followed by a later record of the same setting "
           "and example)." if superseded else "."), ""]
    if command:
        text += [f"Produced by: `{command}`", ""]
    text += [critical_table(curves, "footprint", replicates, seed), ""]
    pairs = comparisons_table(curves, replicates, seed)
    if pairs:
        text += ["## The paper's comparisons", "",
                 "P(candidate lower): share of paired bootstrap replicates in which the "
                 "candidate's critical footprint is below the baseline's. Every comparison "
                 "below is on the examples both curves answered (their number in "
                 "parentheses), so its critical footprints can differ from the table above "
                 "when one curve holds more examples.", "", pairs, ""]
    gold = logprob_comparisons_table(curves, replicates, seed)
    if gold:
        text += ["## The same comparisons on the gold answer's log-prob", "",
                 "The continuous score: each example's gold answer teacher-forced through the "
                 "policy (`vllm_xargs.kv_teacher_forced` with `prompt_logprobs`), its mean "
                 "log-prob per token minus full attention's on the same example; a column is "
                 "the candidate's minus the baseline's, averaged either over the sparsities "
                 "both ran (head-mask curves without the streaming point) or over "
                 f"{MATCHED_POINTS} evenly spaced footprints in the range both curves span, "
                 "each curve read linearly between its points (equal sparsity is not equal "
                 "memory for naive vs patched eviction). Positive: the candidate keeps the "
                 "answer more likely.", "", gold, ""]
    sensitivity = chunk_sensitivity_table(curves, replicates, seed)
    if sensitivity:
        text += ["## Chunk-size sensitivity", "", sensitivity, ""]
    text += ["## The same with the measured footprint (real KV bytes held)", "",
             critical_table(curves, "measured_footprint", replicates, seed), "",
             "## Full attention", "", full_scores_table(records), "",
             "## Every curve point", "", points_table(curves), ""]
    if notes:
        text += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    out = "\n".join(text)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(out)
    return out


def plot_pareto(curves: Sequence[Curve], path: Path, metric: str = "footprint",
                y: str = "score") -> None:
    """Score (or, y="logprob", the gold log-prob gap to full attention) vs footprint: one panel
    per (prompt length, chunk) row and category column, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if y == "logprob":
        curves = [c for c in curves if c.logprobs is not None]
    rows = sections(curves)
    categories = categories_of(curves)
    width, height = max(6.5, 4.2 * len(categories)), 3.4 * len(rows)
    fig, axes = plt.subplots(len(rows), len(categories), squeeze=False,
                             figsize=(width, height))
    for row, section in enumerate(rows):
        for col, category in enumerate(categories):
            ax = axes[row][col]
            here = [c for c in curves if c.section == section and c.category == category]
            full = None
            for c in sorted(here, key=lambda c: _order(curves).index(c.method)):
                x = 100 * c.point_footprints(metric)
                v = c.logprob_gap() if y == "logprob" else 100 * c.point_scores()
                order = np.argsort(x)
                color, ls = line_style(c.method)
                ax.plot(x[order], v[order], marker="o", ms=3.5, lw=1.4, color=color, ls=ls,
                        label=display(c.method))
                full = 0.0 if y == "logprob" else 100 * c.full_score()
            if full is not None:
                ax.axhline(full, color="gray", ls="--", lw=1.0)
                if y == "score":
                    ax.axhline(FRACTION * full, color="red", ls="--", lw=1.0)
            ax.set_title(f"{CATEGORY_TITLES.get(category, category)} — {section[0]} tokens, "
                         f"chunk {section[1]}", fontsize=10)
            ax.set_xlim(0, 102)
            if y == "score":
                ax.set_ylim(0, 105)
            ax.grid(alpha=0.3)
            if row == len(rows) - 1:
                ax.set_xlabel(f"{METRIC_TITLES[metric]} (%)")
            if col == 0:
                ax.set_ylabel("gold log-prob - full (nats/token)" if y == "logprob"
                              else "score (%)")
    seen: dict[str, object] = {}  # one legend entry per method over all panels
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(label, handle)
    ncol = max(1, min(len(seen), 2 if len(categories) == 1 else 3))
    legend = 0.1 + 0.22 * -(-len(seen) // ncol)  # inches of legend under the panels
    fig.set_size_inches(width, height + legend)
    bottom = legend / (height + legend)
    fig.legend(list(seen.values()), list(seen.keys()), loc="lower center", ncol=ncol,
               fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, bottom, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)


def report(results: Path, out_dir: Path, replicates: int = 1000, seed: int = 0,
           command: str | None = None) -> tuple[Path, Path]:

    store = ResultStore(results)  # the records a resumed run would stand on
    records = store.records
    if not records:
        raise ValueError(f"{results} holds no records")
    kept, dropped_notes = headline_records(records)
    curves, notes = build_curves(kept)
    notes = dropped_notes + notes
    if not curves:
        raise ValueError(f"{results}: no curve has both its points and a full-attention run "
                         f"at the same chunk size" + ("; " + "; ".join(notes) if notes else ""))
    table = out_dir / "table.md"
    plot = out_dir / "pareto.png"
    write_table(records, curves, notes, table, replicates, seed, command,
                store.lines - len(records))
    plot_pareto(curves, plot)
    if any(c.logprobs is not None for c in curves):
        plot_pareto(curves, out_dir / "logprob.png", y="logprob")
    return table, plot
