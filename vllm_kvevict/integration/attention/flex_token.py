"""Token eviction on the FlexAttention path (`flex_attention.py`): snapkv / pyramidkv, and a
head mask's full heads under `--kv-token-policy` (the impl narrowed to them, their cache read
as one multi-head cache, `head_pages.HeadSlots`).

Every head attends over its layer's kept (compacted) past and the step by physical position,
patched scoring's question rows as extra rows of their request; then the step's eviction chunks
are compressed from K/V read back out of the cache (`compress_chunks`). A head mask's streaming
heads run patched scoring's question rows here too (`streaming_questions`): FlexAttention's
mask covers the step's tokens, whose pages vLLM allocated, not the question's.
"""

from __future__ import annotations

import copy

import torch
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backends.flex_attention import FlexAttentionImpl

from vllm_kvevict.flex.block_mask import head_mask_block_mask, paged_queries
from vllm_kvevict.integration.attention.decode_eviction import compress_decode
from vllm_kvevict.integration.attention.step_plan import visible_before
from vllm_kvevict.integration.attention.token_step import compress_chunks


def forward(impl, layer, query, key, value, kv_cache, attn_metadata, output):
    """Attention of `impl`'s heads (`query`, `key`, `value` hold those) over `kv_cache` at the
    step plan's physical slots, then compression. `output` rows: the model's token axis."""
    plan, l = attn_metadata.plan, extract_layer_index(layer.layer_name)
    n = attn_metadata.num_actual_tokens
    masks = attn_metadata.kvevict_masks
    key_ = ("token", plan.layer_group[l], tuple(plan.seq_lens[l].tolist()))
    if key_ not in masks:
        q_start = plan.query_start_loc.long()
        q_lens = (q_start[1:] - q_start[:-1]).tolist()
        computed = [s - q for s, q in zip(plan.seq_lens[l].tolist(), q_lens)]
        device = query.device
        queries = paged_queries(computed, q_lens, plan.table(l).to(device),
                                attn_metadata.block_size, impl._slots(kv_cache).shape[0]
                                // attn_metadata.block_size)
        tokens, rows = attn_metadata.kvevict_capacity
        masks[key_] = head_mask_block_mask(
            queries, torch.zeros(1, dtype=torch.bool, device=device), 0, 0,
            q_block=attn_metadata.q_block_size, token_capacity=tokens, row_capacity=rows)
    rows_q = plan.with_questions(query)
    meta = copy.copy(attn_metadata)  # (the questions' rows count as tokens here)
    meta.num_actual_tokens, meta.block_mask = rows_q.shape[0], masks[key_]
    # vLLM writes the rows in place where they are one run of the output's token axis
    rows_out = plan.with_questions(output)
    direct = rows_out.data_ptr() == output.data_ptr() and rows_out.is_contiguous()
    out = rows_out if direct else torch.empty_like(rows_q)
    FlexAttentionImpl.forward(impl, layer, rows_q, key, value, kv_cache, meta, out)
    if not direct:
        output[:n] = out[:n]
        if plan.num_questions:
            off = plan.question_offset
            output[off:off + plan.num_questions] = out[n:]
    if plan.valid and (plan.jobs or plan.decode):
        _compress(impl, l, plan, query, key, value, kv_cache)
    return output


def _compress(impl, l, plan, query, key, value, kv_cache) -> None:
    """Compress the step's chunks and decode-time jobs (K/V read back by position)."""
    cache, hs = impl._slots(kv_cache), impl.head_size

    def read(job, start, count):
        past = cache[plan.physical_slots(l, job.row, start + torch.arange(count))]
        return past[..., :hs], past[..., hs:]

    for kept in (plan.jobs and compress_chunks(plan, l, query, key, value, lambda j, c:
                                               read(j, j.phys_before[l], c)),
                 plan.decode and compress_decode(plan, l, query, lambda j, c: read(j, 0, c))):
        if kept:
            impl._write(kv_cache, *kept)


def streaming_questions(plan, queries, query, key, value, slots: torch.Tensor, scale: float,
                        sink: int, window: int) -> torch.Tensor:
    """Patched scoring's question rows on a head mask's streaming heads ([Q, query heads,
    head size]): question token i of row r sees the row's sink, the window before its chunk,
    the step's tokens (in the pool: the step was written there) and questions 0..i, as the CPU
    path's kernel rows (`build_step_plan`); dense attention over the gathered keys (a few
    rows per eviction chunk). `queries`: the streaming group's `PagedQueries`; `slots`: its
    cache as [slots, heads, 2 * head size] (K, then V)."""
    n, hs = plan.num_tokens, key.shape[-1]
    q_rows, k_rows, v_rows = (plan.with_questions(x) for x in (query, key, value))
    out = q_rows.new_zeros(plan.num_questions, *query.shape[1:])
    bs = queries.page_size
    per_kv = query.shape[1] // key.shape[1]
    for job in plan.jobs:
        if not job.question:
            continue
        tokens = (queries.doc == job.row).nonzero().flatten()
        a, end = int(queries.position[tokens[0]]), int(queries.position[tokens[-1]]) + 1
        past = torch.cat([visible_before(a, sink, window, int(queries.chunk_start[tokens[0]])),
                          torch.arange(a, end)]).to(queries.block_table.device)
        pool = slots[queries.block_table[job.row, past // bs].long() * bs + past % bs]
        k, lo = len(job.question), job.question_start
        keys = torch.cat([pool[..., :hs], k_rows[lo:lo + k]]).repeat_interleave(per_kv, 1)
        vals = torch.cat([pool[..., hs:], v_rows[lo:lo + k]]).repeat_interleave(per_kv, 1)
        mask = torch.ones(k, len(past) + k, dtype=torch.bool, device=keys.device)
        mask[:, len(past):] = torch.ones(k, k, dtype=torch.bool, device=keys.device).tril()
        att = torch.nn.functional.scaled_dot_product_attention(
            q_rows[lo:lo + k].transpose(0, 1), keys.transpose(0, 1).to(q_rows.dtype),
            vals.transpose(0, 1).to(q_rows.dtype), attn_mask=mask, scale=scale)
        out[lo - n:lo - n + k] = att.transpose(0, 1)
    return out
