"""Token eviction of the reference oracle: SnapKV-style scoring and top-k selection of a chunk.

Chunked eviction (PruLong paper, section 3): after a prefill chunk of c tokens, each of the
chunk's KVs gets a score from k observation queries, and a layer keeps, per KV head, the
`window` trailing tokens of the chunk plus the `selected` best-scored of the other c - window.

    logits[h, i, j] = q[h, i] . key[h // group, j] / sqrt(d),  -inf where j > obs_offset + i
    attn            = softmax_j(logits)            (over the chunk's keys only, float32)
    score[g, j]     = mean_{h in group g} sum_i attn[h, i, j],   j < c - window
    pooled          = avg_pool1d(score, kernel, stride 1, zero padding kernel // 2)

The observation queries are the chunk's own last k (naive, and every final chunk;
obs_offset = c - k) or the prompt's last k tokens run after the chunk (patched; obs_offset = c).
Nothing here is shared with the vLLM path.
"""

from __future__ import annotations

import math

import torch


def observation_scores(obs_queries: torch.Tensor, chunk_keys: torch.Tensor, obs_offset: int,
                       num_candidates: int, pool_kernel: int) -> torch.Tensor:
    """Pooled scores of the chunk's first `num_candidates` tokens, float32 [H_kv, candidates].

    obs_queries: [H_q, k, d] (RoPE applied); chunk_keys: [H_kv, c, d] (RoPE applied);
    obs_offset: chunk-local position of the first observation query.
    """
    num_q_heads, num_obs, head_dim = obs_queries.shape
    num_kv_heads, chunk_len, _ = chunk_keys.shape
    group = num_q_heads // num_kv_heads
    q = obs_queries.float().reshape(num_kv_heads, group, num_obs, head_dim)
    k = chunk_keys.float()

    logits = torch.einsum("hgid,hjd->hgij", q, k) / math.sqrt(head_dim)
    query_pos = obs_offset + torch.arange(num_obs, device=k.device).view(-1, 1)
    key_pos = torch.arange(chunk_len, device=k.device).view(1, -1)
    logits = logits.masked_fill(key_pos > query_pos, float("-inf"))
    attn = torch.softmax(logits, dim=-1)  # [H_kv, group, k, c]

    received = attn.sum(dim=2)  # summed over the observation queries: [H_kv, group, c]
    per_kv_head = received.mean(dim=1)  # one token set per GQA group (the paper's "C")
    return average_pool(per_kv_head[:, :num_candidates], pool_kernel)


def average_pool(scores: torch.Tensor, kernel: int) -> torch.Tensor:
    """1-D mean over `kernel` neighbours, stride 1, zeros padded kernel // 2 on each side and
    counted in the mean (torch's avg_pool1d with count_include_pad=True); [H, m] -> [H, m]."""
    if scores.shape[-1] == 0:
        return scores
    half = kernel // 2
    padded = torch.nn.functional.pad(scores, (half, half))
    return padded.unfold(-1, kernel, 1).sum(dim=-1) / kernel


def select_kept(scores: torch.Tensor, selected: int, chunk_len: int, window: int) -> torch.Tensor:
    """Chunk-local indices kept per KV head, long [H_kv, selected + window], ascending.

    The `selected` highest scores among the candidates (a stable descending sort, so ties go
    to the earlier token), then the `window` trailing tokens of the chunk.
    """
    num_kv_heads, num_candidates = scores.shape
    assert num_candidates == chunk_len - window and 0 <= selected <= num_candidates
    best_first = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    chosen = torch.sort(best_first[:, :selected], dim=-1).values
    trailing = torch.arange(chunk_len - window, chunk_len,
                            device=scores.device).expand(num_kv_heads, window)
    return torch.cat([chosen, trailing], dim=-1)
