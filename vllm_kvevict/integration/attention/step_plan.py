"""The per-step plan of the streaming heads: which past positions each kernel row sees.

Semantics (`policies/streaming.py`): a prefill chunk [a, a + c) sees the sink (first s tokens),
the last W tokens before a, and the chunk causally; a decode query at q (q >= the prompt
length) sees the sink, [q - W, q) and itself, so each decode query of a multi-query step
(speculative decoding) gets a kernel row of its own. Per step and layer the step's K/V are
written to the pool (`sink_window.py`), each row's visible past is read back and laid out with
the step's visible tokens in a zeroed scratch paged cache, and vLLM's CPU kernel runs causally
over it (`paged_layout.lay_out_from_pool`). Decode-only steps skip the scratch cache (in place,
`window_rows`, when the sink is whole blocks; else `decode_attention`). `StepPlan` is built once
per step for all layers. Design: docs/design/kv_cache.md, "Streaming heads in vLLM's pool".
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vllm_kvevict.integration.attention.fp8 import grid_values, quantize


@dataclass
class StepPlan:
    """Per-step indices shared by every layer (built from the batch's rows). A batch row (one
    request) gives one kernel row, or several when it runs more than one decode query."""

    num_reqs: int                   # kernel rows
    seq_lens: torch.Tensor          # int32 [num_reqs]: laid-out tokens per kernel row
    query_start_loc: torch.Tensor   # int32 [num_reqs + 1] (queries stay in batch order)
    block_table: torch.Tensor       # int32 [num_reqs, max_blocks] into the scratch cache
    scratch_slots: torch.Tensor     # int64 [sum(seq_lens)]: scratch slot of each laid-out token
    prefix_dst: torch.Tensor        # long: rows of the laid-out tensor read from the pool
    prefix_pos: torch.Tensor        # long: their positions
    prefix_row: torch.Tensor        # long: their batch rows (whose block table they are read by)
    chunk_dst: torch.Tensor         # long: rows of the laid-out tensor that come from the step
    chunk_src: torch.Tensor         # long: their token indices in the batch
    max_seq_len: int
    valid: bool = True
    # every kernel row is one decode query seeing the same number of tokens: [B, P + 1]
    # positions, its sink + window then itself (`decode_attention`, no scratch cache); or None
    decode_pos: torch.Tensor | None = None
    # every kernel row is one decode query: its position (rows of any length), or None
    decode_q: torch.Tensor | None = None
    # vLLM kernel work schedules for this step, per streaming-head count (filled lazily)
    kernel_schedules: dict = field(default_factory=dict)


def visible_before(a: int, sink: int, window: int, anchor: int | None = None) -> torch.Tensor:
    """Positions < a that a streaming head sees from a query at a whose chunk starts at
    `anchor` (default a): the sink and [anchor - W, a)."""
    lo = a - window if anchor is None else anchor - window
    if lo <= sink:
        return torch.arange(a)
    return torch.cat([torch.arange(sink), torch.arange(lo, a)])


class DecodeStepPlan(StepPlan):
    """The plan of a step whose rows are all one decode query (the common step of requests
    decoding): what the in-place kernel reads (rows, seq_lens, positions) is built at once, the
    scratch-cache indices (per row, a dozen small tensors) only if a layer reads one of them
    (a layer that cannot run in place: fp8, a partial sink block, ...)."""

    def __init__(self, decode_q: torch.Tensor, seq_lens: list[int], build) -> None:
        # (not the dataclass __init__: the fields below are built on first use)
        self.num_reqs, self.decode_q = len(seq_lens), decode_q
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
        self.query_start_loc = torch.arange(len(seq_lens) + 1, dtype=torch.int32)
        self.valid, self.kernel_schedules, self._build, self._full = True, {}, build, None


def _built_on_use(name: str) -> property:
    def get(self):
        if self._full is None:
            self._full = self._build()
        return getattr(self._full, name)
    return property(get)


for _name in ("block_table", "scratch_slots", "prefix_dst", "prefix_pos", "prefix_row",
              "chunk_dst", "chunk_src", "max_seq_len", "decode_pos"):
    setattr(DecodeStepPlan, _name, _built_on_use(_name))


def build_step_plan(computed: list[int], query_lens: list[int], sink: int, window: int,
                    block_size: int, prompt_lens: list[int] | None = None,
                    questions: list[tuple[int, int, int]] = (),
                    chunk: int | None = None) -> StepPlan:
    """`build_plan`, a decode-only step's scratch indices built on first use
    (`DecodeStepPlan`)."""
    if computed and not questions and all(
            c == 1 and (not chunk or (prompt_lens is not None and a >= prompt_lens[r]))
            for r, (a, c) in enumerate(zip(computed, query_lens))):
        # (the rows `build_plan` makes of these: one each, [sink | window | itself])
        return DecodeStepPlan(torch.tensor(computed), [min(a, sink + window) + 1 for a in computed],
                              lambda: build_plan(computed, query_lens, sink, window, block_size,
                                                 prompt_lens, questions, chunk))
    return build_plan(computed, query_lens, sink, window, block_size, prompt_lens, questions,
                      chunk)


def build_plan(computed: list[int], query_lens: list[int], sink: int, window: int,
               block_size: int, prompt_lens: list[int] | None = None,
               questions: list[tuple[int, int, int]] = (),
               chunk: int | None = None) -> StepPlan:
    """Indices for one step. Row r: `computed[r]` tokens already processed, `query_lens[r]`
    tokens in this step (a prefill chunk, one decode token, or a verification step of 1 + K
    decode tokens). Queries at positions >= `prompt_lens[r]` of a multi-query row each get
    their own kernel row (None: every row is a chunk, as without speculation).
    `questions`: (row, k, first index) of patched scoring's question tokens (a head mask with
    a token policy), k extra tokens after the batch's, at positions right after row r's chunk:
    a kernel row each, [visible past | the chunk | the question], that nothing stores.
    `chunk`: canonical chunks (prefix caching on): prompt positions are chunked at multiples of
    `chunk` whatever vLLM's steps are, so a step's prompt queries are split there, and a piece
    of chunk [kE, ...) sees the sink, [kE - W, kE) and the chunk so far (None: the step is
    the chunk)."""
    layout = _KernelRows(block_size)
    kernel_row = layout.add
    token_base, row_tokens = 0, []  # first batch token of this row; the rows' tokens
    decode_only, query_pos = not questions, []
    for r, (a, c) in enumerate(zip(computed, query_lens)):
        in_prompt = prompt_lens is None or a < prompt_lens[r]
        anchor = a // chunk * chunk if chunk and in_prompt else a
        past = visible_before(a, sink, window, anchor)
        p = a + torch.arange(c)
        tokens = token_base + torch.arange(c)
        # queries before the prompt's end: one chunk row (the paper's chunk semantics)
        m = c if prompt_lens is None or (c == 1 and not chunk) else \
            min(c, max(prompt_lens[r] - a, 0))
        lo = a
        while lo < a + m and chunk:  # canonical chunks: a row per piece of a chunk
            start = lo // chunk * chunk
            hi = min(start + chunk, a + m)
            seen, upto = (past < sink) | (past >= start - window), p[: hi - a]
            kernel_row(r, past[seen],
                       tokens[: hi - a][(upto < sink) | (upto >= start - window)], hi - lo)
            lo = hi
        if m and not chunk:
            kernel_row(r, past, tokens[:m], m)
        # one query seeing [sink | window | itself]: a decode token, or any 1-token row
        # without canonical chunks (its chunk is itself)
        decode_only &= c == 1 and (m == 0 or not chunk)
        query_pos.append(a)
        for i in range(m, c):  # decode queries: a row each, with their own window
            lo = p[i] - window
            seen = (past < sink) | (past >= lo)
            kernel_row(r, past[seen],
                       tokens[: i + 1][(p[: i + 1] < sink) | (p[: i + 1] >= lo)], 1)
        token_base += c
        row_tokens.append((past, tokens))
    for r, k, first in questions:  # after every batch row, as the queries are ordered
        past, tokens = row_tokens[r]
        kernel_row(r, past, torch.cat([tokens, first + torch.arange(k)]), k)
    return layout.plan(decode_only, query_pos)


class _KernelRows:
    """One step's kernel rows (`build_plan`) laid out in scratch blocks, and the `StepPlan`
    they make: each row's blocks, its slots, where its visible past and its step's tokens go."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.seq_lens, self.q_start, self.blocks = [], [0], []
        self.scratch_slots, self.prefix_dst, self.chunk_dst, self.chunk_src = [], [], [], []
        self.prefix_pos, self.prefix_row = [], []
        self.laid = 0        # rows of the laid-out tensor so far
        self.next_block = 1  # block 0 stays unused (mirrors vLLM's null block)

    def add(self, row: int, past: torch.Tensor, step_src: torch.Tensor, q_len: int) -> None:
        block_size = self.block_size
        v, n = len(past), len(past) + len(step_src)
        nblocks = -(-n // block_size)
        row_blocks = list(range(self.next_block, self.next_block + nblocks))
        self.next_block += nblocks
        self.blocks.append(row_blocks)
        self.scratch_slots.append(torch.tensor(row_blocks).repeat_interleave(block_size)[:n]
                                  * block_size + torch.arange(n) % block_size)
        self.prefix_dst.append(self.laid + torch.arange(v))
        self.prefix_pos.append(past)
        self.prefix_row.append(torch.full((v,), row))
        self.chunk_dst.append(self.laid + v + torch.arange(n - v))
        self.chunk_src.append(step_src)
        self.seq_lens.append(n)
        self.q_start.append(self.q_start[-1] + q_len)
        self.laid += n

    def plan(self, decode_only: bool, query_pos: list[int]) -> StepPlan:
        """The plan of the rows added; a decode-only step's query positions too."""
        blocks, seq_lens = self.blocks, self.seq_lens
        num_rows = len(blocks)
        width = max((len(b) for b in blocks), default=1)
        table = torch.zeros(num_rows, width, dtype=torch.int32)
        for r, b in enumerate(blocks):
            table[r, : len(b)] = torch.tensor(b, dtype=torch.int32)
        cat = lambda xs: torch.cat(xs).long() if xs else torch.zeros(0, dtype=torch.long)
        decode_pos = decode_q = None
        if decode_only and num_rows:
            decode_q = torch.tensor(query_pos)
            if len(set(seq_lens)) == 1:
                decode_pos = torch.cat([cat(self.prefix_pos).view(num_rows, -1),
                                        decode_q[:, None]], dim=1)
        return StepPlan(num_reqs=num_rows, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                        query_start_loc=torch.tensor(self.q_start, dtype=torch.int32),
                        block_table=table, scratch_slots=cat(self.scratch_slots),
                        prefix_dst=cat(self.prefix_dst), prefix_pos=cat(self.prefix_pos),
                        prefix_row=cat(self.prefix_row), chunk_dst=cat(self.chunk_dst),
                        chunk_src=cat(self.chunk_src), max_seq_len=max(seq_lens, default=0),
                        decode_pos=decode_pos, decode_q=decode_q)


def window_rows(q: torch.Tensor, sink: int, window: int,
                block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block columns [rows, n] and seq_lens [rows] with which vLLM's CPU kernel, given a
    sliding window of `sink + window + 1` tokens, computes exactly a decode query's streaming
    attention in place over the pool's blocks (no copy): row r's kernel block row is its block
    table at these columns (the same for every KV-cache group of the step). Needs
    `sink % block_size == 0` and `window >= block_size`.

    Row r's query at position q sees [0, sink), [q - W, q) and itself. If q - W <= sink that is
    [0, q]: the row's own blocks, seq_len q + 1. Otherwise the virtual row is
    [block of q - W | the sink's blocks | the blocks after, up to q's]: every block whole but
    the first (its tokens before q - W are left of the window: the kernel's sliding window,
    counted from the query as the row's last token, masks exactly them, since o + sink + W + 1
    tokens with o = (q - W) % block_size precede and include the query) and the last, q's
    own (W >= block_size: not the first; seq_len stops at q). The kernel's softmax does not
    depend on the order of the keys."""
    bs, ns = block_size, sink // block_size
    lo = q - window
    long_row = lo > sink
    b0, last = lo.clamp(min=0) // bs, q // bs
    seq = torch.where(long_row, lo % bs + sink + window + 1, q + 1)
    count = torch.where(long_row, 1 + ns + last - b0, last + 1)
    j = torch.arange(int(count.max()))[None, :]
    cols = torch.where(long_row[:, None],
                       torch.where(j == 0, b0[:, None],
                                   torch.where(j <= ns, j - 1, b0[:, None] + j - ns)), j)
    # past a row's count: any block of its own (the kernel reads no block past seq_len)
    return torch.minimum(cols, last[:, None]), seq.to(torch.int32)


def lay_out_rows(plan: StepPlan, past: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """Token-major [visible past | visible step tokens] of every kernel row: `past` in
    `prefix_dst` order, `step` in `chunk_dst` order."""
    laid = step.new_empty(int(plan.seq_lens.sum()), *step.shape[1:])
    laid[plan.prefix_dst] = past
    laid[plan.chunk_dst] = step
    return laid


def lay_out_visible(plan: StepPlan, past: torch.Tensor, step: torch.Tensor, scale: float,
                    fp8: str | None) -> torch.Tensor:
    """`lay_out_rows` of one of K, V; with an fp8 cache (`fp8`: its format) `past` holds codes
    and both come out as the codes' grid values (the step quantized with `scale`), to be
    written with scale 1 (`paged_layout.lay_out_from_pool`)."""
    if fp8:
        past = grid_values(past, fp8, step.dtype)
        step = grid_values(quantize(step, scale, fp8), fp8, step.dtype)
    return lay_out_rows(plan, past, step)




def decode_attention(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Streaming heads' attention of a `decode_pos` step without a scratch cache: row r's
    query [Hq, d] over k, v [Hkv, B, P + 1, d] (its sink + window, then itself), query heads
    grouped by KV head (GQA); scores and softmax in float32, as vLLM's CPU kernel."""
    B, Hq, d = query.shape
    Hkv, _, L, _ = k.shape
    g = Hq // Hkv
    q = query.view(B, Hkv, g, d).transpose(0, 1).reshape(Hkv * B, g, d).float()
    scores = torch.bmm(q, k.view(Hkv * B, L, d).transpose(1, 2).float()) * scale
    out = torch.bmm(torch.softmax(scores, dim=-1), v.view(Hkv * B, L, d).float())
    return out.view(Hkv, B, g, d).transpose(0, 1).reshape(B, Hq, d).to(query.dtype)
