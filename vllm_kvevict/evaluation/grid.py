"""What an evaluation run covers: settings, the servers that serve them, presets, bisection
and the cost estimate. No I/O with servers here (runner.py does that).

A *setting* is one point of one curve: (policy, eviction, sparsity, chunk, mask). A *server
config* is one `vllm serve` start. Head-mask policies fix their sparsity at start-up, so each
duo/prulong point needs its own server; snapkv/pyramidkv take the sparsity per request
(`vllm_xargs.kv_sparsity`), so one server per (policy, eviction, chunk) serves the whole sweep.
`full` and `streaming` are one setting each per chunk (streaming is the head-sparsity-1.0 point
of the duo and prulong curves).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from vllm_kvevict.config import EVICTION_MODES
from vllm_kvevict.config import HEAD_MASK_POLICIES as HEAD_MASK
from vllm_kvevict.config import TOKEN_EVICTION_POLICIES as TOKEN_EVICTION
from vllm_kvevict.launch import PolicySpec

EVICTIONS = tuple(sorted(EVICTION_MODES))  # ("naive", "patched")
# a head mask with token eviction on its full heads (--kv-token-policy), traced along head
# sparsity s: `prulong+snapkv` is prulong at s with snapkv at p = s, or at a fixed p
# (`GridSpec.hybrid_token_sparsities`: the (head, token) pairs of the compose issue)
HYBRIDS = tuple(f"{h}+{t}" for h in HEAD_MASK for t in TOKEN_EVICTION)
# `METHOD@fp8`: the method served with `--kv-cache-dtype fp8` (scored against full attention
# in the model's dtype, so the curve shows what quantization and eviction cost together)
FP8_METHODS = ("full@fp8", "prulong@fp8")
METHODS = ("full", "streaming") + HEAD_MASK + TOKEN_EVICTION + HYBRIDS + FP8_METHODS


def kv_cache_dtype(method: str) -> str:
    """`prulong@fp8` -> `fp8`; `auto` without a suffix."""
    return method.partition("@")[2] or "auto"


def base_method(method: str) -> str:
    """The method without its cache dtype (`prulong@fp8` -> `prulong`)."""
    return method.partition("@")[0]


def head_policy(method: str) -> str:
    """The head-mask part of a method (`prulong+snapkv` -> `prulong`), else the method."""
    return base_method(method).partition("+")[0]


def per_point(method: str) -> bool:
    """Head masks fix their sparsity at start-up: one server per point of the curve."""
    return head_policy(method) in HEAD_MASK
OBS_WINDOW = 64  # patched eviction runs the last 64 prompt tokens with every non-final chunk


def file_digest(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:12]


@dataclass(frozen=True)
class ServerConfig:
    policy: str
    chunk: int
    sparsity: float | None = None     # duo/prulong (and hybrids) only: fixed per server
    eviction: str | None = None       # snapkv/pyramidkv (and hybrids) only
    mask: str | None = None           # duo/prulong (and hybrids) only: the mask file served
    token_sparsity: float | None = None  # hybrids only: fixed p (None: p = head sparsity)

    def policy_spec(self):
        """The served policy (`launch.PolicySpec`); a hybrid's token sparsity is its own
        if set, else its head sparsity."""

        head, _, token = base_method(self.policy).partition("+")
        p = self.sparsity if self.token_sparsity is None else self.token_sparsity
        return PolicySpec(head, self.sparsity, self.eviction, token_policy=token or None,
                          token_sparsity=p if token else None)

    @property
    def server_args(self) -> list[str]:
        """vLLM flags of the method beyond the policy (its KV cache dtype)."""
        dtype = kv_cache_dtype(self.policy)
        return [] if dtype == "auto" else ["--kv-cache-dtype", dtype]

    @property
    def slug(self) -> str:
        parts = [f"c{self.chunk}", self.policy]
        if self.eviction:
            parts.append(self.eviction)
        if self.token_sparsity is not None:
            parts.append(f"t{self.token_sparsity:g}")
        if self.sparsity is not None:
            parts.append(f"s{self.sparsity:g}")
        if self.mask:
            parts.append(Path(self.mask).stem)
        return "-".join(parts)


@dataclass(frozen=True)
class Setting:
    server: ServerConfig
    sparsity: float | None = None     # the point: head sparsity or token sparsity p
    mask_digest: str | None = None

    @property
    def key(self) -> str:
        """Identity of the setting in the results file (resume matches on it). The mask's
        content digest is part of it: results of a retrained mask never mix with old ones."""
        s = self.server
        parts = [f"chunk={s.chunk}", s.policy]
        if s.eviction:
            parts.append(s.eviction)
        if s.token_sparsity is not None:  # absent for p = s: keys of older runs still match
            parts.append(f"t={s.token_sparsity:g}")
        if self.sparsity is not None:
            parts.append(f"s={self.sparsity:g}")
        if self.mask_digest:
            parts.append(f"mask={self.mask_digest}")
        return "/".join(parts)

    @property
    def vllm_xargs(self) -> dict:
        if self.server.policy in TOKEN_EVICTION:
            return {"kv_sparsity": self.sparsity}
        return {}


@dataclass(frozen=True)
class Sweep:
    """One curve to trace at one chunk size: its candidate sparsities and how they are served."""
    policy: str
    chunk: int
    eviction: str | None
    candidates: tuple[float, ...]
    mask: str | None = None
    token_sparsity: float | None = None  # hybrids: fixed p (None: p = head sparsity)

    @property
    def label(self) -> str:
        label = f"{self.policy}-{self.eviction}" if self.eviction else self.policy
        return label if self.token_sparsity is None else f"{label}-t{self.token_sparsity:g}"

    def setting(self, sparsity: float, mask_digest: str | None = None) -> Setting:
        if per_point(self.policy):
            server = ServerConfig(self.policy, self.chunk, sparsity, self.eviction, self.mask,
                                  self.token_sparsity)
        else:
            server = ServerConfig(self.policy, self.chunk, None, self.eviction)
        return Setting(server, sparsity, mask_digest)


@dataclass(frozen=True)
class GridSpec:
    tasks: tuple[str, ...]
    lengths: tuple[int, ...]
    per_category: int
    chunks: tuple[int, ...]
    methods: tuple[str, ...] = METHODS
    evictions: tuple[str, ...] = EVICTIONS
    head_sparsities: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7, 0.9)
    token_sparsities: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7, 0.9)
    # hybrids: one curve per entry, None = token sparsity equal to head sparsity
    hybrid_token_sparsities: tuple[float | None, ...] = (None,)
    bisect: bool = True
    masks: Mapping[str, str | None] = field(default_factory=dict)  # policy -> mask path
    seed: int = 0

    def sweeps(self, chunk: int) -> list[Sweep]:
        out = []
        for policy in self.methods:
            if base_method(policy) in HEAD_MASK:
                out.append(Sweep(policy, chunk, None, tuple(self.head_sparsities),
                                 self.masks.get(head_policy(policy))))
            elif policy in TOKEN_EVICTION:
                out += [Sweep(policy, chunk, e, tuple(self.token_sparsities))
                        for e in self.evictions]
            elif policy in HYBRIDS:
                out += [Sweep(policy, chunk, e, tuple(self.head_sparsities),
                              self.masks.get(head_policy(policy)), t)
                        for e in self.evictions for t in self.hybrid_token_sparsities]
        return out

    def fixed_settings(self, chunk: int) -> list[Setting]:
        """full and streaming: one setting each, run before the sweeps (the sweeps' bisection
        needs the full-attention score, and streaming closes the head-mask curves)."""
        return [Setting(ServerConfig(p, chunk)) for p in ("full", "streaming", "full@fp8")
                if p in self.methods]


PRESETS: dict[str, dict] = {
    # CI-sized: two servers (full; snapkv patched serving two sparsities per request), 1K-token
    # prompts, 4 per category (each recall task once, 4 ICL): 24 requests, < 5 min on a core.
    "smoke": dict(lengths=(1024,), per_category=4, chunks=(256,), methods=("full", "snapkv"),
                  evictions=("patched",), token_sparsities=(0.5, 0.9), bisect=False),
    # The documented grid (README.md: why this size): 2K prompts, the paper's chunk ratios
    # (1/16 and 1/4 of the prompt), PyramidKV as the paper's main token-eviction method.
    "default": dict(lengths=(2048,), per_category=9, chunks=(128, 512),
                    methods=("full", "streaming", "duo", "prulong", "pyramidkv")),
}


def preset(name: str, tasks: Sequence[str], **overrides) -> GridSpec:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    values = {**PRESETS[name], **{k: v for k, v in overrides.items() if v is not None}}
    return GridSpec(tasks=tuple(tasks), **values)


# ----------------------------------------------------------------------------- bisection

def first_failure(points: Mapping[float, float], threshold: float) -> float | None:
    """Walking up in sparsity (down in footprint), the first measured point under the
    threshold, i.e. where the critical footprint's bracket ends (see critical.py)."""
    for s in sorted(points):
        if points[s] < threshold:
            return s
    return None


def next_sparsities(candidates: Sequence[float],
                    measured: Mapping[float, Mapping[str, float]],
                    thresholds: Mapping[str, float]) -> list[float]:
    """Sparsities to run next for one curve.

    Nothing measured yet: the two ends and the middle of the candidates. Afterwards, per
    category, the candidate halfway between the last passing and the first failing measured
    sparsity, until the two are neighbours among the candidates (then the interpolation has
    the bracket the full grid would give it). `measured` maps sparsity -> category -> score.
    """
    cands = sorted(set(candidates))
    if not cands:
        return []
    if not measured:
        return sorted({cands[0], cands[len(cands) // 2], cands[-1]})
    wanted = set()
    for category, threshold in thresholds.items():
        scores = {s: cats[category] for s, cats in measured.items() if category in cats}
        fail = first_failure(scores, threshold)
        if fail is None:
            continue  # reached at every measured point: the curve's low end bounds it
        passing = [s for s in scores if s < fail]
        if not passing:
            continue  # already the least sparse point fails
        inside = [c for c in cands if max(passing) < c < fail and c not in measured]
        if inside:
            wanted.add(inside[len(inside) // 2])
    return sorted(wanted)


def first_round(candidates: Sequence[float], seen: Sequence[float],
                thresholds: Mapping[str, float], bisect: bool) -> list[float]:
    """Sparsities a sweep runs first: every candidate, or the bisection's opening three, and in
    both cases every candidate an earlier run measured for some of the examples (`seen`).
    A run that adds examples thus gives them the same points the older examples have: the
    report pairs examples across a curve's points, so a point the new examples lack would
    drop them from the whole curve."""
    opening = next_sparsities(candidates, {}, thresholds) if bisect else list(candidates)
    return sorted(set(opening) | (set(seen) & set(candidates)))


def worst_case_points(candidates: int, categories: int, bisect: bool) -> int:
    """Points one curve can need: all candidates, or with bisection 3 to start and then
    log2 of a bracket per category (categories may share points, so often fewer)."""
    if not bisect or candidates <= 3:
        return candidates
    return min(candidates, 3 + categories * math.ceil(math.log2(max(2, candidates // 2))))


# --------------------------------------------------------------------------------- cost

@dataclass(frozen=True)
class CostModel:
    """Seconds on this machine (one vLLM worker thread; see README.md for the measurement)."""
    prefill_s_per_token: float = 0.0035
    decode_s_per_token: float = 0.03
    server_start_s: float = 30.0


@dataclass(frozen=True)
class Estimate:
    servers: int
    requests: int
    prompt_tokens: int
    seconds: float

    def __add__(self, other: "Estimate") -> "Estimate":
        return Estimate(self.servers + other.servers, self.requests + other.requests,
                        self.prompt_tokens + other.prompt_tokens,
                        self.seconds + other.seconds)


def request_seconds(length: int, max_tokens: int, chunk: int, patched: bool,
                    cost: CostModel) -> tuple[int, float]:
    """(tokens the server runs, seconds) of one request."""
    extra = OBS_WINDOW * max(0, math.ceil(length / chunk) - 1) if patched else 0
    tokens = length + extra
    return tokens, tokens * cost.prefill_s_per_token + max_tokens * cost.decode_s_per_token


def estimate(spec: GridSpec, examples: Sequence[tuple[int, int]], categories: int,
             cost: CostModel = CostModel()) -> tuple[Estimate, Estimate]:
    """(full grid, worst case with bisection) for `examples` = (length, max_tokens) pairs."""
    def per_setting(chunk: int, patched: bool) -> Estimate:
        runs = [request_seconds(n, m, chunk, patched, cost) for n, m in examples]
        return Estimate(0, len(runs), sum(t for t, _ in runs), sum(s for _, s in runs))

    server = Estimate(1, 0, 0, cost.server_start_s)
    totals = []
    for bisect in (False, True):
        total = Estimate(0, 0, 0, 0.0)
        for chunk in spec.chunks:
            for _ in spec.fixed_settings(chunk):
                total += server + per_setting(chunk, False)
            for sweep in spec.sweeps(chunk):
                points = worst_case_points(len(sweep.candidates), categories,
                                           bisect and spec.bisect)
                one = per_setting(chunk, sweep.eviction == "patched")
                servers = points if per_point(sweep.policy) else 1
                for _ in range(servers):
                    total += server
                for _ in range(points):
                    total += one
        totals.append(total)
    return totals[0], totals[1]


def with_masks(spec: GridSpec, masks: Iterable[tuple[str, str]]) -> GridSpec:
    merged = dict(spec.masks)
    for policy, path in masks:
        if policy not in HEAD_MASK:
            raise ValueError(f"--mask applies to {', '.join(HEAD_MASK)}, not {policy!r}")
        merged[policy] = path
    return replace(spec, masks=merged)
