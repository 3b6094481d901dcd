"""Chunked token eviction (snapkv, pyramidkv) with real memory: kept KVs are compacted forward
and the freed tail blocks go back to vLLM's block pool during the request.

The layers are split into KV-cache groups (`LayerGroups`; one block table per request and
group, see integration/kv_cache/specs.py): one group for snapkv, one per tier of layers for
pyramidkv. Two sides agree on one deterministic ledger per group (`allocation_evicted[g]`):
- scheduler (engine core): in group g a request holds blocks for `computed -
  allocation_evicted[g]` tokens (+ the chunk it runs); when a prefill chunk of length c has run,
  allocation_evicted[g] grows by c - max kept_l over the group's layers l, and the group's tail
  blocks past its new physical length are freed.
- worker: per layer the physical length (kept tokens). New tokens are written at physical
  positions in the layer's group's block row, the kernel sees physical seq_lens, and after each
  prefill chunk a layer rewrites its kept tokens (per KV head, gathered from the forward's own
  K/V tensors, RoPE already applied) at [phys_before, phys_before + kept). At the end of the step
  the worker drops the same tail blocks from vLLM's (append-only) worker-side block lists of
  every group, so both sides keep identical block lists and vLLM appends the next step's blocks
  after the kept ones.
With `eviction_chunk` E set, an eviction chunk [s, s + E) may be prefilled over several engine
steps (the scheduler never lets a step cross its end, see `cap_step_in_eviction_chunk` below):
the steps before its last one only append; the last one scores and compacts the whole chunk,
reading the earlier steps' K/V back from the paged cache (`integration/attention/paged_layout.py`).
Logical positions (RoPE of new tokens) are vLLM's own and never change. Within a group the
layers share the block row sized for the group's largest layer, each using its own physical
length.

No vLLM import: the maths both sides share (`integration/core/token_ledger.py` on the scheduler
side, `integration/worker/token_plan.py` on the worker side), unit-tested in
tests/test_eviction_bookkeeping.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from vllm_kvevict.policies import KVPolicy


@dataclass(frozen=True)
class LayerGroups:
    """Which vLLM KV-cache group (one block table per request) holds each layer's KV. -1: the
    layer holds no paged KV (a head mask's layer without full heads, with its streaming heads
    in vLLM's pool). `total`: vLLM's number of KV-cache groups when some hold no evicting layer
    (the streaming heads' groups of pool storage: they evict nothing); 0: as many as the
    layers name."""

    of_layer: tuple[int, ...]
    total: int = 0

    @classmethod
    def single(cls, num_layers: int) -> "LayerGroups":
        return cls((0,) * num_layers)

    @classmethod
    def tiers(cls, num_layers: int, num_tiers: int) -> "LayerGroups":
        """Runs of num_layers / num_tiers consecutive layers (as integration/kv_cache/specs.py
        declares them)."""
        size = num_layers // num_tiers
        return cls(tuple(layer // size for layer in range(num_layers)))

    @property
    def num_groups(self) -> int:
        return max(self.total, max(self.of_layer, default=0) + 1)

    def layers(self, group: int) -> list[int]:
        return [l for l, g in enumerate(self.of_layer) if g == group]


def chunk_kept_per_layer(policy: KVPolicy, chunk_len: int, is_final: bool) -> list[int]:
    return [policy.chunk_keep(layer, chunk_len, is_final).kept
            for layer in range(policy.num_layers)]


def group_evictions_of(kept: list[int], chunk_len: int, groups: LayerGroups) -> list[int]:
    """Per group: slots a chunk gives back = chunk length - the most any of its layers keeps
    (0 in a group without evicting layers)."""
    most: list[int | None] = [None] * groups.num_groups
    for layer, k in enumerate(kept):
        g = groups.of_layer[layer]
        if g >= 0:
            most[g] = max(most[g] or 0, k)
    return [0 if m is None else chunk_len - m for m in most]


def group_evictions(policy: KVPolicy, chunk_len: int, is_final: bool,
                    groups: LayerGroups) -> list[int]:
    """Tokens of a prefill chunk whose slots the request gives back, per KV-cache group (the
    same in both processes)."""
    return group_evictions_of(chunk_kept_per_layer(policy, chunk_len, is_final), chunk_len,
                              groups)


def evicted_at_boundary(policy: KVPolicy, boundary: int,
                        groups: LayerGroups) -> tuple[list[int], list[int]]:
    """A request resumed at a canonical chunk boundary (a prefix-cache hit,
    integration/kv_cache/prefix_cache.py): the tokens its chunks before the boundary
    evicted, per layer and per group (the slots each group's row gave back)."""
    chunk = policy.config.eviction_chunk
    kept = chunk_kept_per_layer(policy, chunk, False)
    k = boundary // chunk
    return ([k * (chunk - x) for x in kept],
            [k * f for f in group_evictions_of(kept, chunk, groups)])


def allocation_eviction(policy: KVPolicy, chunk_len: int, is_final: bool) -> int:
    """group_evictions with all layers in one group."""
    return chunk_len - max(chunk_kept_per_layer(policy, chunk_len, is_final))


def decode_group_budgets(policy: KVPolicy, groups: LayerGroups) -> list[int | None]:
    """Decode-time eviction: per group, the tokens its block row holds after a compression
    (the largest decode budget among its layers; None: no decode-time eviction in the group)."""
    if policy.config.decode_budget is None:
        return [None] * groups.num_groups
    most: list[int | None] = [None] * groups.num_groups
    for layer, g in enumerate(groups.of_layer):
        if g >= 0:
            most[g] = max(most[g] or 0, policy.decode_budget(layer))
    return most


_DECODE_BUDGETS: dict[tuple, list[int | None]] = {}


def cached_decode_group_budgets(policy: KVPolicy, groups: LayerGroups) -> list[int | None]:
    """`decode_group_budgets`, memoised per (frozen config, groups): the scheduler and the
    worker ask once per compression (the groups are part of the key: the worker learns them
    from vLLM's KV-cache config after its first plans)."""
    key = (policy.config, groups)
    out = _DECODE_BUDGETS.get(key)
    if out is None:
        if len(_DECODE_BUDGETS) > 256:
            _DECODE_BUDGETS.clear()
        out = _DECODE_BUDGETS[key] = decode_group_budgets(policy, groups)
    return out


def decode_group_evictions(budgets: list[int | None], physical: list[int]) -> list[int]:
    """Slots each group gives back at a decode-time compression, from its physical length
    (the step's token included): every layer keeps min(its length, its budget), so the group
    keeps min(its length, its largest budget)."""
    return [0 if b is None else max(p - b, 0) for b, p in zip(budgets, physical)]


def decode_peak(kept: int, generated: int, budget: int | None, interval: int) -> int:
    """Peak slots of a group over `generated` decode tokens after a prompt that left `kept`:
    the length grows by one per token and falls to min(length, budget) every `interval`
    tokens, so it never exceeds max(kept, budget) + interval."""
    if budget is None:
        return kept + generated
    return min(kept + generated, max(kept, budget) + interval)


def eviction_chunk_len(config, computed: int, step_len: int) -> int:
    """Tokens of the eviction chunk that a prefill step [computed, computed + step_len) belongs
    to, up to the step's end (the step itself when no `eviction_chunk` is set). A step that
    crosses an eviction boundary is a bug of the scheduler's cap: raise, never guess."""
    e, end = config.eviction_chunk, computed + step_len
    if e is None:
        return step_len
    start = (end - 1) // e * e
    if computed < start:
        raise RuntimeError(f"vllm-kvevict: a prefill step [{computed}, {end}) crosses the "
                           f"eviction chunk boundary {start} (eviction_chunk {e})")
    return end - start



def peak_slots(policy: KVPolicy, prompt_len: int, num_tokens: int, chunk_size: int,
               evictions: Callable[[int, bool], list[int]],
               decode_budgets: list[int | None] | None = None) -> list[int]:
    """Per group, the peak slots a request of `num_tokens` tokens needs: the compressed prompt
    before a chunk, that chunk and its patched question, and every token after the prompt
    (`decode_peak`: all of them without decode-time eviction). `evictions(chunk_len,
    is_final)` gives the per-group slots a chunk gives back (`group_evictions`, memoised by
    the caller); `decode_budgets` the groups' `decode_group_budgets`."""
    n, c = prompt_len, chunk_size
    question = policy.config.question_rows(n)
    done, kept, peak = 0, None, None
    while done < n:
        step = min(c, n - done)
        final = done + step == n
        freed = evictions(step, final)
        if kept is None:
            kept, peak = [0] * len(freed), [0] * len(freed)
        for g in range(len(freed)):
            peak[g] = max(peak[g], kept[g] + step + (0 if final else question))
            kept[g] += step - freed[g]
        done += step
    if kept is None:
        kept = peak = [0] * len(evictions(0, True))
    budgets = decode_budgets or [None] * len(kept)
    generated, interval = max(num_tokens - n, 0), policy.config.decode_interval
    return [min(num_tokens, max(p, decode_peak(k, generated, b, interval)))
            for p, k, b in zip(peak, kept, budgets)]


def worst_case_slots(policy: KVPolicy, max_len: int, chunk_size: int,
                     groups: LayerGroups, memo: dict | None = None) -> list[int]:
    """Per group, the most slots any request of at most `max_len` tokens holds at once (the
    start-up pool check's "one request of max_model_len"): the largest `peak_slots` over every
    prompt length, the rest generated. Without a decode budget a short prompt's generation is
    never evicted, so this is `max_len`."""
    if policy.config.decode_budget is None:
        return [max_len] * groups.num_groups
    memo = {} if memo is None else memo  # (chunk length, is final) -> group evictions

    def evictions(chunk_len: int, is_final: bool) -> list[int]:
        if (chunk_len, is_final) not in memo:
            memo[chunk_len, is_final] = group_evictions(policy, chunk_len, is_final, groups)
        return memo[chunk_len, is_final]

    budgets = decode_group_budgets(policy, groups)
    worst = [0] * groups.num_groups
    for n in range(1, max_len + 1):
        worst = [max(w, p) for w, p in zip(worst, peak_slots(policy, n, max_len, chunk_size,
                                                               evictions, budgets))]
    return worst


def worst_case_by_length(policy: KVPolicy, max_len: int, chunk_size: int, groups: LayerGroups,
                         every: int = 1024) -> list[tuple[int, list[int]]]:
    """`worst_case_slots` at every multiple of `every` up to `max_len` (and at `max_len`), as
    (length, per-group slots): vLLM's start-up check and its `--max-model-len -1` auto-fit ask
    for one request of a trial length; a length between two entries is bounded by the next one
    (the worst case never falls as the length grows)."""
    lengths, memo = sorted({*range(every, max_len, every), max_len}), {}
    return [(n, worst_case_slots(policy, n, chunk_size, groups, memo)) for n in lengths]


def cap_step_in_eviction_chunk(policy: KVPolicy, prompt_len: int, num_computed: int,
                               num_new: int) -> int:
    """A prefill step never crosses the prompt's end (the policy's: a teacher-forced tail after
    it is decoded, `overrides.policy_prompt_len`). With an `eviction_chunk` it never crosses
    the end b of its eviction chunk either, and when the chunk's own last queries score it
    (naive mode, and the prompt's final chunk) its last step holds them whole: a step ends at
    b or at most at b - obs_window (0 = wait for a step with budget for the rest)."""
    config, n = policy.config, prompt_len
    e, a = config.eviction_chunk, num_computed
    if num_new > 0 and a >= n and config.decode_budget is not None:
        # a teacher-forced tail (vLLM's prompt, decode for the policy): a step ends at the
        # next decode-time compression at the latest, which follows the step's last token
        return min(num_new, config.decode_interval - (a - n) % config.decode_interval)
    if num_new <= 0 or a >= n:
        return num_new
    if e is None:  # the prompt's end closes its last chunk (before a teacher-forced tail)
        return min(num_new, n - a)
    start = a // e * e
    end = min(start + e, n)
    if a + num_new >= end:
        return end - a
    own_queries = not config.patched or end == n
    last_start = end - (config.observation_rows(end - start) if own_queries else 0)
    if a + num_new <= last_start:
        return num_new
    return last_start - a if a < last_start else 0
