"""Per-request KV accounting behind `kv_stats` (no vLLM import: unit-testable without a server).

The scheduler-side stats connector (`integration/kv_stats/stats_connector.py`) calls
`RequestRecord.on_step` once per engine step in which the request is scheduled, with what vLLM
really did that step: tokens already computed, tokens scheduled, and the ids of the KV blocks
the request holds in every KV-cache group (read from the KV manager after this step's
allocation, so they are the blocks held while the step runs). From those it keeps:

- chunk_boundaries: the end of every prefill chunk vLLM scheduled, e.g. [256, 512, 700];
- real bytes held at each step = sum over groups of blocks held x the group's bytes per block
  (a head mask's streaming heads are groups of their own: every byte is a pool block);
  `kv_bytes_peak` is their maximum, `kv_bytes_integral` the sum over steps of bytes held x tokens
  processed for this request in that step;
- the same two figures for stock vLLM's full attention: ceil(tokens / block_size) blocks of all
  layers and KV heads, tokens = computed + scheduled after the step's write;
- blocks_freed: blocks returned to the pool while the request ran (eviction), counted by block
  id: a block held at the previous step that is gone now, or that came back as one of this
  step's newly allocated blocks (vLLM 0.32 reuses freed blocks LIFO, so the request's next
  allocation often gets the very blocks it just gave back). A block swapped for vLLM's null
  block counts; a preemption (which frees all blocks and recomputes) does not;
- `footprint_chunk_held`: the paper's count with each prefill chunk charged whole while it runs
  (what any engine holds; `footprint.py`), so measured / this isolates our own overhead;
- timestamps for TTFT, prefill and decode throughput.

`finish` turns a record into the `kv_stats` dict (JSON-safe: ints, floats, strings, lists).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from vllm_kvevict.footprint import eviction_boundaries, kv_footprint

STATS_KEY = "kv_stats"


@dataclass(frozen=True)
class ByteLayout:
    """How many bytes a held block and a running request cost on this server."""

    block_size: int                        # tokens per block (stock vLLM's, for full attention)
    group_bytes_per_block: tuple[int, ...]  # real bytes one block of KV-cache group g reserves
    full_bytes_per_block: int              # stock vLLM: every layer and KV head, block_size tokens
    # tensor parallel: group_bytes_per_block sums every rank; each rank holds 1/ranks of a
    # block's bytes (every rank declares the same specs: kv_cache_specs.layer_heads)
    ranks: int = 1
    # bytes of each group's block that hold heads (its layers' pages): less than the
    # reservation where the pool plan packs a group narrower than the widest (pool_groups)
    group_head_bytes_per_block: tuple[int, ...] = ()

    def head_bytes(self, g: int) -> int:
        heads = self.group_head_bytes_per_block
        return heads[g] if g < len(heads) else self.group_bytes_per_block[g]

    def per_rank(self, total_bytes: int) -> list[int]:
        """A request's bytes (a sum over ranks) on each rank."""
        return [total_bytes // self.ranks] * self.ranks

    def full_bytes(self, tokens: int) -> int:
        return -(-tokens // self.block_size) * self.full_bytes_per_block


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def _rate(tokens: int, start: float | None, end: float | None) -> float | None:
    if start is None or end is None or tokens <= 0 or end <= start:
        return None
    return tokens / (end - start)


@dataclass
class RequestRecord:
    request_id: str
    prompt_len: int
    arrival_time: float | None
    layout: ByteLayout
    overrides: dict[str, Any] = field(default_factory=dict)
    teacher_forced: int = 0  # prompt tokens after prompt_len, served as decode tokens
    canonical_chunk: int = 0  # pool storage: prompt chunked at multiples of this, not steps

    boundaries: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    steps: int = 0
    tokens: int = 0
    bytes_peak: int = 0
    bytes_integral: int = 0
    head_bytes_peak: int = 0      # of bytes_peak's kind, counting only pages that hold heads
    head_bytes_integral: int = 0
    full_bytes_peak: int = 0
    full_bytes_integral: int = 0
    blocks_held_peak: int = 0
    blocks_held: int = 0
    bytes_now: int = 0       # bytes held at the last step (live view)
    full_bytes_now: int = 0  # full attention's at the last step
    full_blocks: int = 0
    blocks_freed: int = 0
    preemptions: int = 0
    t_first_scheduled: float | None = None
    t_first_token: float | None = None
    _held: list[set[int] | None] = field(default_factory=list)
    _head_bytes_now: int = 0

    def on_step(self, computed: int, scheduled: int, held_ids: Sequence[set[int]], now: float,
                preemptions: int = 0, new_ids: Sequence[Sequence[int]] | None = None) -> bool:
        """Account one engine step: `held_ids` per KV-cache group after this step's allocation,
        `new_ids` per group the blocks allocated this step (vLLM's new_block_ids).
        Returns True when this step ends the prompt's prefill."""
        first = self.t_first_scheduled is None
        if first:
            self.t_first_scheduled = now
        if preemptions != self.preemptions:
            # Preemption freed every block and restarts the prefill: not eviction.
            self.preemptions = preemptions
            self._held = []
        ends_prefill = False
        if computed < self.prompt_len:
            E = self.canonical_chunk
            # a prefix-cache hit served [0, computed): only at the request's first step (with a
            # canonical chunk, a first step shorter than it leaves no boundary behind)
            if first and computed > 0:
                self.cached_tokens = computed
                if not E:
                    self.boundaries.append(computed)
            end = min(computed + scheduled, self.prompt_len)
            if E:  # the chunks the policy ran: multiples of E, then the prompt's end
                last = self.boundaries[-1] if self.boundaries else 0
                self.boundaries += [b for b in range(last // E * E + E, end + 1, E)
                                    if b < self.prompt_len]
                if end == self.prompt_len and (not self.boundaries or last < end):
                    self.boundaries.append(end)  # (once: a preempted request recomputes)
            elif not self.boundaries or end > self.boundaries[-1]:
                self.boundaries.append(end)
            ends_prefill = computed + scheduled >= self.prompt_len

        if (len(self._held) == len(held_ids) and not any(new_ids or ())
                and all(a is b for a, b in zip(self._held, held_ids))):
            # the very sets of the last step (request_stats reuses a group's set while its
            # blocks stay): nothing freed, the same blocks held
            held_blocks, held_bytes, head_bytes = (self.blocks_held, self.bytes_now,
                                                   self._head_bytes_now)
        else:
            held_blocks, held_bytes, head_bytes = self._account(held_ids, new_ids)
        total = computed + scheduled
        full_bytes = self.layout.full_bytes(total)

        self.steps += 1
        self.tokens += scheduled
        self.blocks_held, self._head_bytes_now = held_blocks, head_bytes
        self.bytes_now, self.full_bytes_now = held_bytes, full_bytes
        self.blocks_held_peak = max(self.blocks_held_peak, held_blocks)
        self.full_blocks = -(-total // self.layout.block_size)
        self.bytes_peak = max(self.bytes_peak, held_bytes)
        self.bytes_integral += held_bytes * scheduled
        self.head_bytes_peak = max(self.head_bytes_peak, head_bytes)
        self.head_bytes_integral += head_bytes * scheduled
        self.full_bytes_peak = max(self.full_bytes_peak, full_bytes)
        self.full_bytes_integral += full_bytes * scheduled
        return ends_prefill

    def _account(self, held_ids: Sequence[set[int]],
                 new_ids: Sequence[Sequence[int]] | None) -> tuple[int, int, int]:
        """(blocks, bytes, bytes in heads) held; counts the blocks freed since the last step."""
        if len(self._held) != len(held_ids):
            self._held = [None] * len(held_ids)
        held_bytes = held_blocks = head_bytes = 0
        for g, ids in enumerate(held_ids):
            prev = self._held[g]
            if prev:
                self.blocks_freed += len(prev - ids)
                if new_ids is not None and g < len(new_ids) and new_ids[g]:
                    self.blocks_freed += len(prev.intersection(new_ids[g]))
            self._held[g] = ids
            held_blocks += len(ids)
            held_bytes += len(ids) * self.layout.group_bytes_per_block[g]
            head_bytes += len(ids) * self.layout.head_bytes(g)
        return held_blocks, held_bytes, head_bytes

    def on_first_token(self, now: float) -> None:
        if self.t_first_token is None:
            self.t_first_token = now

    def finish(self, completion_tokens: int, now: float, policy_name: str,
               params: dict[str, Any], footprint_of: Callable | None) -> dict[str, Any]:
        """The kv_stats dict. `footprint_of(prompt_len, boundaries, decode_len)` returns a
        FootprintResult (None: not computed)."""
        n = self.prompt_len
        # The paper's query positions that vLLM really ran: n prompt positions, the
        # teacher-forced tail, and one decode forward per generated token after the first (the
        # last token is never fed back).
        decode_steps = self.teacher_forced + max(completion_tokens - 1, 0)
        footprint = peak_kv = footprint_chunk_held = None
        if footprint_of is not None and self.boundaries and self.boundaries[-1] == n:
            result = footprint_of(n, list(self.boundaries), decode_steps)
            footprint, peak_kv = result.footprint, result.peak_kv
            footprint_chunk_held = footprint_of(n, list(self.boundaries), decode_steps,
                                                chunk_held=True).footprint
        t_first_token = self.t_first_token if self.t_first_token is not None else (
            now if self.boundaries and self.boundaries[-1] == n else None)
        arrival = self.arrival_time
        return {
            "engine_request_id": self.request_id,
            "policy": policy_name,
            "params": params,
            "overrides": dict(self.overrides),
            "prompt_tokens": n,
            "teacher_forced_tokens": self.teacher_forced,
            "completion_tokens": completion_tokens,
            "cached_tokens": self.cached_tokens,
            "chunk_boundaries": list(self.boundaries),
            "decode_steps": decode_steps,
            # decode-time eviction: one compression after every decode_interval-th decode step
            "decode_compressions": (decode_steps // params["decode_interval"]
                                    if params.get("decode_budget") else 0),
            "footprint": footprint,
            "peak_kv": peak_kv,
            "footprint_chunk_held": footprint_chunk_held,
            "kv_bytes_peak": self.bytes_peak,
            "tensor_parallel_size": self.layout.ranks,
            "kv_bytes_peak_per_rank": self.layout.per_rank(self.bytes_peak),
            "kv_bytes_integral": self.bytes_integral,
            "full_kv_bytes_peak": self.full_bytes_peak,
            "full_kv_bytes_integral": self.full_bytes_integral,
            "measured_footprint": _ratio(self.bytes_integral, self.full_bytes_integral),
            # without the pool plan's padding (head pages a narrower group leaves empty): what
            # the heads themselves hold, at most full attention's at every step
            "kv_bytes_peak_in_heads": self.head_bytes_peak,
            "measured_footprint_in_heads": _ratio(self.head_bytes_integral,
                                                  self.full_bytes_integral),
            "kv_bytes_saved": self.full_bytes_peak - self.bytes_peak,
            # held at the request's last step: what each of its last decode steps reads
            "kv_bytes_end": self.bytes_now,
            "full_kv_bytes_end": self.full_bytes_now,
            "block_size": self.layout.block_size,
            "blocks_held_peak": self.blocks_held_peak,
            "blocks_held_end": self.blocks_held,
            "full_blocks_end": self.full_blocks,
            "blocks_freed": self.blocks_freed,
            "engine_steps": self.steps,
            "tokens_processed": self.tokens,
            "preemptions": self.preemptions,
            "queue_s": (self.t_first_scheduled - arrival
                        if arrival is not None and self.t_first_scheduled is not None else None),
            "ttft_s": t_first_token - arrival if arrival is not None and t_first_token else None,
            "prefill_tokens_per_s": _rate(n - self.cached_tokens, self.t_first_scheduled,
                                          t_first_token),
            "decode_tokens_per_s": _rate(max(completion_tokens - 1, 0), t_first_token, now),
            "e2e_s": now - arrival if arrival is not None else None,
        }


def finite_or_none(value: Any) -> Any:
    """JSON has no NaN/inf: map them to None (recursively)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite_or_none(v) for v in value]
    return value


def footprint_function(policy) -> Callable:
    """footprint_of(prompt_len, boundaries, decode_len, chunk_held=False) for a KVPolicy;
    `boundaries` are the prefill steps vLLM ran, the chunks are the policy's eviction chunks
    among them (the same unless `eviction_chunk` is set)."""
    def footprint_of(prompt_len: int, boundaries: list[int], decode_len: int,
                     chunk_held: bool = False):
        chunks = eviction_boundaries(boundaries, prompt_len,
                                     getattr(policy.config, "eviction_chunk", None))
        return kv_footprint(policy, prompt_len, chunks, decode_len, chunk_held,
                            step_boundaries=boundaries if chunk_held else None)
    return footprint_of
