"""Token eviction on the CPU path (`backend.py`): snapkv / pyramidkv, and a head mask's full
heads under `--kv-token-policy`.

Every paged head attends with vLLM's CPU kernel over its layer's kept (compacted) past and the
step, at the step plan's physical positions, patched scoring's question rows as extra rows of
their request; then the step's eviction chunks (and decode-time jobs) are compressed from K/V
read back out of the paged cache and the kept ones written at their physical slots. A head
mask's streaming heads run as without a token policy (`backend.KVEvictAttentionImpl._streaming`),
the question rows included.
"""

from __future__ import annotations

import importlib

import torch

from vllm_kvevict.integration.attention.decode_eviction import compress_decode
from vllm_kvevict.integration.attention.fp8 import layer_scales
from vllm_kvevict.integration.attention.paged_layout import paged_layout
from vllm_kvevict.integration.attention.token_step import compress_chunks
from vllm_kvevict.integration.plugins.versions import CPU_OPS

ops = importlib.import_module(CPU_OPS)  # vLLM's CPU attention ops (moved in 0.34)


def forward(impl, state, layer, l, query, key, value, kv_cache, attn_metadata, output):
    """Attention over the kept (compacted) past + the chunk, then compress the chunk (`impl`:
    the `KVEvictAttentionImpl` of `layer`, model layer `l`). A head mask with a token policy:
    its full heads so; its streaming heads over their pool blocks, the patched questions'
    rows included."""
    plan, n = attn_metadata.plan, attn_metadata.num_actual_tokens
    heads = state.heads[l]
    if heads.all_full:
        _paged_with_eviction(impl, layer, l, plan, n, query, key, value, kv_cache, output)
        return output
    if heads.full_kv:
        full_q, full_kv = heads.full_q, list(heads.full_kv)
        out = output[:, full_q]
        # (tensor parallel: this rank's full heads first, the padded spec's rest unused)
        _paged_with_eviction(impl, layer, l, plan, n, query[:, full_q], key[:, full_kv],
                             value[:, full_kv], kv_cache[:, :len(full_kv)], out)
        output[:, full_q] = out
    rows = plan.with_questions
    out = impl._streaming(state, layer, heads, plan.streaming, rows(query), rows(key),
                          rows(value))
    stream_q, off = heads.streaming_q, plan.question_offset
    output[:n, stream_q] = out[:n]
    if plan.num_questions:
        output[off:off + plan.num_questions, stream_q] = out[n:]
    return output


def _paged_with_eviction(impl, layer, l, plan, n, query, key, value, kv_cache, output):
    num_kv, num_q = key.shape[1], query.shape[1]
    seq_lens = plan.seq_lens[l]
    sched = impl._schedule(layer, plan.kernel_schedules, (num_kv, *seq_lens.tolist()),
                           plan.num_reqs, num_q, num_kv, seq_lens, plan.query_start_loc,
                           output.dtype)
    table = plan.table(l)  # the block rows of this layer's KV-cache group
    if plan.num_questions:
        out = torch.empty(n + plan.num_questions, *output.shape[1:], dtype=output.dtype)
        impl._kernel(layer, plan.with_questions(query), kv_cache, out,
                     plan.query_start_loc, seq_lens, table, sched)
        output[:n] = out[:n]
        off = plan.question_offset
        output[off:off + plan.num_questions] = out[n:]
    else:
        impl._kernel(layer, query[:n], kv_cache, output[:n], plan.query_start_loc,
                     seq_lens, table, sched)
    if plan.valid and plan.jobs:
        _compress(impl, layer, l, plan, kv_cache, lambda read: compress_chunks(
            plan, l, query, key, value, lambda job, count: read(job, job.phys_before[l],
                                                                count)))
    if plan.valid and plan.decode:
        _compress(impl, layer, l, plan, kv_cache, lambda read: compress_decode(
            plan, l, query, lambda job, count: read(job, 0, count)))


def _compress(impl, layer, l, plan, kv_cache, compress) -> None:
    """Run `compress(read)` (token eviction of prefill chunks or decode-time) and write the
    kept KVs it returns at their physical slots, through vLLM's CPU kernel layout;
    `read(job, start, count)` gives K/V of a job's row from the paged cache."""
    key_cache, value_cache = impl._split(kv_cache)

    def read(job, start, count):
        layout = paged_layout(key_cache.dtype, impl.kv_state.block_size, impl.head_size,
                              layer.isa)
        return layout.read(key_cache, value_cache, plan.table(l)[job.row], start, count)

    kept = compress(read)
    if kept is not None:
        k_scale, v_scale = layer_scales(layer)
        ops.cpu_attn_reshape_and_cache(*kept[:2], key_cache, value_cache, kept[2],
                                       layer.isa, k_scale=k_scale, v_scale=v_scale,
                                       kv_cache_dtype=impl.kv_cache_dtype)
