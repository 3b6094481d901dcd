"""The FlexAttention path: vLLM's FlexAttention backend, subclassed, with the head-mask
policies' streaming heads as block-sparse masks (`vllm_kvevict/flex/block_mask.py`).

Chosen with `--kv-attention-backend flex` (the default off the CPU platform); our worker
registers it under CPU_ATTN on the CPU platform (which answers that whatever is asked) and under
FLEX_ATTENTION elsewhere (`use_head_pages_backend`). Head masks keep one cache layer per KV head
(`kv_cache/head_pages.py`): a layer's full heads attend over their group's pages, its streaming
heads over their sink + window group's, and a streaming head's mask lists only the pages of
sink + window + chunk, so its work follows those, not the prompt. `full` runs vLLM's
FlexAttention with our KV write and block mask; snapkv / pyramidkv write and read at the
token-eviction plan's physical slots. Design: docs/flex_attention.md.
"""

from __future__ import annotations

import copy
import dataclasses

import torch
from vllm.forward_context import get_forward_context
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backends.flex_attention import (FlexAttentionBackend, FlexAttentionImpl,
                                                       FlexAttentionMetadata,
                                                       FlexAttentionMetadataBuilder)

from vllm_kvevict.flex import FLEX_RECOMPILE_LIMIT
from vllm_kvevict.flex.block_mask import PagedQueries, chunk_starts, head_mask_block_mask
from vllm_kvevict.integration.attention import flex_token, inductor_cache
from vllm_kvevict.integration.attention.context import (HEAD_PAGE_BACKENDS, attention_context,
                                                        attention_kind, extend_metadata)
from vllm_kvevict.integration.kv_cache.head_pages import HeadSlots, head_slots
from vllm_kvevict.served import policy_config_of

FLEX_BACKEND = HEAD_PAGE_BACKENDS["flex"]
TOKEN_PLANNED = ("token", "hybrid")  # the kinds whose flex path reads the worker's step plan


# -- from our worker class (kvevict_worker.KVEvictWorker) -------------------------------------

def use_head_pages_backend(vllm_config, platform: str) -> bool:
    """Before the worker builds its model, for `--kv-attention-backend flex` or `triton` (the
    triton path is this one with our kernel for vLLM's flex_attention): our backend is what
    vLLM's CPU_ATTN resolves to on the CPU platform (which answers CPU_ATTN whatever backend is
    asked for), and FLEX_ATTENTION elsewhere (start-up validation set the config's backend to
    it); `register_backend` is vLLM's way to override a name. MLA models get vLLM's MLA
    backends."""
    backend = HEAD_PAGE_BACKENDS.get(policy_config_of(vllm_config).attention_backend)
    if backend is None:
        return False
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    name = "CPU_ATTN" if platform == "cpu" else "FLEX_ATTENTION"
    register_backend(AttentionBackendEnum[name], backend)
    allow_flex_recompiles()
    inductor_cache.guard()
    return True


def allow_flex_recompiles() -> None:
    """vLLM's module sets 16 compilations of its compiled flex_attention; a head mask calls it
    with each layer's count of full and of streaming heads (each a compilation, once per
    shape). Raised here, in the worker that serves the flex path, not at import."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit,
                                               FLEX_RECOMPILE_LIMIT)


@dataclasses.dataclass
class KVEvictFlexMetadata(FlexAttentionMetadata):
    """vLLM's FlexAttention metadata with the step's per-token chunk starts, its block masks
    (built once per head split and step) and token eviction's step plan."""

    kvevict_queries: PagedQueries | None = None
    kvevict_masks: dict = dataclasses.field(default_factory=dict)
    kvevict_capacity: tuple[int, int] = (0, 0)  # the padded mask-table sizes (one compile)
    plan: object = None  # TokenStepPlan (token eviction, the hybrid)


class KVEvictFlexMetadataBuilder(FlexAttentionMetadataBuilder):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.kv_state = attention_context()

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
        common = common_attn_metadata
        n = common.num_reqs
        q_start = common.query_start_loc_cpu[: n + 1].long()
        q_lens = (q_start[1:] - q_start[:-1]).tolist()
        seq_lens = common.seq_lens[:n].cpu().long()
        computed = (seq_lens - torch.tensor(q_lens, dtype=torch.long)).tolist()
        doc = torch.repeat_interleave(torch.arange(n), torch.tensor(q_lens))
        position = torch.tensor(computed, dtype=torch.long)[doc] + \
            torch.arange(len(doc)) - q_start[:-1][doc]
        device, state = common.seq_lens.device, self.kv_state
        # (a head mask's canonical prefill chunk E, 0: each step its own chunk: with prefix
        # caching on, a cached block's K/V must not depend on how vLLM split the steps)
        queries = PagedQueries(
            doc=doc.to(device), position=position.to(device),
            chunk_start=chunk_starts(computed, q_lens, state.planner.row_prompt_lens(common, n),
                                     state.chunk or None).to(device),
            block_table=common.block_table_tensor[:n], seq_lens=seq_lens.to(device),
            page_size=self.block_size, num_pages=self.cache_config.num_gpu_blocks)
        # token eviction: the step's physical lengths, slots, chunks
        plan = state.planner.step_plan(common) if state.kind in TOKEN_PLANNED else None
        return extend_metadata(metadata, KVEvictFlexMetadata, kvevict_queries=queries,
                               kvevict_masks={}, plan=plan,
                               kvevict_capacity=mask_capacity(self.vllm_config))


def mask_capacity(vllm_config) -> tuple[int, int]:
    """The mask tables' fixed sizes (tokens, rows): one compilation for every step
    (block_mask.py). Patched eviction adds up to one question of `obs_window` rows per
    request (`question_rows`; a per-request window above the served one is refused on this
    path, `overrides.py`)."""
    scheduler = vllm_config.scheduler_config
    tokens, rows = scheduler.max_num_batched_tokens, scheduler.max_num_seqs
    window = policy_config_of(vllm_config).max_obs_window  # (None: no question rows)
    if window is not None:
        return tokens + rows * window, 2 * rows
    return tokens, rows


class KVEvictFlexImpl(FlexAttentionImpl):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # the attention context (context.py): head splits, the step's plan
        self.kv_state = attention_context()
        self._slots_of: tuple[HeadSlots, ...] | None = None  # this layer's, head masks
        self._narrow: dict[int, KVEvictFlexImpl] = {}

    def head_slots(self, layer) -> tuple[HeadSlots, ...]:
        """A head mask: this layer's full and streaming heads in the pool (those it has)."""
        if self._slots_of is None:
            heads = self.kv_state.heads[extract_layer_index(layer.layer_name)]
            full, streaming = head_slots(layer.layer_name, heads)
            self._slots_of = tuple(
                HeadSlots(names, kv, heads.queries_per_kv, kind)
                for names, kv, kind in ((full, heads.full_kv, False),
                                        (streaming, heads.streaming_kv, True)) if kv)
        return self._slots_of

    def _narrowed(self, num_kv_heads: int) -> KVEvictFlexImpl:
        """This impl for `num_kv_heads` of its heads (and their query heads): vLLM's forward
        reads its head counts from the impl."""
        impl = self._narrow.get(num_kv_heads)
        if impl is None:
            impl = copy.copy(self)
            impl.num_kv_heads = num_kv_heads
            impl.num_heads = num_kv_heads * (self.num_heads // self.num_kv_heads)
            self._narrow[num_kv_heads] = impl
        return impl

    def _slots(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """The cache as [slots, heads, 2 * head_size]: [blocks, heads, block_size, 2 *
        head_size] over LBNHC storage, so (block, token) flattens to one slot axis. (A view,
        not a reshape: a copy would take the writes silently; LBNHC makes it a view.)"""
        return kv_cache.transpose(1, 2).view(-1, kv_cache.shape[1], 2 * self.head_size)

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        """The step's K/V at their slots (vLLM's CPU build has no `reshape_and_cache_flash`)."""
        self._write(kv_cache, key, value, slot_mapping)

    def _write(self, kv_cache, key, value, slot_mapping) -> None:
        n = slot_mapping.shape[0]
        slots = slot_mapping.long()
        keep = slots >= 0  # (padding tokens have slot -1)
        cache, hs = self._slots(kv_cache), self.head_size
        cache[slots[keep], :, :hs] = key[:n][keep].to(cache.dtype)
        cache[slots[keep], :, hs:] = value[:n][keep].to(cache.dtype)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        # `full`: our block mask all the same: vLLM's direct one lists at most a sequence's
        # pages per query block, and torch's CPU template refuses a mask narrower than the
        # whole paged cache ("KV seqlen must be smaller than the block_mask size").
        if attn_metadata is not None:
            attn_metadata.block_mask = self._mask(attn_metadata, False, 0, 0)
        return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                               output_scale, output_block_scale)

    @staticmethod
    def _mask(meta, streaming: bool, sink: int, window: int):
        """The block mask of a group's step for heads of one kind (one head, broadcast over
        the query heads), built once per step and shared by the group's layers."""
        key = ("heads", streaming)
        if key not in meta.kvevict_masks:
            tokens, rows = meta.kvevict_capacity
            meta.kvevict_masks[key] = head_mask_block_mask(
                meta.kvevict_queries,
                torch.full((1,), streaming, device=meta.kvevict_queries.doc.device),
                sink, window, q_block=meta.q_block_size, token_capacity=tokens,
                row_capacity=rows)
        return meta.kvevict_masks[key]


class FlexTokenImpl(KVEvictFlexImpl):
    """Token eviction (snapkv, pyramidkv) on the flex path: K/V at their physical slots after
    earlier evictions, the patched questions' rows included (the step plan's); attention and
    compression in `flex_token`."""

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        plan = self.kv_state.planner.plan
        self._write(kv_cache, plan.with_questions(key), plan.with_questions(value),
                    plan.slots[extract_layer_index(layer.layer_name)])

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        if attn_metadata is None:  # (a profile run: vLLM's own answer)
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        return flex_token.forward(self, layer, query, key, value, kv_cache, attn_metadata,
                                  output)


class FlexHeadMaskImpl(KVEvictFlexImpl):
    """A head mask on the flex path: each kind of head (full, streaming) in its own KV-cache
    group of the pool, with its own block mask. The hybrid is this composed with the token
    path: its full heads' slots write and attend as `FlexTokenImpl` does (`_token_heads`)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._token_heads = self.kv_state.served.kind == "hybrid"  # (full heads evict tokens)

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        context = get_forward_context()
        for slots in self.head_slots(layer):
            meta = slots.metadata(context)
            if meta is None:
                continue
            k, v, where = key[:, slots.kv_heads], value[:, slots.kv_heads], meta.slot_mapping
            if self._token_heads and not slots.streaming:
                plan = self.kv_state.planner.plan
                k, v = plan.with_questions(k), plan.with_questions(v)
                where = plan.slots[extract_layer_index(layer.layer_name)]
            self._write(slots.cache(context), k, v, where)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        if attn_metadata is None:  # (a profile run: vLLM's own answer)
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        return self._forward_head_slots(layer, query, key, value, output)

    def _forward_head_slots(self, layer, query, key, value, output):
        """A head mask: each kind of head (full, streaming) attends over its own group's pages
        with that group's block mask (a streaming head's lists sink + window + chunk); with a
        token policy its full heads as token eviction does (`flex_token`), and patched
        scoring's question rows on its streaming heads too."""
        context, state = get_forward_context(), self.kv_state
        cfg = state.config
        for slots in self.head_slots(layer):
            meta, impl = slots.metadata(context), self._narrowed(len(slots.kv_heads))
            q, k, v = query[:, slots.q_heads], key[:, slots.kv_heads], value[:, slots.kv_heads]
            out = torch.empty_like(q)  # (only the rows written are copied out)
            if self._token_heads and not slots.streaming:
                flex_token.forward(impl, layer, q, k, v, slots.cache(context), meta, out)
                plan = meta.plan
                output[:plan.num_tokens, slots.q_heads] = out[:plan.num_tokens]
                if plan.num_questions:
                    rows = slice(plan.question_offset, plan.question_offset + plan.num_questions)
                    output[rows, slots.q_heads] = out[rows]
                continue
            n = meta.num_actual_tokens
            meta.block_mask = self._mask(meta, slots.streaming, cfg.sink, cfg.window)
            # (vLLM's decoder forward reads K and V from the cache do_kv_cache_update wrote)
            FlexAttentionImpl.forward(impl, layer, q, k, v, slots.cache(context), meta, out)
            output[:n, slots.q_heads] = out[:n]
            plan = getattr(meta, "plan", None)
            if plan is not None and plan.num_questions:
                off = plan.question_offset
                output[off:off + plan.num_questions, slots.q_heads] = \
                    flex_token.streaming_questions(plan, meta.kvevict_queries, q, k, v,
                                                   self._slots(slots.cache(context)),
                                                   self.scale, cfg.sink, cfg.window)
        return output


# The attention path of each kind of policy, chosen once (vLLM builds the impl per layer).
IMPLS = {"full": KVEvictFlexImpl, "head_mask": FlexHeadMaskImpl, "token": FlexTokenImpl,
         "hybrid": FlexHeadMaskImpl}


class KVEvictFlexBackend(FlexAttentionBackend):
    """vLLM's FlexAttention backend with the plugin's KV write and head masks."""

    @staticmethod
    def get_impl_cls():
        return IMPLS[attention_kind()]

    @staticmethod
    def get_builder_cls():
        return KVEvictFlexMetadataBuilder
