"""Block-sparse masks of the head-mask policies for torch's `flex_attention` over a paged KV
cache. Plain PyTorch (no vLLM import): the served FlexAttention path (`backend.py`) and the
kernel-level check (`kernel_check.py`, torch only) build their masks with this same code.

Visibility (`reference/attention.py`, `integration/attention/step_plan.py`): a query at position p whose
chunk starts at a sees, on a full head, every key at position <= p; on a streaming head the
sink (positions < sink), the `window` positions before a and the chunk, causally:
    j <= p  and  (j < sink  or  j >= a - window).
A prefill query's chunk start is its step's first position (canonical chunks of E tokens:
p // E * E); a decode query is a chunk of its own (a = p). In a mixed batch these differ token
by token, so the chunk start travels per token (`PagedQueries.chunk_start`), not per request.

The cache is vLLM's paged layout flattened to one token axis: physical page b holds tokens
[b * page_size, (b + 1) * page_size). The mask is block-sparse: for each block of `q_block`
queries and each head, `kv_indices` lists only the physical pages some query of the block can
see, so a streaming head computes sink + window + chunk pages whatever the prompt length; the
per-element `mask_mod` cuts exactly (optionally, pages seen whole skip it: `whole_pages`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask


@dataclass
class PagedQueries:
    """One step's queries over a paged cache: what the mask needs, per token and per row."""

    doc: torch.Tensor          # long [T]: batch row (request) of each query token
    position: torch.Tensor     # long [T]: its position in its request
    chunk_start: torch.Tensor  # long [T]: first position of its chunk (a decode query: itself)
    block_table: torch.Tensor  # int [R, P]: row's logical page -> physical page
    seq_lens: torch.Tensor     # int [R]: tokens of each row after this step (keys it may read)
    page_size: int
    num_pages: int             # physical pages in the cache

    @property
    def num_tokens(self) -> int:
        return int(self.doc.shape[0])


def chunk_starts(computed: list[int], query_lens: list[int], prompt_lens: list[int] | None = None,
                 chunk: int | None = None) -> torch.Tensor:
    """Long [sum(query_lens)]: the chunk start of every query of a step, rows in batch order.
    Row r ran `computed[r]` tokens before the step and runs `query_lens[r]` now. A query before
    its prompt's end (`prompt_lens[r]`; None: every query is a prompt query) belongs to the
    step's chunk, starting at computed[r] (canonical chunks of `chunk` tokens: p // chunk *
    chunk); a query at or past it is a decode query, a chunk of its own (as `build_step_plan`)."""
    out = []
    for r, (a, c) in enumerate(zip(computed, query_lens)):
        p = a + torch.arange(c)
        start = p // chunk * chunk if chunk else torch.full((c,), a)
        if prompt_lens is not None:
            start = torch.where(p < prompt_lens[r], start, p)
        out.append(start)
    return torch.cat(out).long() if out else torch.zeros(0, dtype=torch.long)


def paged_queries(computed: list[int], query_lens: list[int], block_table: torch.Tensor,
                  page_size: int, num_pages: int, prompt_lens: list[int] | None = None,
                  chunk: int | None = None) -> PagedQueries:
    """`PagedQueries` of a step given per row (as vLLM's metadata holds it)."""
    q_lens = torch.tensor(query_lens, dtype=torch.long)
    doc = torch.repeat_interleave(torch.arange(len(query_lens)), q_lens)
    first = torch.cumsum(q_lens, 0) - q_lens
    position = torch.tensor(computed, dtype=torch.long)[doc] + torch.arange(len(doc)) - first[doc]
    seq_lens = torch.tensor(computed, dtype=torch.long) + q_lens
    return PagedQueries(doc=doc, position=position,
                        chunk_start=chunk_starts(computed, query_lens, prompt_lens, chunk),
                        block_table=block_table, seq_lens=seq_lens, page_size=page_size,
                        num_pages=num_pages)


def _page_lists(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(kv_num_blocks [G], kv_indices [G, N]) of a bool [G, N] page set per query block. (The
    rows span every page: torch's CPU template wants index rows as wide as the cache.)"""
    counts = mask.sum(dim=1, dtype=torch.int32)
    order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)
    return counts, order.to(torch.int32)


def _page_sets(pages: torch.Tensor, seen: torch.Tensor, whole: torch.Tensor, q_block: int,
               num_pages: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bool [G, N] twice, per block of `q_block` queries: the physical pages some query sees
    part of (`seen` [T, P] over the rows' logical pages `pages`), and those every query of
    the block sees whole (`whole`): the kernel skips the mask_mod on those."""
    t, p = pages.shape
    groups = -(-t // q_block)
    group = (torch.arange(t, device=pages.device) // q_block)[:, None].expand(t, p)
    absent = num_pages  # an extra column that collects the pages not seen
    any_seen = torch.zeros(groups, num_pages + 1, dtype=torch.bool, device=pages.device)
    any_seen[group, torch.where(seen, pages, absent)] = True
    times_whole = torch.zeros(groups, num_pages + 1, dtype=torch.int32, device=pages.device)
    times_whole.index_put_((group, torch.where(whole, pages, absent)),
                           torch.ones_like(pages, dtype=torch.int32), accumulate=True)
    queries = torch.bincount(group[:, 0], minlength=groups).to(torch.int32)
    full = times_whole[:, :num_pages] == queries[:, None]
    return any_seen[:, :num_pages] & ~full, full


def head_mask_block_mask(q: PagedQueries, streaming: torch.Tensor, sink: int, window: int,
                         q_block: int = 16, token_capacity: int = 0,
                         row_capacity: int = 0, whole_pages: bool = False) -> BlockMask:
    """The BlockMask of one layer: `streaming` bool [Hq] per query head (a GQA group's query
    heads follow their KV head; all False: full causal attention; one head's class for all:
    [1]), blocks of `q_block` queries by `page_size` keys. Block lists per head class (full,
    streaming; one head, broadcast, when every head is of one class); the mask_mod is exact.
    The tables the mask_mod reads are padded to `token_capacity` tokens and `row_capacity`
    rows (a step's largest), so that their shapes do not change from step to step: compiled
    flex_attention then compiles once (torch 2.13's CPU template fails to build kernels with
    dynamic shapes). `whole_pages`: pages every query of a block sees whole go in the full-block
    lists (no mask_mod on them); off by default: on torch 2.13's CPU kernels it measured no
    faster for prefill and slower for decode (4.5 vs 2.6 ms, one query over 4000 keys)."""
    device = q.doc.device
    page = q.page_size
    num_logical = int(-(-int(q.seq_lens.max()) // page)) if q.seq_lens.numel() else 1
    num_logical = max(num_logical, 1)
    table = q.block_table[:, :num_logical].long()
    first_key = torch.arange(num_logical, device=device) * page  # [P]
    row_pages = (q.seq_lens.long() + page - 1) // page           # [R]
    # a page is needed when it exists for the row and starts at or before the query (causal)
    needed = (first_key[None, :] <= q.position[:, None]) & \
        (torch.arange(num_logical, device=device)[None, :] < row_pages[q.doc][:, None])
    pages = table[q.doc]                                          # [T, P] physical
    lo_key = (q.chunk_start - window)[:, None]
    in_sight = (first_key[None, :] < sink) | (first_key[None, :] + page > lo_key)
    # a page seen whole: before the query (causal) and, on a streaming head, wholly in the
    # sink or wholly at or after chunk start - window
    before = needed & (first_key[None, :] + page - 1 <= q.position[:, None])
    in_full_sight = (first_key[None, :] + page <= sink) | (first_key[None, :] >= lo_key)
    classes = [(needed, before), (needed & in_sight, before & in_full_sight)]  # full, streaming
    streaming = streaming.to(device=device, dtype=torch.bool)
    # every head of one class: that class's lists only, one head broadcast over the query heads
    uniform = None if streaming.numel() > 1 and bool(streaming.any() ^ streaming.all()) \
        else bool(streaming.any())
    if uniform is not None:
        classes = [classes[int(uniform)]]
    sets = [_page_sets(pages, seen, whole, q_block, q.num_pages) for seen, whole in classes]
    if not whole_pages:
        sets = [(part | whole, torch.zeros_like(whole)) for part, whole in sets]
    partial = [_page_lists(part) for part, _ in sets]
    full = [_page_lists(whole) for _, whole in sets]
    head_class = streaming.long() if uniform is None else torch.zeros(1, dtype=torch.long,
                                                                       device=device)
    pick = lambda lists, i: torch.stack([x[i] for x in lists])[head_class][None]  # noqa: E731

    # physical page -> logical page of each row (-1: not the row's)
    num_rows = max(table.shape[0], row_capacity)
    to_logical = torch.full((num_rows, q.num_pages), -1, dtype=torch.long, device=device)
    logical = torch.arange(num_logical, device=device).expand_as(table)
    owned = logical < row_pages[:, None]
    rows = torch.arange(table.shape[0], device=device)[:, None].expand_as(table)
    to_logical[rows[owned], table[owned]] = logical[owned]
    t = q.num_tokens
    # the kernel evaluates whole query blocks: pad the per-token tables
    pad = max(t + (-t % q_block), token_capacity) - t
    doc = torch.nn.functional.pad(q.doc, (0, pad))
    position = torch.nn.functional.pad(q.position, (0, pad), value=-1)
    start = torch.nn.functional.pad(q.chunk_start, (0, pad))
    seq_lens = torch.nn.functional.pad(q.seq_lens.long(), (0, num_rows - table.shape[0]))
    lo = start - window

    def mask_mod(b, h, q_idx, kv_idx):
        row = doc[q_idx]
        logical_page = to_logical[row, kv_idx // page]
        key = logical_page * page + kv_idx % page
        valid = (logical_page >= 0) & (key <= position[q_idx]) & (key < seq_lens[row])
        if uniform is False:
            return valid
        seen = (key < sink) | (key >= lo[q_idx])
        return valid & (seen if uniform else seen | ~streaming[h])

    kwargs = {}
    if "compute_q_blocks" in BlockMask.from_kv_blocks.__code__.co_varnames:
        kwargs["compute_q_blocks"] = False  # inference only: no backward pass
    # (the full-block lists are always given: torch 2.13's CPU template refers to them in its
    # short-query (decode) kernel even when absent, and fails to compile)
    return BlockMask.from_kv_blocks(pick(partial, 0), pick(partial, 1), pick(full, 0),
                                    pick(full, 1), BLOCK_SIZE=(q_block, page),
                                    mask_mod=mask_mod,
                                    seq_lengths=(t, q.num_pages * page), **kwargs)


def blocks_computed(block_mask: BlockMask) -> torch.Tensor:
    """Long [H]: (query block, key page) pairs the kernel computes per head (masked or whole)."""
    out = block_mask.kv_num_blocks[0].long().sum(dim=-1)
    if block_mask.full_kv_num_blocks is not None:
        out = out + block_mask.full_kv_num_blocks[0].long().sum(dim=-1)
    return out
