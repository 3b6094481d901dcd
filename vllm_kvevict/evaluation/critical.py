"""The critical KV footprint (the paper, section 2.1): the smallest KV footprint at which a
method keeps a fraction F (90 %) of full attention's score, by linear interpolation between the
measured points of its score-vs-footprint curve (as in the paper's Table 2).

"Retains" is read as: the score stays at or above the threshold for every larger footprint
that was measured. We walk the curve down from its largest footprint and stop at the first
point under the threshold; the crossing is interpolated between that point and the one above
it. A lucky point far down the curve (small samples are noisy) cannot then produce a low
critical footprint while points above it fail.

Censored outcomes, written like the paper's table:
- never reached (even the largest measured footprint scores below the threshold): `>x_max`;
- always reached (even the smallest measured footprint is at or above it): `<x_min`, the true
  value lies below the grid;
- undefined: full attention scores 0, so 90 % of it is no bar at all (or no points).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

FRACTION = 0.9


@dataclass(frozen=True)
class Critical:
    kind: str       # "interpolated" | "always" | "never" | "undefined"
    value: float    # the footprint for interpolated; the grid bound for always/never; nan

    @property
    def sort_value(self) -> float:
        """For percentiles: censored values go to the far end they point at."""
        if self.kind == "always":
            return -math.inf
        if self.kind == "never":
            return math.inf
        return self.value

    def format(self, scale: float = 100.0, digits: int = 1) -> str:
        if self.kind == "undefined":
            return "n/a"
        text = f"{self.value * scale:.{digits}f}"
        return {"always": "<", "never": ">"}.get(self.kind, "") + text


def critical_footprint(footprints: Sequence[float], scores: Sequence[float],
                       threshold: float) -> Critical:
    """Critical footprint of one curve; see the module docstring for the rule."""
    x = np.asarray(footprints, dtype=float)
    y = np.asarray(scores, dtype=float)
    if x.shape != y.shape:
        raise ValueError(f"{x.shape} footprints vs {y.shape} scores")
    if x.size == 0 or not threshold > 0:
        return Critical("undefined", math.nan)
    order = np.argsort(-x, kind="stable")  # largest footprint first
    x, y = x[order], y[order]
    below = np.nonzero(y < threshold)[0]
    if below.size == 0:
        return Critical("always", float(x[-1]))
    first = int(below[0])
    if first == 0:
        return Critical("never", float(x[0]))
    x_hi, y_hi, x_lo, y_lo = x[first - 1], y[first - 1], x[first], y[first]
    # y_hi >= threshold > y_lo, so the denominator is positive.
    value = x_lo + (threshold - y_lo) * (x_hi - x_lo) / (y_hi - y_lo)
    return Critical("interpolated", float(value))


def percentile_interval(samples: Sequence[Critical], level: float = 0.95) -> tuple[Critical,
                                                                                      Critical]:
    """Percentile interval of bootstrap replicates; an end that falls on censored replicates
    is censored itself (e.g. `<0.31` when more than 2.5 % of replicates reach 90 % at every
    measured footprint)."""
    defined = [s for s in samples if s.kind != "undefined"]
    if not defined:
        nan = Critical("undefined", math.nan)
        return nan, nan
    values = np.sort([s.sort_value for s in defined])
    tail = (1.0 - level) / 2.0
    ends = []
    for q in (tail, 1.0 - tail):
        # "lower" / "higher" pick a real replicate: no interpolation across an infinity.
        method = "lower" if q < 0.5 else "higher"
        v = float(np.quantile(values, q, method=method))
        if v == -math.inf:
            ends.append(next(s for s in defined if s.kind == "always"))
        elif v == math.inf:
            ends.append(next(s for s in defined if s.kind == "never"))
        else:
            ends.append(Critical("interpolated", v))
    return ends[0], ends[1]
