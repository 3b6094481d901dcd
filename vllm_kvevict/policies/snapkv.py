"""`snapkv` (Li et al. 2024), as chunked eviction (PruLong paper, section 3).

After every prefill chunk, the chunk's new KVs are scored by the attention they receive from an
observation window of k queries; a layer keeps the best ones and the compressed past stays.
- naive: the observation queries are the chunk's own last k tokens;
- patched: the prompt's last k tokens are appended to every non-final chunk (positions right
  after the chunk); their queries score, their KVs are thrown away. The final chunk is scored
  by its own last k tokens, which is where the prompt's last k tokens are anyway.
Score = softmax over the chunk's keys (causal), summed over observation queries, averaged over
the query heads of a GQA group (one token set per KV head), smoothed by a 1-D average pool.
Budget per chunk of length c at token sparsity p: B = round((1 - p) c) tokens per KV head,
the observation window (when it lies inside the chunk) included; SnapKV spends it evenly
across layers. One chunk holding the whole prompt is classic post-fill SnapKV.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vllm_kvevict.policies.base import ChunkKeep, KVPolicy


def chunk_capacity(chunk_len: int, sparsity: float) -> int:
    """Tokens per KV head a chunk may keep: round-half-up of (1 - p) * c."""
    return int(math.floor((1.0 - sparsity) * chunk_len + 0.5))


@dataclass
class SnapKVPolicy(KVPolicy):
    def __post_init__(self) -> None:
        self.name = "snapkv"

    @property
    def evicts_tokens(self) -> bool:
        return True

    def window_in_chunk(self, chunk_len: int, is_final: bool) -> int:
        """Observation-window tokens inside the chunk (always kept)."""
        if self.config.patched and not is_final:
            return 0
        return min(self.config.obs_window, chunk_len)

    def layer_selection(self, layer: int, candidates: int, budget: int) -> int:
        return budget

    def chunk_keep(self, layer: int, chunk_len: int, is_final: bool) -> ChunkKeep:
        window = self.window_in_chunk(chunk_len, is_final)
        candidates = chunk_len - window
        budget = max(chunk_capacity(chunk_len, self.config.sparsity) - window, 0)
        selected = min(self.layer_selection(layer, candidates, budget), candidates)
        return ChunkKeep(chunk_len=chunk_len, window=window, selected=max(selected, 0))

    # -- decode-time eviction (`decode_budget`) ---------------------------------------------
    def decode_budget(self, layer: int) -> int:
        """Tokens per KV head layer `layer` is compressed back to during decode: the served
        budget B, its last k decode tokens (the observation window) included."""
        k = self.config.decode_obs_rows
        return k + self.layer_selection(layer, 1 << 40, self.config.decode_budget - k)

    def decode_keep(self, layer: int, length: int) -> ChunkKeep | None:
        """What a layer holding `length` tokens keeps at a decode-time compression: its last k
        tokens (the observation window) and the best-scored of the others up to the layer's
        decode budget; None when it holds no more than that budget."""
        budget = self.decode_budget(layer)
        if length <= budget:
            return None
        k = self.config.decode_obs_rows
        return ChunkKeep(chunk_len=length, window=k, selected=budget - k)

    def score(self, obs_queries: torch.Tensor, chunk_keys: torch.Tensor,
              obs_offset: int, window: int) -> torch.Tensor:
        """Scores of the chunk's candidate tokens, [num_kv_heads, chunk_len - window], float32.

        obs_queries: [num_q_heads, k, d] (RoPE applied); chunk_keys: [num_kv_heads, c, d].
        obs_offset: chunk-local position of the first observation query (c - k for naive,
        c for patched, whose queries come after the chunk); a query at position i sees keys <= i.
        """
        q = obs_queries.float()
        k = chunk_keys.float()
        num_q_heads, num_obs, head_dim = q.shape
        num_kv_heads, chunk_len, _ = k.shape
        if chunk_len == window:  # a chunk no longer than the window: nothing to choose from
            return k.new_zeros(num_kv_heads, 0)
        group = num_q_heads // num_kv_heads
        k = k.repeat_interleave(group, dim=0)
        logits = torch.einsum("hqd,hkd->hqk", q, k) / math.sqrt(head_dim)
        q_pos = obs_offset + torch.arange(num_obs, device=k.device).unsqueeze(1)
        k_pos = torch.arange(chunk_len, device=k.device).unsqueeze(0)
        logits = logits.masked_fill(k_pos > q_pos, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        per_head = probs.sum(dim=1)[:, : chunk_len - window]
        per_kv_head = per_head.view(num_kv_heads, group, -1).mean(dim=1)
        kernel = self.config.pool_kernel
        return F.avg_pool1d(per_kv_head.unsqueeze(1), kernel_size=kernel, stride=1,
                            padding=kernel // 2).squeeze(1)

    @staticmethod
    def select(scores: torch.Tensor, selected: int, chunk_len: int, window: int) -> torch.Tensor:
        """Kept chunk-local indices per KV head, [num_kv_heads, selected + window], ascending.

        Ties go to the earlier token (stable sort), so two implementations agree exactly.
        """
        order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
        top = torch.sort(order[:, :selected], dim=-1).values
        tail = torch.arange(chunk_len - window, chunk_len, device=scores.device).expand(
            scores.shape[0], window)
        return torch.cat([top, tail], dim=-1)
