"""The reference oracle's runner: a transformers causal decoder (Llama, Llama 3, Mistral, Qwen2,
Qwen3) run layer by layer, chunk by chunk.

Every module of the model is used as is (embedding, RMSNorms, q/k/v/o projections with their
biases (Qwen2), Qwen3's per-head q/k RMSNorm, rotary embedding with the model's rope scaling
(Llama 3), MLP, lm_head) except attention, which is `attention.attend` over the explicit
`KVCache` with the policy's visibility, at the attention module's own `scaling`. Models whose
layers use a sliding window are refused: the policies evict from full causal attention.

The prompt is prefilled in chunks of `chunk_size` (the last one shorter), then tokens are
decoded greedily one by one. After each forward, each layer's cache is updated:
- token eviction (snapkv, pyramidkv), prefill chunks only: the chunk's KVs are scored and a
  layer keeps `policy.chunk_keep(layer, c, is_final)` of them per KV head (`eviction.py`);
  patched scoring appends the prompt's last k = obs_window tokens to every non-final chunk, at
  the positions right after it, runs them through every layer like real tokens, lets their
  queries score and then drops their KVs and hidden states. Decode tokens are evicted only
  with a `decode_budget` (decode-time eviction): after every `decode_interval`-th generated
  token a layer holding more than its decode budget keeps, per KV head, the last k tokens
  and the best-scored others, scored by the queries of the last k decode steps.
- streaming heads (streaming, duo, prulong): cut to the sink + the last `window` positions.
  A head mask with a token policy evicts tokens of its full heads only; patched scoring's
  appended tokens see, on streaming heads, what the chunk's own tokens see (sink, the window
  before the chunk, the chunk) and themselves causally.
The policy object only answers which heads stream and how many tokens a layer keeps; all
attention, scoring and selection is computed here.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from vllm_kvevict.policies.base import KVPolicy
from vllm_kvevict.reference.attention import (EMPTY, KVCache, attend,
                                              chunked_streaming_visibility, streaming_cut,
                                              visibility)
from vllm_kvevict.reference.eviction import observation_scores, select_kept
from vllm_kvevict.reference.quantization import cached_kv

# attention(layer, queries [Hq, T, d], keys [H, T, d], values [H, T, d], scale) -> [Hq, T, d]
AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


@dataclass(frozen=True)
class Step:
    """One forward: prefill chunk [start, start + chunk_len), or one decode token at `start`,
    followed by `num_appended` observation tokens (patched scoring) that leave no trace."""

    start: int
    chunk_len: int
    is_prefill: bool
    is_final: bool  # the chunk ends at the prompt's end (always True for decode)
    num_appended: int = 0


@dataclass
class PrefillResult:
    logits: torch.Tensor  # float32 [n, V] with all_logits, else [1, V] (last prompt token)
    cache: KVCache  # after the last chunk
    chunk_boundaries: list[tuple[int, int]]
    kept_per_layer: list[list[int]]  # [chunk][layer]: chunk tokens kept, summed over KV heads
    kept_per_head: list[torch.Tensor]  # [chunk] -> long [L, H]: chunk tokens kept per KV head


@dataclass
class ReferenceOutput:
    token_ids: list[int]  # greedy generated tokens
    first_token_logprobs: torch.Tensor  # float32 [V]: log-softmax of the last prompt token
    chunk_boundaries: list[tuple[int, int]]  # prefill chunks [start, end)
    kept_per_layer: list[list[int]]  # as in PrefillResult, right after each chunk
    kept_per_head: list[torch.Tensor]
    cache: KVCache  # after generation (prefill survivors + decode tokens, streaming cut)


def chunk_boundaries(prompt_len: int, chunk_size: "int | list[int]") -> list[tuple[int, int]]:
    """[start, end) of each prefill chunk: fixed-size chunks, or the chunk ends a server used
    (e.g. vLLM's reported boundaries [256, 300, 556, ...]; the last must be prompt_len)."""
    if not isinstance(chunk_size, int):
        ends = [int(e) for e in chunk_size]
        if not ends or ends[-1] != prompt_len or any(b <= a for a, b in zip([0] + ends, ends)):
            raise ValueError(f"chunk ends {ends} must increase and end at {prompt_len}")
        return list(zip([0] + ends[:-1], ends))
    if prompt_len < 1 or chunk_size < 1:
        raise ValueError(f"need prompt_len >= 1 and chunk_size >= 1, got {prompt_len}, "
                         f"{chunk_size}")
    return [(a, min(a + chunk_size, prompt_len)) for a in range(0, prompt_len, chunk_size)]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE (rotate-half convention, as transformers' Llama): x [heads, T, d], cos/sin [T, d]."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class ReferenceRunner:
    """Greedy generation of one prompt under a policy, in plain PyTorch.

    `model` is a transformers LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM or
    Qwen3ForCausalLM (any decoder with their module layout); if its dtype is not `dtype` a
    converted copy is used (the caller's model is left alone). Attention logits, softmax and
    eviction scores are float32 whatever `dtype` is. `kv_cache_dtype` ("auto" or an fp8 format,
    `quantization.py`) is what the cache holds.
    """

    def __init__(self, model: torch.nn.Module, policy: KVPolicy,
                 dtype: torch.dtype = torch.float32, kv_cache_dtype: str = "auto",
                 kv_scales: tuple[float, float] = (1.0, 1.0)) -> None:
        if next(model.parameters()).dtype != dtype:
            model = copy.deepcopy(model).to(dtype)
        self.model = model.eval()
        self.dtype = dtype
        self.device = next(model.parameters()).device
        cfg = model.config
        if "sliding_attention" in (getattr(cfg, "layer_types", None) or ()) or (
                getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True)):
            raise ValueError("the reference computes full causal attention; this model's "
                             "layers use a sliding window (set sliding_window to None)")
        self.num_layers = cfg.num_hidden_layers
        self.num_q_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_q_heads
        if (policy.num_layers, policy.num_kv_heads) != (self.num_layers, self.num_kv_heads):
            raise ValueError(f"policy is for {policy.num_layers} layers x {policy.num_kv_heads} "
                             f"KV heads, the model has {self.num_layers} x {self.num_kv_heads}")
        self.policy = policy
        self.config = policy.config
        cached_kv(torch.zeros(1), kv_cache_dtype)  # validates the name
        self.kv_cache_dtype, self.kv_scales = kv_cache_dtype, kv_scales
        self.streaming = policy.streaming_heads().to(torch.bool).to(self.device)  # [L, H]

    # -- the model, layer by layer --------------------------------------------------------
    def run_layers(self, token_ids: list[int], positions: torch.Tensor,
                   attention: AttentionFn) -> torch.Tensor:
        """Final-normed hidden states [T, D] of `token_ids` at `positions`; every layer's
        attention is `attention` (given post-RoPE queries and keys). Differentiable.
        `rotary_emb` returns cos/sin with the rope scaling and its attention factor applied."""
        inner = self.model.model
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        h = inner.embed_tokens(ids)
        cos, sin = inner.rotary_emb(h.unsqueeze(0), positions.unsqueeze(0))
        cos, sin = cos[0], sin[0]
        num_tokens = len(token_ids)
        for index, layer in enumerate(inner.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.q_proj(x).view(num_tokens, -1, self.head_dim).transpose(0, 1)
            k = attn.k_proj(x).view(num_tokens, -1, self.head_dim).transpose(0, 1)
            v = attn.v_proj(x).view(num_tokens, -1, self.head_dim).transpose(0, 1)
            if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over each head's d, before RoPE
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            out = attention(index, q, k, v, attn.scaling)
            h = h + attn.o_proj(out.transpose(0, 1).reshape(num_tokens, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return inner.norm(h)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(hidden).float()

    # -- one forward over the cache ---------------------------------------------------------
    def forward(self, cache: KVCache, token_ids: list[int],
                step: Step) -> tuple[torch.Tensor, torch.Tensor]:
        """Run a chunk (plus appended tokens) or a decode token against `cache` and update the
        cache. Returns the chunk tokens' hidden states [chunk_len, D] and, per (layer, KV
        head), how many of the chunk's tokens the cache keeps, long [L, H]."""
        assert len(token_ids) == step.chunk_len + step.num_appended
        positions = torch.arange(step.start, step.start + len(token_ids), device=self.device)
        kept = torch.zeros(self.num_layers, self.num_kv_heads, dtype=torch.long)

        def attention(index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      scale: float) -> torch.Tensor:
            layer_kv = cache.layers[index]
            past = layer_kv.positions.shape[1]
            # what the KV cache holds (fp8: quantized); scoring below reads the forward's k
            keys, values, key_pos = layer_kv.with_new(
                cached_kv(k, self.kv_cache_dtype, self.kv_scales[0]),
                cached_kv(v, self.kv_cache_dtype, self.kv_scales[1]), positions)
            seen = visibility(positions, key_pos, step.start, self.streaming[index],
                              self.config.sink, self.config.window)
            out = attend(q, keys, values, seen, scale)

            # The cache keeps the past and the chunk; appended observation tokens are dropped.
            stored = past + step.chunk_len
            keep = torch.ones(self.num_kv_heads, stored, dtype=torch.bool, device=self.device)
            if step.is_prefill and self.policy.evicts_tokens:
                # streaming heads (a head mask with a token policy) evict by the cut below only
                keep[:, past:] = self.chunk_tokens_kept(index, q, k, step) | \
                    self.streaming[index].view(-1, 1)
            key_pos = key_pos[:, :stored]
            keep &= streaming_cut(key_pos, step.start + step.chunk_len, self.streaming[index],
                                  self.config.sink, self.config.window)
            layer_kv.store(keys[:, :stored], values[:, :stored], key_pos, keep)
            if not step.is_prefill and self.config.decode_budget is not None \
                    and self.policy.evicts_tokens:
                self.decode_eviction(cache, index, q, step.start + 1 - cache.prompt_len)
            in_chunk = (layer_kv.positions >= step.start) & \
                (layer_kv.positions < step.start + step.chunk_len)
            kept[index] = in_chunk.sum(dim=1).cpu()
            return out

        hidden = self.run_layers(token_ids, positions, attention)
        return hidden[: step.chunk_len], kept

    def chunk_tokens_kept(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                          step: Step) -> torch.Tensor:
        """Bool [H, c]: which of the chunk's KVs this layer keeps (token eviction).

        q: the forward's queries [Hq, c + appended, d]; k: its keys [H, c + appended, d].
        """
        c = step.chunk_len
        budget = self.policy.chunk_keep(layer, c, step.is_final)
        if self.config.patched and not step.is_final:
            assert step.num_appended > 0
            obs_queries, obs_offset = q[:, c:], c  # the prompt's last k, placed after the chunk
        else:
            num_obs = min(self.config.obs_window, c)
            obs_queries, obs_offset = q[:, c - num_obs: c], c - num_obs
        scores = observation_scores(obs_queries, k[:, :c], obs_offset,
                                    num_candidates=c - budget.window,
                                    pool_kernel=self.config.pool_kernel)
        chosen = select_kept(scores, budget.selected, c, budget.window)
        keep = torch.zeros(self.num_kv_heads, c, dtype=torch.bool, device=self.device)
        return keep.scatter(1, chosen.to(self.device), True)

    def decode_eviction(self, cache: KVCache, layer: int, q: torch.Tensor,
                        generated: int) -> None:
        """After a decode step (`generated` tokens after the prompt now cached): remember its
        query; every `decode_interval` tokens cut the layer back to its decode budget."""
        k = self.config.decode_obs_rows
        while len(cache.decode_queries) < self.num_layers:
            cache.decode_queries.append([])
        recent = cache.decode_queries[layer]
        recent.append(q)
        del recent[:-k]
        if generated % self.config.decode_interval:
            return
        layer_kv = cache.layers[layer]
        full = ~self.streaming[layer]  # a head mask's streaming heads keep sink + window
        if not bool(full.any()):
            return
        lengths = (layer_kv.positions[full] != EMPTY).sum(dim=1)
        assert bool((lengths == lengths[0]).all()), "token eviction keeps equal full heads"
        length = int(lengths[0])
        budget = self.policy.decode_keep(layer, length)
        if budget is None:
            return
        group = self.num_q_heads // self.num_kv_heads
        obs_queries = torch.cat(recent, dim=1)  # [Hq, k, d], the last k tokens' queries
        obs_queries = obs_queries[full.repeat_interleave(group)]  # the full heads' groups
        scores = observation_scores(obs_queries, layer_kv.keys[full, :length], length - k,
                                    num_candidates=length - budget.window,
                                    pool_kernel=self.config.pool_kernel)
        chosen = select_kept(scores, budget.selected, length, budget.window)
        keep = torch.ones_like(layer_kv.positions, dtype=torch.bool)
        keep[full] = False
        keep[full.nonzero().squeeze(1).unsqueeze(1), chosen.to(self.device)] = True
        layer_kv.store(layer_kv.keys, layer_kv.values, layer_kv.positions, keep)

    # -- prefill, decode, generate ----------------------------------------------------------
    def new_cache(self) -> KVCache:
        return KVCache.empty(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype,
                             self.device)

    @torch.no_grad()
    def prefill(self, prompt_ids: list[int], chunk_size: int, all_logits: bool = False,
                chunk_questions: dict[int, list[int]] | None = None) -> PrefillResult:
        """`chunk_questions` (patched eviction): chunk end -> the question appended to that
        chunk instead of the prompt's own, e.g. the earlier request's whose chunks a
        prefix-cache hit reuses (`--kv-prefix-reuse across-questions`)."""
        prompt_ids = list(prompt_ids)
        n = len(prompt_ids)
        boundaries = chunk_boundaries(n, chunk_size)
        appended = prompt_ids[-min(self.config.obs_window, n):] if self.config.patched else []
        cache = self.new_cache()
        cache.prompt_len = n
        logits, kept = [], []
        for start, end in boundaries:
            is_final = end == n
            extra = [] if is_final else list((chunk_questions or {}).get(end, appended))
            step = Step(start, end - start, is_prefill=True, is_final=is_final,
                        num_appended=len(extra))
            hidden, kept_now = self.forward(cache, prompt_ids[start:end] + extra, step)
            kept.append(kept_now)
            if all_logits:
                logits.append(self.logits(hidden))
            elif is_final:
                logits.append(self.logits(hidden[-1:]))
        return PrefillResult(torch.cat(logits), cache, boundaries,
                             [k.sum(dim=1).tolist() for k in kept], kept)

    @torch.no_grad()
    def decode_step(self, cache: KVCache, token_id: int, position: int) -> torch.Tensor:
        """Logits float32 [V] of one token at `position`; its KVs join the cache."""
        step = Step(position, 1, is_prefill=False, is_final=True)
        hidden, _ = self.forward(cache, [token_id], step)
        return self.logits(hidden)[0]

    @torch.no_grad()
    def generate(self, prompt_ids: list[int], max_new_tokens: int, chunk_size: int,
                 stop_token_ids: Iterable[int] = (),
                 chunk_questions: dict[int, list[int]] | None = None) -> ReferenceOutput:
        """Greedy (argmax, first index on ties) decoding; stops after a stop token.
        `chunk_questions`: as in `prefill`."""
        prompt_ids = list(prompt_ids)
        stop = set(stop_token_ids)
        pre = self.prefill(prompt_ids, chunk_size, chunk_questions=chunk_questions)
        logits = pre.logits[-1]
        tokens: list[int] = []
        position = len(prompt_ids)
        for _ in range(max_new_tokens):
            token = int(torch.argmax(logits))
            tokens.append(token)
            if token in stop or len(tokens) == max_new_tokens:
                break
            logits = self.decode_step(pre.cache, token, position)
            position += 1
        return ReferenceOutput(tokens, torch.log_softmax(pre.logits[-1], dim=-1),
                               pre.chunk_boundaries, pre.kept_per_layer, pre.kept_per_head,
                               pre.cache)

    @torch.no_grad()
    def teacher_forced_logprobs(self, prompt_ids: list[int], forced_ids: list[int],
                                chunk_size: "int | list[int]") -> list[float]:
        """log p(forced_ids[i] | prompt, forced_ids[:i]): the prompt's chunked prefill, then
        the forced tokens as decode steps (what a server computes for a prompt whose last
        len(forced_ids) tokens are teacher-forced, `kv_teacher_forced`)."""
        pre = self.prefill(list(prompt_ids), chunk_size)
        logits, position, out = pre.logits[-1], len(prompt_ids), []
        for i, token in enumerate(forced_ids):
            out.append(float(torch.log_softmax(logits.float(), dim=-1)[token]))
            if i + 1 < len(forced_ids):
                logits = self.decode_step(pre.cache, token, position)
                position += 1
        return out

    # -- one-pass form of chunked streaming (what the mask trainer computes) ----------------
    @torch.no_grad()
    def one_pass_logits(self, prompt_ids: list[int], chunk_size: int) -> torch.Tensor:
        """Logits float32 [n, V] of the prompt in one forward with per-head masks: full heads
        causal, streaming heads `chunked_streaming_visibility`. Equals chunked `prefill` for
        head-mask policies; token eviction has no one-pass form."""
        if self.policy.evicts_tokens:
            raise ValueError("token eviction depends on the chunk loop; use prefill()")
        n = len(prompt_ids)
        positions = torch.arange(n, device=self.device)
        causal = torch.ones(n, n, dtype=torch.bool, device=self.device).tril()
        chunked = chunked_streaming_visibility(n, chunk_size, self.config.sink,
                                               self.config.window).to(self.device)

        def attention(index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      scale: float) -> torch.Tensor:
            seen = torch.where(self.streaming[index].view(-1, 1, 1), chunked, causal)
            return attend(q, cached_kv(k, self.kv_cache_dtype, self.kv_scales[0]),
                          cached_kv(v, self.kv_cache_dtype, self.kv_scales[1]), seen, scale)

        return self.logits(self.run_layers(list(prompt_ids), positions, attention))
