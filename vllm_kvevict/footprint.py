"""The paper's KV footprint and peak KV ("Cache Me If You Can", section 2 and appendix A), exact.

Time runs along the query axis: the n prompt positions (processed in prefill chunks), then the m
decode steps. For every query position q we count, per (layer, KV head), the KV entries at
positions <= q that are not yet evicted (active or inactive); the footprint is that count summed
over all positions and averaged over heads, divided by the same count for full causal attention,
T(n + m) with T(x) = x(x + 1) / 2.

Per head, for a prefill chunk [a, b) of length c = b - a (K = sink + window):
- streaming head: the chunk sees sink + the last `window` tokens before a (min(a, K) entries,
  which equals Lw + Sk with Lw = min(W, a), Sk = min(s, a - Lw)) and itself causally:
  T(c) + c * min(a, K). A decode step at current length a holds 1 + min(a, K).
- full head: T(c) + past * c with past = a; decode adds T(m) + n * m, so T(n + m) in total.
- token eviction (snapkv, pyramidkv): like a full head, but `past` grows only by the tokens a
  layer keeps of each chunk, `policy.chunk_keep(...).kept`. The chunk itself is whole while it
  runs; decode tokens are evicted only with a decode budget B (decode-time eviction: after
  every E-th decode step a layer holding more than B keeps B). Tokens appended for patched scoring are not counted
  (they are not part of the n + m sequence and their KVs are dropped at once).

`chunk_held=True` counts instead what a real engine holds: a prefill chunk's KVs are all
written before its attention runs, so each of its c queries is charged the whole chunk (c * c
instead of T(c)), for the policy and for full attention alike. The ratio of real memory to
this figure isolates an implementation's own overhead (blocks, patched scoring rows) from the
structural cost of chunked prefill, which no engine that computes a chunk at once avoids.

Peak KV: the largest per-step count of un-evicted entries, averaged over heads, as a fraction of
n + m (so full attention gives 1.0). Inside a chunk every head's count rises by one per query,
and in decode it never falls, so the maximum over all n + m steps is attained at a chunk's last
query (past + c, or min(a, K) + c for a streaming head) or at the last decode step (past + m, or
1 + min(n + m - 1, K)). Heads are summed at the same step before taking the maximum.

With a decoupled eviction chunk (`eviction_chunk`: evict once per E tokens, vLLM prefilling in
smaller steps), `chunk_boundaries` are the eviction chunks' ends and `step_boundaries` the ends of
the steps vLLM ran; with `chunk_held` a step's queries are then charged the chunk's tokens up to
the step's end (what the engine holds), not the whole chunk.

All counts are Python integers, so the only rounding is the final division.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from vllm_kvevict.policies.base import KVPolicy


def tri(x: int) -> int:
    """T(x) = x(x+1)/2: the causal entries of x queries over themselves."""
    return x * (x + 1) // 2


@dataclass(frozen=True)
class FootprintResult:
    footprint: float     # entries / full_entries
    peak_kv: float       # largest per-step un-evicted count (head average) / (n + m)
    entries: float       # un-evicted entries summed over query positions, averaged over heads
    full_entries: float  # T(n + m)


def chunk_boundaries_for(prompt_len: int, chunk_size: int) -> list[int]:
    """Chunk end positions of a prompt prefilled `chunk_size` tokens at a time."""
    if prompt_len < 1 or chunk_size < 1:
        raise ValueError(f"need prompt_len >= 1 and chunk_size >= 1, got {prompt_len}, "
                         f"{chunk_size}")
    return list(range(chunk_size, prompt_len, chunk_size)) + [prompt_len]


def _check(prompt_len: int, chunk_boundaries: Sequence[int], decode_len: int) -> list[int]:
    for name, value, lo in (("prompt_len", prompt_len, 1), ("decode_len", decode_len, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < lo:
            raise ValueError(f"{name} must be an integer >= {lo}, got {value!r}")
    bounds = list(chunk_boundaries)
    if not bounds:
        raise ValueError("chunk_boundaries is empty; expected chunk end positions ending at "
                         f"prompt_len={prompt_len}")
    prev = 0
    for b in bounds:
        if isinstance(b, bool) or not isinstance(b, int) or b <= prev:
            raise ValueError(f"chunk_boundaries must be strictly increasing positive integers "
                             f"(chunk end positions), got {bounds}")
        prev = b
    if bounds[-1] != prompt_len:
        raise ValueError(f"last chunk boundary {bounds[-1]} != prompt_len {prompt_len}")
    return bounds


def _sum_min(lo: int, hi: int, cap: int) -> int:
    """Sum of min(a, cap) for a in [lo, hi): the decode steps of a streaming head, closed form."""
    if hi <= lo:
        return 0
    mid = min(max(lo, cap), hi)  # a < mid contributes a, a >= mid contributes cap
    below = (mid - lo) * (lo + mid - 1) // 2
    return below + (hi - mid) * cap


def eviction_boundaries(step_boundaries: Sequence[int], prompt_len: int,
                        eviction_chunk: int | None) -> list[int]:
    """The ends of the eviction chunks among the ends of the prefill steps vLLM ran."""
    if eviction_chunk is None:
        return list(step_boundaries)
    return [b for b in step_boundaries if b % eviction_chunk == 0 or b == prompt_len]


def _chunk_term(c: int, chunk_held: bool, steps: Sequence[int] | None = None) -> int:
    """A chunk's entries over itself: causal (the paper), or held (what an engine holds:
    each step's queries see the chunk up to the step's end; one step = the whole chunk)."""
    if not chunk_held:
        return tri(c)
    total, done = 0, 0
    for step in steps or (c,):
        done += step
        total += done * step
    return total


def _steps_of(bounds: list[int], step_boundaries: Sequence[int] | None) -> list:
    """Per chunk, the lengths of the steps it was prefilled in (None: one step each)."""
    if step_boundaries is None:
        return [None] * len(bounds)
    steps = _check(bounds[-1], step_boundaries, 0)
    if not set(bounds) <= set(steps):
        raise ValueError(f"step_boundaries {steps} must include every chunk boundary {bounds}")
    out, prev, i = [], 0, 0
    for b in bounds:
        lengths = []
        while steps[i] <= b:
            lengths.append(steps[i] - prev)
            prev = steps[i]
            i += 1
            if i == len(steps):
                break
        out.append(lengths)
    return out


def _streaming_head(bounds: list[int], decode_len: int, sink: int, window: int,
                    chunk_held: bool = False, steps: list | None = None) -> tuple[int, list[int]]:
    """Entries and per-step peak candidates of one streaming head."""
    cap = sink + window
    entries, points, a = 0, [], 0
    for i, b in enumerate(bounds):
        c, held = b - a, min(a, cap)
        entries += _chunk_term(c, chunk_held, steps and steps[i]) + c * held
        points.append(held + c)
        a = b
    n = bounds[-1]
    if decode_len:
        entries += decode_len + _sum_min(n, n + decode_len, cap)
        points.append(1 + min(n + decode_len - 1, cap))
    return entries, points


def _kept_head(bounds: list[int], decode_len: int, kept: list[int],
               chunk_held: bool = False, steps: list | None = None,
               decode_budget: int | None = None, interval: int = 1) -> tuple[int, list[int]]:
    """Entries and peak candidates of a head that keeps `kept[i]` tokens of chunk i (and,
    with `decode_budget`, falls back to min(length, budget) after every `interval`-th decode
    step)."""
    entries, points, past, a = 0, [], 0, 0
    for i, (b, k) in enumerate(zip(bounds, kept)):
        c = b - a
        entries += _chunk_term(c, chunk_held, steps and steps[i]) + past * c
        points.append(past + c)
        past += k
        a = b
    if decode_len and decode_budget is None:
        entries += tri(decode_len) + past * decode_len
        points.append(past + decode_len)
    elif decode_len:  # decode step j of an interval (1..E) holds length + j
        done, peak = 0, 0
        while done < decode_len:
            e = min(interval, decode_len - done)
            entries += tri(e) + past * e
            peak = max(peak, past + e)
            past, done = min(past + e, decode_budget) if e == interval else past + e, done + e
        points.append(peak)
    return entries, points


def _chunk_lengths(bounds: list[int]) -> list[int]:
    return [b - a for a, b in zip([0] + bounds[:-1], bounds)]


def kv_footprint(policy: KVPolicy, prompt_len: int, chunk_boundaries: list[int],
                 decode_len: int, chunk_held: bool = False,
                 step_boundaries: Sequence[int] | None = None) -> FootprintResult:
    """Footprint and peak KV of one request under `policy`, averaged over (layer, KV head).

    chunk_boundaries: chunk end positions, e.g. [1024, 2048, 2500] for a 2500-token prompt.
    chunk_held: charge every query of a chunk the chunk as held (see the module docstring);
    step_boundaries: the prefill steps' ends when chunks ran in several steps (only with
    chunk_held; a superset of chunk_boundaries).
    """
    bounds = _check(prompt_len, chunk_boundaries, decode_len)
    lengths = _chunk_lengths(bounds)
    steps = _steps_of(bounds, step_boundaries) if chunk_held else None
    num_layers, num_heads = policy.num_layers, policy.num_kv_heads
    streaming_per_layer = policy.streaming_heads().sum(dim=1).tolist()

    stream_entries, stream_points = _streaming_head(
        bounds, decode_len, policy.config.sink, policy.config.window, chunk_held, steps)
    full_entries, full_points = _kept_head(bounds, decode_len, lengths, chunk_held, steps)

    keep_cache: dict[tuple[int, int, bool], int] = {}

    def kept_of(layer: int, c: int, is_final: bool) -> int:
        key = (layer, c, is_final)
        if key not in keep_cache:
            k = policy.chunk_keep(layer, c, is_final).kept
            if not 0 <= k <= c:
                raise ValueError(f"policy {policy.name!r} keeps {k} of a {c}-token chunk "
                                 f"in layer {layer}")
            keep_cache[key] = k
        return keep_cache[key]

    total = 0
    step_totals = [0] * len(full_points)
    last = len(lengths) - 1
    for layer, n_stream in enumerate(streaming_per_layer):
        n_other = num_heads - n_stream
        if policy.evicts_tokens and n_other:
            kept = [kept_of(layer, c, i == last) for i, c in enumerate(lengths)]
            budget = (policy.decode_budget(layer)
                      if getattr(policy.config, "decode_budget", None) is not None else None)
            other_entries, other_points = _kept_head(bounds, decode_len, kept, chunk_held,
                                                     steps, budget,
                                                     policy.config.decode_interval)
        else:
            other_entries, other_points = full_entries, full_points
        total += n_stream * stream_entries + n_other * other_entries
        for i, (s_pt, o_pt) in enumerate(zip(stream_points, other_points)):
            step_totals[i] += n_stream * s_pt + n_other * o_pt

    heads = num_layers * num_heads
    seq = prompt_len + decode_len
    # full attention's own count under the same convention (T(n + m) when causal)
    full_count = full_entries if chunk_held else tri(seq)
    return FootprintResult(footprint=total / (heads * full_count),
                           peak_kv=max(step_totals) / (heads * seq),
                           entries=total / heads,
                           full_entries=float(full_count))


def head_mask_footprint(n: int, m: int, chunk: int, h: float, sink: int,
                        window: int) -> FootprintResult:
    """Footprint of a head mask with a share `h` of streaming heads, prefilled in `chunk`s.

    The same counts as `kv_footprint` without a policy object; h need not be a multiple of
    1 / (L * H), which makes it handy for plots and the paper's reference values.
    """
    if not 0.0 <= h <= 1.0:
        raise ValueError(f"streaming share h must be in [0, 1], got {h!r}")
    bounds = _check(n, chunk_boundaries_for(n, chunk), m)
    s_entries, s_points = _streaming_head(bounds, m, sink, window)
    f_entries, f_points = _kept_head(bounds, m, _chunk_lengths(bounds))
    entries = h * s_entries + (1.0 - h) * f_entries
    peak = max(h * s + (1.0 - h) * f for s, f in zip(s_points, f_points))
    return FootprintResult(footprint=entries / tri(n + m), peak_kv=peak / (n + m),
                           entries=entries, full_entries=float(tri(n + m)))
