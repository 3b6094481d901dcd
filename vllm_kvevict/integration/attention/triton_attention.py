"""The Triton path (`--kv-attention-backend triton`): the FlexAttention path's pool storage (a
cache layer per KV head, `kv_cache/head_pages.py`), its metadata builder (the step's per-token
chunk starts, token eviction's step plan) and its KV write, with our kernel for attention
(`kernels/head_pages.py`): every KV head of a layer, full, streaming or token-evicting, in one
launch over only the pages it keeps (the hybrid: two, full and streaming heads). vLLM lays
every cache layer out in one allocation, so a head's page is a page of the whole pool and the
page table holds pool page numbers. What it serves so far: `kernels/support.py`.
"""

from __future__ import annotations

import torch
from vllm.forward_context import get_forward_context
from vllm.model_executor.models.utils import extract_layer_index

from vllm_kvevict.integration.attention import flex_token
from vllm_kvevict.integration.attention.context import attention_kind
from vllm_kvevict.integration.attention.flex_attention import (FlexHeadMaskImpl,
                                                               FlexTokenImpl,
                                                               KVEvictFlexBackend,
                                                               KVEvictFlexImpl)
from vllm_kvevict.kernels.head_pages import head_pages_attention


def pool_pages(cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(K, V, unit): the whole pool under `cache` (a [blocks, heads, block_size, 2 * head_size]
    view of vLLM's one allocation) as [pages, block_size, head_size] K and V views, page p
    starting `unit` elements after page p - 1: a head's page where each cache layer holds one
    head (the head-pages layout), its slot in a token's row where a layer's heads sit side by
    side in each token (layer-outer, `full`), the pages then interleaved."""
    block_size, token, s_head = cache.shape[2], cache.stride(2), cache.stride(1)
    unit = s_head if cache.shape[1] > 1 and s_head < token else token * block_size
    numel = cache.untyped_storage().nbytes() // cache.element_size()
    total = (numel - (block_size - 1) * token - 2 * head_size) // unit + 1
    shape, strides = (total, block_size, head_size), (unit, token, 1)
    return (cache.as_strided(shape, strides, 0), cache.as_strided(shape, strides, head_size),
            unit)


def page_table(cache: torch.Tensor, block_table: torch.Tensor, page: int) -> torch.Tensor:
    """int32 [reqs, heads, width]: the pool page (`pool_pages`, `page` its unit) of each
    request's logical block of each head of `cache`."""
    offset, s_block, s_head = cache.storage_offset(), cache.stride(0), cache.stride(1)
    if offset % page or s_block % page or (cache.shape[1] > 1 and s_head % page):
        raise RuntimeError("vllm-kvevict: a cache layer is not whole pages of vLLM's KV "
                           "allocation; the Triton path cannot address it")
    heads = offset // page + torch.arange(cache.shape[1], device=block_table.device) * (
        s_head // page)
    return (block_table.long().unsqueeze(1) * (s_block // page)
            + heads.view(1, -1, 1)).to(torch.int32)


class TritonMixin:
    """What every kind shares: a profile run (no metadata) answered by the flex path, then
    each kind's `_forward`; the kernel calls `_attend` (heads at vLLM's block tables: `full`,
    a head mask's groups) and `_token_attend` (token eviction's heads at the step plan's
    physical slots)."""

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        if attn_metadata is None:  # (a profile run: the flex path's answer)
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        return self._forward(layer, query, key, value, kv_cache, attn_metadata, output)

    def _launch(self, query, k_pool, v_pool, table, lengths, query_start_loc, max_query_len,
                out, streaming=None, chunk_start=None):
        cfg = self.kv_state.config
        # (Triton's interpreter on the CPU: fewer, larger programs; the splits buy nothing)
        tiles = {"num_splits": 1, "block_n": 128, "block_m": 128} \
            if query.device.type == "cpu" else {}
        head_pages_attention(query, k_pool, v_pool, table, lengths, query_start_loc,
                             streaming=streaming, chunk_start=chunk_start, sink=cfg.sink,
                             window=cfg.window, scale=self.scale, max_query_len=max_query_len,
                             out=out, **tiles)

    def _attend(self, query, output, groups, streaming_of: dict[int, bool]):
        """`groups`: per kind of head, (the layer's cache of those heads, their KV-head
        indices, the group's metadata); one launch over all of them."""
        meta = groups[0][2]
        n, reqs = meta.num_actual_tokens, meta.num_reqs
        num_kv = self.num_kv_heads
        widths = [m.block_table.shape[1] for _, _, m in groups]
        table = torch.zeros(reqs, num_kv, max(widths), dtype=torch.int32,
                            device=query.device)
        lengths = torch.zeros(reqs, num_kv, dtype=torch.int32, device=query.device)
        k_pool, v_pool, page = pool_pages(groups[0][0], self.head_size)
        for (cache, kv_heads, m), width in zip(groups, widths):
            if cache.stride(2) != k_pool.stride(1):  # (one launch reads one token stride)
                raise RuntimeError("vllm-kvevict: a layer's head groups lay their tokens out "
                                   "differently; the Triton path reads one layout a launch")
            table[:, kv_heads, :width] = page_table(cache[:, :len(kv_heads)],
                                                    m.block_table[:reqs], page)
            lengths[:, kv_heads] = m.seq_lens[:reqs].to(torch.int32).unsqueeze(1)
        streaming = torch.tensor([streaming_of.get(h, False) for h in range(num_kv)],
                                 dtype=torch.int32, device=query.device)
        self._launch(query[:n], k_pool, v_pool, table, lengths,
                     meta.query_start_loc[:reqs + 1].to(torch.int32), int(meta.max_query_len),
                     output[:n], streaming=streaming,
                     chunk_start=meta.kvevict_queries.chunk_start[:n].to(torch.int32))
        return output

    def _token_attend(self, layer, plan, query, key, value, cache, output):
        """Token eviction's heads (all of `cache`'s, `query`'s): attention over each row's
        kept (compacted) past and its step at the plan's physical slots, patched scoring's
        question rows as extra requests sharing their request's pages (the plan lays them out
        so), then the step's chunks and decode-time jobs compressed (`flex_token._compress`:
        the flex path's storage). `output` rows: the model's token axis."""
        l, device = extract_layer_index(layer.layer_name), query.device
        rows = plan.with_questions(query)
        q_start, seq_lens, tables, longest = plan.on_device(device)
        k_pool, v_pool, page = pool_pages(cache, self.head_size)
        table = page_table(cache, tables[plan.layer_group[l]], page)
        lengths = seq_lens[l].unsqueeze(1).expand(-1, cache.shape[1])
        out = torch.empty(rows.shape, dtype=rows.dtype, device=device)
        self._launch(rows if rows.stride(2) == 1 else rows.contiguous(), k_pool, v_pool, table,
                     lengths, q_start, longest, out)
        n = plan.num_tokens
        output[:n] = out[:n]
        if plan.num_questions:
            off = plan.question_offset
            output[off:off + plan.num_questions] = out[n:]
        if plan.valid and (plan.jobs or plan.decode):
            flex_token._compress(self, l, plan, query, key, value, cache)
        return output


class TritonFullImpl(TritonMixin, KVEvictFlexImpl):
    """`full` on the Triton path: the layer's own cache, every head full."""

    def _forward(self, layer, query, key, value, kv_cache, attn_metadata, output):
        heads = torch.arange(self.num_kv_heads, device=query.device)
        return self._attend(query, output, [(kv_cache, heads, attn_metadata)], {})


class TritonHeadMaskImpl(TritonMixin, FlexHeadMaskImpl):
    """A head mask on the Triton path: each kind of head in its own KV-cache group of the pool
    (the flex path's storage and KV write), all of a layer's heads in one launch."""

    def _forward(self, layer, query, key, value, kv_cache, attn_metadata, output):
        context = get_forward_context()
        groups, streaming_of = [], {}
        for slots in self.head_slots(layer):
            groups.append((slots.cache(context), slots.kv_heads.to(query.device),
                           slots.metadata(context)))
            streaming_of.update({int(h): slots.streaming for h in slots.kv_heads})
        return self._attend(query, output, groups, streaming_of)


class TritonTokenImpl(TritonMixin, FlexTokenImpl):
    """snapkv / pyramidkv on the Triton path: the flex path's KV write at the step plan's
    physical slots (its questions' rows included), our kernel over the kept pages."""

    def _forward(self, layer, query, key, value, kv_cache, attn_metadata, output):
        return self._token_attend(layer, attn_metadata.plan, query, key, value, kv_cache,
                                  output)


class TritonHybridImpl(TritonMixin, FlexHeadMaskImpl):
    """A head mask with `--kv-token-policy` on the Triton path: its full heads as token
    eviction (`_token_attend`, questions included), its streaming heads over their group's
    sink + window pages (a launch each), and patched scoring's question rows on the streaming
    heads by dense attention (`flex_token.streaming_questions`: vLLM allocated the question's
    pages in the full heads' group only)."""

    def _forward(self, layer, query, key, value, kv_cache, attn_metadata, output):
        context = get_forward_context()
        for slots in self.head_slots(layer):
            meta, cache = slots.metadata(context), slots.cache(context)
            impl = self._narrowed(len(slots.kv_heads))
            q, k, v = query[:, slots.q_heads], key[:, slots.kv_heads], value[:, slots.kv_heads]
            out = torch.empty_like(q)
            plan = meta.plan
            if not slots.streaming:
                impl._token_attend(layer, plan, q, k, v, cache, out)
            else:
                heads = torch.arange(len(slots.kv_heads), device=query.device)
                impl._attend(q, out, [(cache, heads, meta)], dict.fromkeys(range(len(heads)),
                                                                            True))
                if plan.num_questions:
                    cfg, off = self.kv_state.config, plan.question_offset
                    out[off:off + plan.num_questions] = flex_token.streaming_questions(
                        plan, meta.kvevict_queries, q, k, v, self._slots(cache), self.scale,
                        cfg.sink, cfg.window)
            n = plan.num_tokens
            output[:n, slots.q_heads] = out[:n]
            if plan.num_questions:
                rows = slice(plan.question_offset, plan.question_offset + plan.num_questions)
                output[rows, slots.q_heads] = out[rows]
        return output


# The attention path of each kind of policy the Triton path serves (`kernels/support.py`).
IMPLS = {"full": TritonFullImpl, "head_mask": TritonHeadMaskImpl, "token": TritonTokenImpl,
         "hybrid": TritonHybridImpl}


class KVEvictTritonBackend(KVEvictFlexBackend):
    """The flex backend's metadata and storage, our kernel's attention."""

    @staticmethod
    def get_impl_cls():
        return IMPLS[attention_kind()]
