"""The attention backend: vLLM's CPU backend, with head-mask policies applied inside it.

Registered over `CPU_ATTN` (the CPU platform always asks for it). With `full` every class here
is vLLM's own, so `full` is stock vLLM bit for bit. With a head mask, per layer, full heads run
vLLM's kernel over the paged cache (which holds only them) and streaming heads run it over a
scratch paged cache laid out from their blocks in vLLM's pool (`step_plan.py`,
`paged_layout.lay_out_from_pool`; decode steps read the pool in place, `step_plan.window_rows`,
or their window read back, `paged_layout.decode_window`); a layer of full heads only takes the
stock path. With token eviction (snapkv, pyramidkv, or a head mask's full heads under
`--kv-token-policy`) the paged heads attend over their compacted past and each prefill chunk is
compressed after. Design: docs/design/kv_cache.md, docs/design/attention.md.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib

import torch
from vllm import envs
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backends.cpu_attn import (CPUAttentionBackend, CPUAttentionBackendImpl,
                                                 CPUAttentionMetadata,
                                                 CPUAttentionMetadataBuilder)

from vllm_kvevict.integration.attention import cpu_token
from vllm_kvevict.integration.attention.context import (attention_context, attention_kind,
                                                        extend_metadata)
from vllm_kvevict.integration.attention.fp8 import is_fp8, layer_scales
from vllm_kvevict.integration.attention.paged_layout import (POOL_LAYOUTS, decode_in_place,
                                                             decode_window, lay_out_from_pool)
from vllm_kvevict.integration.attention.step_plan import decode_attention
from vllm_kvevict.integration.plugins.versions import CPU_OPS

ops = importlib.import_module(CPU_OPS)  # vLLM's CPU attention ops (moved in 0.34)


@functools.lru_cache(maxsize=None)  # (parsed once per layer name, not twice per layer and step)
def _index_of(layer_name: str) -> int:
    return extract_layer_index(layer_name)


def _layer_index(layer) -> int:
    return _index_of(layer.layer_name)


def _dense(x: torch.Tensor, n: int, at) -> torch.Tensor | None:
    """x[:n, at] if that view is dense (one row, the heads side by side), else None: vLLM's CPU
    kernel writes its output as dense [tokens, heads, d] rows (it ignores the output's row
    stride; it reads the query's, so a query may be a view of some heads of every row)."""
    if isinstance(at, slice):
        view = x[:n, at]
        if view.is_contiguous():
            return view
    return None


@dataclasses.dataclass
class KVEvictMetadata(CPUAttentionMetadata):
    """vLLM's CPU metadata with the step's common metadata and the policy's step plan."""

    common: object = None  # vLLM's CommonAttentionMetadata of the step
    plan: object = None  # StepPlan (head masks) or TokenStepPlan (token eviction, the hybrid)


class KVEvictMetadataBuilder(CPUAttentionMetadataBuilder):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.kv_state = attention_context()  # (chosen only where there is one)
        # This group's paged cache holds only the full heads of its layers: the kernel's
        # work split must be sized for their query heads, not the layer's.
        self.num_heads = self.num_kv_heads * self.kv_state.heads[0].queries_per_kv

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
        return extend_metadata(metadata, KVEvictMetadata, common=common_attn_metadata,
                               plan=self.kv_state.planner.step_plan(common_attn_metadata))


class KVEvictAttentionImpl(CPUAttentionBackendImpl):
    """Head masks (streaming, duo, prulong): full heads over their own paged cache, streaming
    heads over sink + window laid out from the pool; `KVEvictTokenImpl` for token eviction."""
    _scratch: dict[tuple, torch.Tensor] = {}  # per (streaming heads, dtype), shared by layers

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # set before the model (KVEvictWorker.init_device), which builds these per layer
        self.kv_state = attention_context()
        # vLLM's kernel with nothing but causal attention: the streaming heads' in-place decode
        # (the kernel reads fp8 codes as for stock); the read-back one reads unquantized values
        self._plain = self.alibi_slopes is None and not self.logits_soft_cap \
            and self.sliding_window in (None, -1)
        self._read_back = self._plain and not is_fp8(self.kv_cache_dtype)
        self._views: dict[str, tuple] = {}  # `head_caches`: per use, (cache, heads, K/V views)

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        heads = self.kv_state.heads[_layer_index(layer)]
        if heads.all_full:
            return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        if heads.full_kv:  # (a view where the full heads sit side by side: the write takes it)
            full = heads.full_kv_at
            super().do_kv_cache_update(layer, key[:, full], value[:, full],
                                       kv_cache[:, :len(heads.full_kv)], slot_mapping)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        if attn_metadata is None:  # a profile run without attention: defined values (V2's
            return output.zero_()  # sampler runs on them; vLLM's flex backend does the same)
        state = self.kv_state
        heads = state.heads[_layer_index(layer)]
        if heads.all_full:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        n = attn_metadata.num_actual_tokens
        if heads.full_kv:
            full_q, num_full = heads.full_q, len(heads.full_kv)
            sched = attn_metadata.scheduler_metadata
            if num_full != kv_cache.shape[1]:
                # tensor parallel: this rank holds fewer full heads than the layer's spec
                # declares (`kv_cache_specs.layer_heads`); the padding heads stay unused
                sched = self._schedule(
                    layer, attn_metadata.__dict__.setdefault("full_head_schedules", {}),
                    num_full, attn_metadata.common.num_reqs, len(full_q), num_full,
                    attn_metadata.seq_lens, attn_metadata.query_start_loc, output.dtype)
            # the kernel writes dense rows: into `output` where its rows are (one row), else
            # a copy after
            into = _dense(output, n, heads.full_q_at)
            out = torch.empty(n, len(full_q), self.head_size, dtype=output.dtype) \
                if into is None else into
            self._kernel(layer, query[:n, heads.full_q_at], self.head_caches("full", kv_cache, num_full),
                         out, attn_metadata.query_start_loc, attn_metadata.seq_lens,
                         attn_metadata.block_table, sched)
            if into is None:
                output[:n, full_q] = out
        into = _dense(output, n, heads.streaming_q_at)
        out = self._streaming(state, layer, heads, attn_metadata.plan, query[:n], key[:n],
                              value[:n], into)
        if out is not into:
            output[:n, heads.streaming_q] = out
        return output

    def head_caches(self, use: str, kv_cache: torch.Tensor, heads: int):
        """(K, V) of a cache of this layer (its own: "full"; its streaming companion's: "pool"),
        its first `heads` heads (tensor parallel pads the rest): views made once per use."""
        views = self._views.get(use)
        if views is None or views[0] is not kv_cache or views[1] != heads:
            views = self._views[use] = (kv_cache, heads, self._split(kv_cache[:, :heads]))
        return views[2]

    def _streaming(self, state, layer, heads, plan, query, key, value,
                   into: torch.Tensor | None = None) -> torch.Tensor:
        """The streaming heads' outputs for the rows of `query` (the plan's kernel queries),
        over [sink | window | chunk] laid out from the pool (the step's K/V written there
        first)."""
        stream_q, num_stream = heads.streaming_q, len(heads.streaming_kv)
        if not plan.valid:  # profiling / warm-up runs without real requests
            return torch.zeros(query.shape[0], len(stream_q), self.head_size, dtype=query.dtype)
        at = heads.streaming_kv_at  # (views where side by side: only the cache write reads them)
        keys, values = key[:, at], value[:, at]
        plain = self._plain
        if plan.decode_q is not None and plain and state.in_place:
            # one decode query per row, sink in whole blocks: the kernel in place, no read-back;
            # it writes every row (one per request): `into` if dense, else no zeroed output
            out = torch.empty(query.shape[0], len(stream_q), self.head_size, dtype=query.dtype) \
                if into is None else into
            decode_in_place(self, layer, plan, state.config, query[:, heads.streaming_q_at],
                            keys, values, out)
            return out
        out = torch.zeros(query.shape[0], len(stream_q), self.head_size, dtype=query.dtype)
        if plan.decode_pos is not None and self._read_back:
            # one decode query per row: attention on the window read back, no scratch cache
            k, v = decode_window(self, layer, plan, keys, values)
            return decode_attention(query[:, stream_q], k, v, self.scale)
        scales = layer_scales(layer)
        laid_k, laid_v = lay_out_from_pool(self, layer, plan, keys, values)
        # fp8: the laid-out values are already the codes' grid values (step_plan.py)
        dtype, write_scale = ((torch.uint8, (1.0, 1.0)) if is_fp8(self.kv_cache_dtype)
                              else (keys.dtype, scales))
        scratch = self._scratch_cache(num_stream, int(plan.block_table.max()) + 1,
                                      state.block_size, dtype)
        k_cache, v_cache = self._split(scratch)
        ops.cpu_attn_reshape_and_cache(laid_k, laid_v, k_cache, v_cache, plan.scratch_slots,
                                       layer.isa, k_scale=write_scale[0],
                                       v_scale=write_scale[1],
                                       kv_cache_dtype=self.kv_cache_dtype)
        sched = self._schedule(layer, plan.kernel_schedules, num_stream, plan.num_reqs,
                               len(stream_q), num_stream, plan.seq_lens,
                               plan.query_start_loc, query.dtype)
        self._kernel(layer, query[:, stream_q], scratch, out, plan.query_start_loc,
                     plan.seq_lens, plan.block_table, sched)
        return out

    # -- helpers -------------------------------------------------------------------------
    @staticmethod
    def _split(kv_cache: torch.Tensor):
        num_blocks, num_kv_heads, block_size, _ = kv_cache.size()
        return kv_cache.view(num_blocks, num_kv_heads, block_size * 2, -1).chunk(2, dim=2)

    def _kernel(self, layer, query, kv_cache, out, query_start_loc, seq_lens, block_table,
                scheduler_metadata, sliding_window: int | None = None) -> None:
        """vLLM's CPU kernel over a layer's cache or a split (K, V) pair (default window: the
        layer's)."""
        key_cache, value_cache = kv_cache if isinstance(kv_cache, tuple) else \
            self._split(kv_cache)
        k_scale, v_scale = layer_scales(layer)
        ops.cpu_attention_with_kv_cache(
            query=query, key_cache=key_cache, value_cache=value_cache, output=out,
            query_start_loc=query_start_loc, seq_lens=seq_lens, scale=self.scale, causal=True,
            alibi_slopes=self.alibi_slopes,
            sliding_window=self.sliding_window if sliding_window is None else sliding_window,
            block_table=block_table, softcap=self.logits_soft_cap,
            scheduler_metadata=scheduler_metadata, s_aux=None, dynamic_causal=None,
            k_scale=k_scale, v_scale=v_scale,
            kv_cache_dtype=self.kv_cache_dtype)

    def _scratch_cache(self, num_heads: int, num_blocks: int, block_size: int,
                       dtype: torch.dtype) -> torch.Tensor:
        # Zero-initialised: the kernel reads whole block tiles past seq_len.
        cache = self._scratch.get((num_heads, dtype))
        if cache is None or cache.shape[0] < num_blocks:
            cache = torch.zeros(max(num_blocks, 2 * (0 if cache is None else cache.shape[0])),
                                num_heads, block_size, 2 * self.head_size,
                                dtype=dtype)
            KVEvictAttentionImpl._scratch[(num_heads, dtype)] = cache
        return cache

    def _schedule(self, layer, cache: dict, key, num_reqs, num_q_heads, num_kv_heads, seq_lens,
                  query_start_loc, dtype, sliding_window: int | None = None):
        """vLLM's kernel work split for these rows and head counts, built once per `key` in
        `cache` (a step's plan or metadata)."""
        sched = cache.get(key)
        if sched is None:
            sched = cache[key] = ops.cpu_attn_get_scheduler_metadata(
                num_reqs=num_reqs, num_heads=num_q_heads, num_kv_heads=num_kv_heads,
                head_dim=self.head_size, seq_lens=seq_lens, dtype=dtype,
                query_start_loc=query_start_loc, causal=True,
                sliding_window_size=self.sliding_window if sliding_window is None
                else sliding_window, isa=layer.isa,
                enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, dynamic_causal=None,
                kv_cache_dtype=self.kv_cache_dtype)
        return sched


class KVEvictTokenImpl(KVEvictAttentionImpl):
    """Token eviction (snapkv, pyramidkv), and the hybrid: a head mask whose full heads evict
    tokens (its streaming heads run the head-mask path's `_streaming`, in `cpu_token.py`)."""

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        # New tokens go to their physical slots in this layer (after earlier evictions); a
        # head mask with a token policy writes its full heads only.
        heads, plan = self.kv_state.heads[_layer_index(layer)], self.kv_state.planner.plan
        if not heads.all_full:
            if not heads.full_kv:
                return None
            # (tensor parallel: a padded spec's first heads)
            full, num_full = heads.full_kv_at, len(heads.full_kv)
            key, value, kv_cache = key[:, full], value[:, full], kv_cache[:, :num_full]
        return CPUAttentionBackendImpl.do_kv_cache_update(
            self, layer, plan.with_questions(key), plan.with_questions(value), kv_cache,
            plan.slots[heads.layer])

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        if attn_metadata is None:  # (a profile run without attention, as above)
            return output.zero_()
        return cpu_token.forward(self, self.kv_state, layer, _layer_index(layer), query, key,
                                 value, kv_cache, attn_metadata, output)


# The attention path of each kind of policy, chosen once (vLLM builds the impl per layer).
IMPLS = {"full": CPUAttentionBackendImpl, "head_mask": KVEvictAttentionImpl,
         "token": KVEvictTokenImpl, "hybrid": KVEvictTokenImpl}
BUILDERS = {"full": CPUAttentionMetadataBuilder, "head_mask": KVEvictMetadataBuilder,
            "token": KVEvictMetadataBuilder, "hybrid": KVEvictMetadataBuilder}
# The KV-cache layouts of the kinds whose streaming heads are in the pool (vLLM's otherwise).
LAYOUTS = {"head_mask": POOL_LAYOUTS, "hybrid": POOL_LAYOUTS}


class KVEvictAttentionBackend(CPUAttentionBackend):
    """Keeps the name CPU_ATTN: vLLM's CPU platform selects backends by that name."""

    @classmethod
    def supported_kv_cache_layouts(cls):
        # (pool storage: groups of mixed page sizes, sink_window.py)
        return LAYOUTS.get(attention_kind()) or super().supported_kv_cache_layouts()

    @staticmethod
    def get_impl_cls():
        return IMPLS[attention_kind()]

    @staticmethod
    def get_builder_cls():
        return BUILDERS[attention_kind()]
