"""Prefix caching for token eviction (snapkv, pyramidkv; naive eviction exact, patched under
`--kv-prefix-reuse across-questions`): a hit at a canonical chunk boundary b = kE reuses the
compacted blocks the first request left there. Exact because each chunk's kept count depends
only on its length and its kept KVs are appended after the kept past, so the row at b depends
only on the prompt's first b tokens. The ledger keys each group's blocks at b with vLLM's
chained hash of those tokens (`boundary_key`); `TokenPrefixManager` finds the longest boundary
all of whose keys are cached, and the request's ledgers start from it. A head mask with a token
policy keys its streaming heads' sink and window blocks at the same boundaries
(`TokenPrefixSinkSpec`). Refusals: `features.token_prefix_error`; a request with overrides
neither reads nor writes. Design: docs/design/kv_cache.md ("Prefix caching for naive token
eviction").
"""

from __future__ import annotations

import dataclasses
import hashlib

from vllm.model_executor.models.utils import extract_layer_index
from vllm.utils.math_utils import cdiv
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import FullAttentionSpec

from vllm_kvevict.integration.kv_cache.sink_window import (SinkWindowManager, SinkWindowSpec,
                                                           register_specs)
from vllm_kvevict.integration.kv_cache.specs import TierAttentionSpec, retyped, tier_of_layer
from vllm_kvevict.ledger import LayerGroups, group_evictions


@dataclasses.dataclass(frozen=True, kw_only=True)
class TokenPrefixSpec(TierAttentionSpec):
    """A token-eviction group's spec with prefix caching: the canonical chunk E and the slots
    the group's row keeps per non-final chunk (its largest layer's kept count)."""

    prefix_chunk: int = 0
    chunk_kept: int = 0

    def physical(self, boundary: int) -> int:
        """The group's row length at a chunk boundary (k chunks kept)."""
        return boundary // self.prefix_chunk * self.chunk_kept

    def boundary_blocks(self, boundary: int) -> range:
        """The positions of the row's blocks a hit at `boundary` reads: all of them."""
        return range(cdiv(self.physical(boundary), self.block_size))

    @classmethod
    def merge(cls, specs):
        merged = super().merge(specs)
        fields = {(s.prefix_chunk, s.chunk_kept) for s in specs}
        assert len(fields) == 1, "layers of different eviction tiers belong to different groups"
        chunk, kept = fields.pop()
        return dataclasses.replace(merged, prefix_chunk=chunk, chunk_kept=kept)

    def is_uniform_with_collection(self, kv_cache_specs) -> bool:
        return super().is_uniform_with_collection(kv_cache_specs) and all(
            isinstance(s, TokenPrefixSpec) and s.chunk_kept == self.chunk_kept
            for s in kv_cache_specs.values())


@dataclasses.dataclass(frozen=True, kw_only=True)
class TokenPrefixSinkSpec(SinkWindowSpec):
    """The streaming heads' spec of a head mask with a token policy, with prefix caching: its
    rows are keyed at the same chunk boundaries as the full heads' (`prefix_chunk` = E = the
    canonical chunk), registered together, so a hit reads every group from one request."""

    prefix_chunk: int = 0

    def boundary_blocks(self, boundary: int) -> list[int]:
        """The positions of the blocks a hit at `boundary` reads: the sink's and the W tokens'
        before it (the rest of the row is the gap vLLM's null block stands in for)."""
        bs, window = self.block_size, self.sliding_window - 1
        end = boundary // bs
        return sorted(set(range(min(cdiv(self.sink, bs), end)))
                      | set(range(max(boundary - window, 0) // bs, end)))


def prefix_specs(specs: dict, state, vllm_config) -> dict:
    """Token eviction's specs (its planners', `worker/state.py`) with vLLM's prefix caching on
    (`served.settle_config` leaves it on only where this is exact): the specs (plain or tiered;
    a head mask's full heads) as `TokenPrefixSpec`s, with the chunk E and each tier's kept
    slots per non-final chunk; a head mask's streaming companions as `TokenPrefixSinkSpec`s.
    Prefix caching off: `specs` unchanged."""
    if not vllm_config.cache_config.enable_prefix_caching:
        return specs
    policy, num_layers = state.served.policy, state.served.shape.num_layers
    tiers = state.config.num_tiers(num_layers)
    chunk = policy.config.eviction_chunk
    freed = group_evictions(policy, chunk, False, LayerGroups.tiers(num_layers, tiers))
    out = {}
    for name, spec in specs.items():
        if isinstance(spec, SinkWindowSpec):
            out[name] = retyped(spec, TokenPrefixSinkSpec, prefix_chunk=chunk)
            continue
        tier = tier_of_layer(extract_layer_index(name), num_layers, tiers)
        out[name] = retyped(spec, TokenPrefixSpec, tier=tier,
                            max_tokens=getattr(spec, "max_tokens", ()), prefix_chunk=chunk,
                            chunk_kept=chunk - freed[tier])
    return out


def boundary_key(anchor: bytes, index: int) -> bytes:
    """The key of block `index` of a row at the boundary whose vLLM block hash is `anchor`
    (that hash chains over every token before the boundary, cache salt and LoRA included)."""
    return hashlib.sha256(b"vllm-kvevict/token-prefix" + bytes(anchor)
                          + index.to_bytes(4, "big")).digest()


def boundary_anchor(request, boundary: int, hash_block_size: int) -> bytes | None:
    """vLLM's block hash of the request's first `boundary` tokens (None: not a whole number of
    hashed blocks)."""
    if boundary % hash_block_size or boundary // hash_block_size > len(request.block_hashes):
        return None
    return bytes(request.block_hashes[boundary // hash_block_size - 1])


def keyed_blocks(block_pool, anchor: bytes, positions, groups) -> dict[int, list] | None:
    """Per block position keyed at the boundary whose vLLM block hash is `anchor`: the cached
    block of each group in `groups` (None: one is not; the keys after it are not hashed)."""
    found = {}
    for j in positions:
        found[j] = block_pool.get_cached_block(boundary_key(anchor, j), groups)
        if not found[j]:
            return None
    return found


def _boundary_keys(manager, request, boundary: int) -> list[tuple[int, bytes]] | None:
    """(block position, key) of each block a hit at `boundary` reads in this group (None: the
    boundary is not a whole number of hashed blocks)."""
    anchor = boundary_anchor(request, boundary, manager.block_pool.hash_block_size)
    if anchor is None:
        return None
    return [(j, boundary_key(anchor, j)) for j in manager.kv_cache_spec.boundary_blocks(boundary)]


def boundary_cached(manager, request, boundary: int) -> bool:
    """Does this group hold a block keyed at the request's `boundary` already?"""
    group = [manager.kv_cache_group_id]
    return any(manager.block_pool.get_cached_block(key, group)
               for _, key in _boundary_keys(manager, request, boundary) or ())


def register_boundary(manager, request, boundary: int) -> int:
    """After the chunk ending at `boundary` was compressed and its tail blocks freed: key each
    block of the request's row in this group that a hit reads (returns how many)."""
    keys = _boundary_keys(manager, request, boundary)
    row = manager.req_to_blocks.get(request.request_id, [])
    if not keys or keys[-1][0] >= len(row) or any(row[j].is_null for j, _ in keys):
        return 0
    for j, key in keys:
        # (vLLM's pool keeps several keys per block and drops them together on eviction)
        manager.block_pool._insert_block_hash(
            make_block_hash_with_group_id(key, manager.kv_cache_group_id), row[j],
            num_tokens=None)
    return len(keys)


class TokenPrefixManager(FullAttentionManager):
    """vLLM's full-attention manager for a token-eviction group whose spec is a
    `TokenPrefixSpec`: hits at chunk boundaries, counted in physical slots. Without prefix
    caching it is vLLM's manager unchanged."""

    supports_fine_grained_hash_lookup = False
    # the scheduler's token ledger (`kv_cache_manager.bind`): a first allocation starts the
    # request's count from its hit
    ledger = None

    @property
    def _reuses(self) -> bool:
        return self.enable_caching and getattr(self.kv_cache_spec, "prefix_chunk", 0) > 0

    @classmethod
    def find_longest_cache_hit(cls, block_hashes, max_length, kv_cache_group_ids, block_pool,
                               kv_cache_spec, drop_eagle_block, alignment_tokens,
                               dcp_world_size=1, pcp_world_size=1):
        """The last chunk boundary b <= max_length whose row is cached in every group of
        `kv_cache_group_ids`: its blocks (ceil(physical / block size) of them) and b."""
        rows, hit = tuple([] for _ in kv_cache_group_ids), 0
        chunk, size = kv_cache_spec.prefix_chunk, block_pool.hash_block_size
        if not chunk:
            return rows, 0
        found: dict[int, list] = {}  # per block position: the cached block of each group
        for boundary in range(chunk, max_length + 1, chunk):
            if boundary // size > len(block_hashes):
                break
            blocks = keyed_blocks(block_pool, block_hashes[boundary // size - 1],
                                  kv_cache_spec.boundary_blocks(boundary), kv_cache_group_ids)
            if blocks is None:  # (a block evicted is gone for every later boundary too)
                break
            found, hit = blocks, boundary
        if hit:
            rows = tuple([found[j][i] for j in sorted(found)]
                         for i in range(len(kv_cache_group_ids)))
        return rows, hit

    def _physical_hit(self, hit: int, blocks) -> tuple[int, list]:
        """A hit at logical boundary `hit` in physical slots, and its blocks (vLLM trims
        full-attention groups to the logical hit length: a shorter hit in another group leaves
        more blocks than the row at that boundary holds)."""
        if not self._reuses or not hit:
            return hit, blocks
        physical = self.kv_cache_spec.physical(hit)
        return physical, list(blocks)[:cdiv(physical, self.block_size)]

    def get_num_blocks_to_allocate(self, request_id, num_tokens, new_computed_blocks,
                                   total_computed_tokens, num_local_computed_tokens,
                                   num_tokens_main_model, apply_admission_cap=False,
                                   prefill_end=0) -> int:
        if self._reuses and request_id not in self.num_cached_block \
                and not self.req_to_blocks.get(request_id):
            # a first allocation (vLLM marks a request cached only when it hit: a cold one is
            # known by its empty row): the ledger starts from the hit (or from 0), and every
            # count below is physical
            self.ledger.on_prefix_hit(request_id, num_local_computed_tokens)
            num_local_computed_tokens, new_computed_blocks = self._physical_hit(
                num_local_computed_tokens, new_computed_blocks)
            total_computed_tokens = num_local_computed_tokens
        return super().get_num_blocks_to_allocate(
            request_id, num_tokens, new_computed_blocks, total_computed_tokens,
            num_local_computed_tokens, num_tokens_main_model, apply_admission_cap, prefill_end)

    def add_local_computed_blocks(self, request_id, new_computed_blocks,
                                  num_local_computed_tokens, num_external_computed_tokens):
        # (a partial tail block: vLLM's copy-on-write for partial hits, at the physical tail)
        num_local_computed_tokens, new_computed_blocks = self._physical_hit(
            num_local_computed_tokens, new_computed_blocks)
        super().add_local_computed_blocks(request_id, new_computed_blocks,
                                          num_local_computed_tokens, num_external_computed_tokens)

    def cache_blocks(self, request, num_tokens, *args, **kwargs) -> None:
        if not self._reuses:  # (vLLM's logical hashes would name the wrong tokens here)
            super().cache_blocks(request, num_tokens, *args, **kwargs)


class TokenPrefixSinkManager(SinkWindowManager):
    """The streaming heads' manager of a head mask with a token policy whose spec is a
    `TokenPrefixSinkSpec`: hits at the chunk boundaries only, read from blocks keyed there
    (vLLM's logical hashes are never registered: the streaming heads' K/V depend on what the
    full heads kept, which patched eviction selected under a question)."""

    supports_fine_grained_hash_lookup = False
    _reuses = TokenPrefixManager._reuses

    @classmethod
    def find_longest_cache_hit(cls, block_hashes, max_length, kv_cache_group_ids, block_pool,
                               kv_cache_spec, drop_eagle_block, alignment_tokens,
                               dcp_world_size=1, pcp_world_size=1):
        """The last chunk boundary b <= max_length whose sink and window blocks are keyed in
        every group of `kv_cache_group_ids`: rows of b / block size entries, the gap null."""
        chunk, size = kv_cache_spec.prefix_chunk, block_pool.hash_block_size
        bs, null = kv_cache_spec.block_size, block_pool.null_block
        for boundary in range(max_length // chunk * chunk if chunk else 0, 0, -chunk):
            if boundary // size > len(block_hashes):
                continue
            found = keyed_blocks(block_pool, block_hashes[boundary // size - 1],
                                 kv_cache_spec.boundary_blocks(boundary), kv_cache_group_ids)
            if found is not None:
                rows = tuple([null] * (boundary // bs) for _ in kv_cache_group_ids)
                for j, blocks in found.items():
                    for row, block in zip(rows, blocks):
                        row[j] = block
                return rows, boundary
        return tuple([] for _ in kv_cache_group_ids), 0

    def cache_blocks(self, request, num_tokens, *args, **kwargs) -> None:
        if not self._reuses:
            super().cache_blocks(request, num_tokens, *args, **kwargs)


def register_manager() -> None:
    """Our specs -> our managers in vLLM's KV-cache spec registry (idempotent)."""
    register_specs((TokenPrefixSpec, TokenPrefixManager, FullAttentionSpec),
                   (TokenPrefixSinkSpec, TokenPrefixSinkManager, SinkWindowSpec))
