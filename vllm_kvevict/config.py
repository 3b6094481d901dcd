"""The KV policy configuration: one frozen dataclass, validated once, shared by every process.

It travels from the `vllm serve` flags (or `--additional-config '{"kv_policy": {...}}'`) through
vLLM's `additional_config` into the engine core and the workers. No vLLM import here, so the
reference oracle, the trainer and the tests can use it without a server.

Defaults are the paper's (sink 128, window 1024, observation window 64) scaled to the bundled
model's 8K context: the paper keeps W/n at 1024/131072; at 8K that would leave a 64-token window,
too little for a 135M model to write coherent text, so we keep DuoAttention's recent size (256)
and half the paper's sink (64). Pass sink=128, window=1024 for the paper's values.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any, Mapping

POLICIES = ("full", "streaming", "duo", "prulong", "snapkv", "pyramidkv")
HEAD_MASK_POLICIES = ("duo", "prulong")
TOKEN_EVICTION_POLICIES = ("snapkv", "pyramidkv")
EVICTION_MODES = ("patched", "naive")
# reserve: admit a request only when its whole growth fits next to the running requests' (no
# preemption); vllm: stock admission (the prompt must fit), preempting under pressure, the
# preempted request then replayed exactly (integration/core/admission.py).
ADMISSION_MODES = ("reserve", "vllm")
# the attention path: vLLM's CPU kernel (integration/attention/backend.py) or vLLM's FlexAttention
# backend with block-sparse head masks (vllm_kvevict/flex/)
ATTENTION_BACKENDS = ("cpu", "flex", "triton")
# a head mask under tensor parallel: each layer's KV heads dealt so every rank holds its share of
# the full heads (the weights permuted at load), or vLLM's contiguous order
# (integration/worker/head_order.py)
TP_HEAD_ORDERS = ("balanced", "contiguous")
# patched token eviction with prefix caching: exact (no reuse: each chunk is scored with the
# request's own question) or across-questions (a hit reuses chunks compressed under an earlier
# request's question, declared in kv_stats; integration/kv_cache/prefix_cache.py)
PREFIX_REUSE_MODES = ("exact", "across-questions")

DEFAULT_SINK = 64
DEFAULT_WINDOW = 256
DEFAULT_OBS_WINDOW = 64
DEFAULT_POOL_KERNEL = 5
DEFAULT_SPARSITY = 0.7
DEFAULT_DECODE_INTERVAL = 128


class KVPolicyError(ValueError):
    """A policy setting that cannot be served; the message names the valid values and, first,
    the setting (`field`), which the CLI shows as its flag (`--kv-sparsity must be ...`)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class KVPolicyConfig:
    policy: str = "full"
    # Head sparsity (share of streaming KV heads) for duo/prulong, token sparsity p (share of
    # each prefill chunk's KVs evicted) for snapkv/pyramidkv. Ignored by full and streaming.
    sparsity: float = DEFAULT_SPARSITY
    sink: int = DEFAULT_SINK
    window: int = DEFAULT_WINDOW
    obs_window: int = DEFAULT_OBS_WINDOW
    pool_kernel: int = DEFAULT_POOL_KERNEL
    eviction: str = "patched"
    # Head-mask file for duo/prulong; None means the mask shipped for the served model.
    mask_path: str | None = None
    # snapkv/pyramidkv inside vLLM: the layers are split into this many tiers of consecutive
    # layers, each with its own vLLM KV-cache group (block table), so a tier holds blocks for
    # its own largest per-layer budget only. None: one tier per layer for pyramidkv (whose
    # budget differs per layer), one tier for snapkv (same budget everywhere). Must divide
    # the model's layer count. Memory only: the attention computed is the same for any value.
    tiers: int | None = None
    # Admission of evicting policies, one of ADMISSION_MODES. Ignored by full (stock vLLM).
    admission: str = "reserve"
    # snapkv/pyramidkv: evict once per this many prompt tokens (chunks [0, E), [E, 2E), ...,
    # the last one ending at the prompt's end), however vLLM splits the prefill into steps
    # (--max-num-batched-tokens). None: evict after every prefill chunk vLLM schedules. Smaller
    # steps than E hold less of a chunk at once (closer to the paper's causal count) and give
    # the same outputs: eviction, not scheduling, decides what attention sees.
    eviction_chunk: int | None = None
    # duo/prulong only: also evict tokens of the full heads with this token-eviction policy
    # (one of TOKEN_EVICTION_POLICIES) at token sparsity `token_sparsity` (the paper's future
    # work: head-level and token-level eviction composed). Streaming heads keep sink + window.
    token_policy: str | None = None
    token_sparsity: float = DEFAULT_SPARSITY
    attention_backend: str = "cpu"  # one of ATTENTION_BACKENDS
    # snapkv/pyramidkv: decode-time eviction. Every `decode_interval` generated tokens each
    # layer's whole KV is compressed back to `decode_budget` tokens per KV head (pyramidkv:
    # that budget spread over the layers as its prefill budget is), scored by the last
    # min(obs_window, decode_interval, decode_budget) decode queries. None: decode tokens are
    # never evicted (the paper's chunked eviction covers the prompt only).
    decode_budget: int | None = None
    decode_interval: int = DEFAULT_DECODE_INTERVAL
    tp_head_order: str = "balanced"  # one of TP_HEAD_ORDERS
    prefix_reuse: str = "exact"  # one of PREFIX_REUSE_MODES
    # A head mask on the CPU path: tokens per block of the full heads' KV-cache groups, a
    # multiple of vLLM's --block-size (which the streaming heads keep: their sink in whole
    # blocks). vLLM's CPU kernel reads 128-token blocks faster than 64-token ones in the
    # pool's block-outer layout. None: --block-size.
    full_block_size: int | None = None

    def __post_init__(self) -> None:
        validate(self)

    @property
    def uses_head_mask(self) -> bool:
        return self.policy in HEAD_MASK_POLICIES or self.policy == "streaming"

    @property
    def caches_prefixes(self) -> bool:
        """Prefix caching served exactly: head masks without token eviction, their chunks
        canonical (CPU path: the streaming heads' sink + window state is in cached pool blocks,
        integration/kv_cache/sink_window.py; flex path: every head's KV is in the pool)."""
        return self.uses_head_mask and not self.evicts_tokens

    @property
    def caches_token_prefixes(self) -> bool:
        """Prefix caching served for token eviction when asked for: naive chunks (each scored
        by its own queries, so a chunk boundary's compacted row depends only on the tokens
        before it: exact), or patched ones under the declared reuse mode (`reuses_across_
        questions`); no decode-time eviction (it rewrites the row in place), CPU path
        (integration/kv_cache/prefix_cache.py). A head mask's full heads too, with
        snapkv (pyramidkv's layers keep unequal counts, which the pool's groups of full heads,
        packed by width, would mix)."""
        return (self.token_eviction is not None and self.token_policy != "pyramidkv"
                and (self.eviction == "naive" or self.reuses_across_questions)
                and self.decode_budget is None and self.attention_backend == "cpu")

    @property
    def reuses_across_questions(self) -> bool:
        """Patched eviction whose prefix-cache hits reuse chunks selected under an earlier
        request's question (`--kv-prefix-reuse across-questions`)."""
        return self.patched and self.prefix_reuse == "across-questions"

    @property
    def evicts_tokens(self) -> bool:
        return self.policy in TOKEN_EVICTION_POLICIES or self.token_policy is not None

    @property
    def is_hybrid(self) -> bool:
        """A head mask whose full heads also evict tokens (`token_policy`)."""
        return self.token_policy is not None

    @property
    def token_eviction(self) -> str | None:
        """The token-eviction policy in force (snapkv, pyramidkv), or None."""
        return self.token_policy if self.is_hybrid else (
            self.policy if self.policy in TOKEN_EVICTION_POLICIES else None)

    @property
    def patched(self) -> bool:
        return self.evicts_tokens and self.eviction == "patched"

    @property
    def max_obs_window(self) -> int | None:
        """The largest per-request kv_obs_window served (None: up to max_model_len). The flex
        path sizes its mask tables for a step's patched question rows by the served window."""
        return self.obs_window if self.attention_backend == "flex" and self.patched else None

    def observation_rows(self, n: int) -> int:
        """Observation queries k scoring a chunk of n tokens: the chunk's own last ones (naive
        eviction, and every final chunk)."""
        return min(self.obs_window, n)

    def question_rows(self, prompt_len: int) -> int:
        """Extra query rows a non-final chunk runs for patched eviction: the prompt's last k
        tokens (the question), appended after the chunk; 0 for every other policy."""
        return self.observation_rows(prompt_len) if self.patched else 0

    def canonical_chunk(self, prefix_caching: bool, step_budget: int) -> int:
        """A head mask's canonical prefill chunk E: `eviction_chunk` if given, else the step
        budget when prefix caching is on (cached blocks must not depend on how the scheduler
        split the steps), 0 otherwise (each step is its own chunk); 0 for other policies."""
        if not self.uses_head_mask:
            return 0
        if self.eviction_chunk:
            return int(self.eviction_chunk)
        return int(step_budget) if prefix_caching else 0

    def is_eviction_point(self, end: int, prompt_len: int) -> bool:
        """Does a prefill step ending at token `end` (<= prompt_len) close an eviction chunk?"""
        if not self.evicts_tokens or end > prompt_len:
            return False
        e = self.eviction_chunk
        return e is None or end == prompt_len or end % e == 0

    @property
    def decode_obs_rows(self) -> int:
        """Observation queries k scoring a decode-time compression (the last k decode steps)."""
        return min(self.obs_window, self.decode_interval, self.decode_budget or self.obs_window)

    def is_decode_compression(self, end: int, prompt_len: int) -> bool:
        """Does the decode step that ends at logical length `end` (its token's KV included)
        compress the KV back to the decode budget? Every `decode_interval` generated tokens."""
        if self.decode_budget is None or end <= prompt_len:
            return False
        return (end - prompt_len) % self.decode_interval == 0

    def num_tiers(self, num_layers: int) -> int:
        """KV-cache groups (block tables) the layers are split into (see `tiers`)."""
        if not self.evicts_tokens:
            return 1
        if self.tiers is not None:
            return self.tiers
        # a token policy's layers hold different head counts (the mask's full heads): vLLM
        # would give groups of unequal page sizes unequal block sizes, so they share one group
        return num_layers if self.policy == "pyramidkv" else 1

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> "KVPolicyConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any] | str | None) -> "KVPolicyConfig":
        """Build from a dict (or its JSON text); unknown keys are an error, not ignored."""
        if raw is None:
            return cls()
        if isinstance(raw, str):
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise KVPolicyError(f"kv_policy is not valid JSON: {exc}") from None
        if isinstance(raw, str):
            raw = {"policy": raw}
        if not isinstance(raw, Mapping):
            raise KVPolicyError(f"kv_policy must be a JSON object, got {type(raw).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise KVPolicyError(
                f"unknown kv_policy key(s) {unknown}; valid keys: {sorted(known)}")
        return cls(**dict(raw))


def _check_int(name: str, value: Any, lo: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise KVPolicyError(f"{name} must be an integer >= {lo}, got {value!r}", name)


def validate(cfg: KVPolicyConfig) -> None:
    if cfg.policy not in POLICIES:
        raise KVPolicyError(
            f"policy {cfg.policy!r} is unknown; valid policies: {', '.join(POLICIES)}", "policy")
    s = cfg.sparsity
    if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) \
            or not 0.0 <= s <= 1.0:
        raise KVPolicyError(f"sparsity must be a number in [0, 1], got {s!r}", "sparsity")
    _check_int("sink", cfg.sink, 0)
    _check_int("window", cfg.window, 1)
    _check_int("obs_window", cfg.obs_window, 1)
    _check_int("pool_kernel", cfg.pool_kernel, 1)
    if cfg.pool_kernel % 2 == 0:
        raise KVPolicyError(f"pool_kernel must be odd, got {cfg.pool_kernel}", "pool_kernel")
    if cfg.eviction not in EVICTION_MODES:
        raise KVPolicyError(f"eviction {cfg.eviction!r} is unknown; valid modes: "
                            f"{', '.join(EVICTION_MODES)}", "eviction")
    if cfg.attention_backend not in ATTENTION_BACKENDS:
        raise KVPolicyError(f"attention_backend {cfg.attention_backend!r} is unknown; valid: "
                            f"{', '.join(ATTENTION_BACKENDS)}", "attention_backend")
    if cfg.tp_head_order not in TP_HEAD_ORDERS:
        raise KVPolicyError(f"tp_head_order {cfg.tp_head_order!r} is unknown; valid: "
                            f"{', '.join(TP_HEAD_ORDERS)}", "tp_head_order")
    if cfg.tp_head_order != "balanced" and not cfg.uses_head_mask:
        raise KVPolicyError(f"tp_head_order only applies to a head mask (streaming, "
                            f"{', '.join(HEAD_MASK_POLICIES)}), not {cfg.policy!r}",
                            "tp_head_order")
    if cfg.prefix_reuse not in PREFIX_REUSE_MODES:
        raise KVPolicyError(f"prefix_reuse {cfg.prefix_reuse!r} is unknown; valid: "
                            f"{', '.join(PREFIX_REUSE_MODES)}", "prefix_reuse")
    if cfg.prefix_reuse != "exact" and not (cfg.token_eviction and cfg.eviction == "patched"):
        raise KVPolicyError(f"prefix_reuse {cfg.prefix_reuse} only applies to patched token "
                            f"eviction ({', '.join(TOKEN_EVICTION_POLICIES)} or a token_policy "
                            f"with eviction patched; naive eviction's reuse is exact), not "
                            f"{cfg.policy!r} with eviction {cfg.eviction!r}", "prefix_reuse")
    if cfg.admission not in ADMISSION_MODES:
        raise KVPolicyError(f"admission {cfg.admission!r} is unknown; valid modes: "
                            f"{', '.join(ADMISSION_MODES)}", "admission")
    if cfg.mask_path is not None and not isinstance(cfg.mask_path, str):
        raise KVPolicyError(f"mask_path must be a path string, got {cfg.mask_path!r}",
                            "mask_path")
    if cfg.tiers is not None:
        _check_int("tiers", cfg.tiers, 1)
        if cfg.token_eviction is None:
            raise KVPolicyError(f"tiers only applies to {', '.join(TOKEN_EVICTION_POLICIES)} "
                                f"(or a token_policy), not {cfg.policy!r}", "tiers")
    if cfg.eviction_chunk is not None:
        _check_int("eviction_chunk", cfg.eviction_chunk, 1)
        # head masks: the canonical prefill chunk (integration/sink_window.canonical_chunk);
        # with a token_policy, its full heads' eviction chunk too
        if cfg.policy not in TOKEN_EVICTION_POLICIES and not cfg.uses_head_mask:
            valid = (*TOKEN_EVICTION_POLICIES, "streaming", *HEAD_MASK_POLICIES)
            raise KVPolicyError(f"eviction_chunk only applies to {', '.join(valid)}, not "
                                f"{cfg.policy!r}", "eviction_chunk")
    _check_int("decode_interval", cfg.decode_interval, 1)
    if cfg.decode_budget is not None:
        _check_int("decode_budget", cfg.decode_budget, 1)
        if cfg.token_eviction is None:
            raise KVPolicyError(f"decode_budget only applies to "
                                f"{', '.join(TOKEN_EVICTION_POLICIES)} (or a head mask's "
                                f"token_policy), not {cfg.policy!r}", "decode_budget")
    if cfg.token_policy is not None:
        if cfg.token_policy not in TOKEN_EVICTION_POLICIES:
            raise KVPolicyError(f"token_policy {cfg.token_policy!r} is unknown; valid: "
                                f"{', '.join(TOKEN_EVICTION_POLICIES)}", "token_policy")
        if cfg.tiers not in (None, 1):
            raise KVPolicyError(f"tiers {cfg.tiers} is not supported with token_policy (its "
                                "layers hold different numbers of full heads, and vLLM gives "
                                "KV-cache groups of unequal page sizes unequal block sizes); "
                                "valid: 1", "tiers")
        if cfg.policy not in HEAD_MASK_POLICIES:
            raise KVPolicyError(f"token_policy only applies to {', '.join(HEAD_MASK_POLICIES)} "
                                f"(their full heads evict tokens), not {cfg.policy!r}",
                                "token_policy")
    t = cfg.token_sparsity
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) \
            or not 0.0 <= t <= 1.0:
        raise KVPolicyError(f"token_sparsity must be a number in [0, 1], got {t!r}",
                            "token_sparsity")
    if cfg.full_block_size is not None:
        _check_int("full_block_size", cfg.full_block_size, 1)
        if cfg.policy not in HEAD_MASK_POLICIES or cfg.token_policy is not None \
                or cfg.attention_backend != "cpu":
            raise KVPolicyError(f"full_block_size only applies to a head mask "
                                f"({', '.join(HEAD_MASK_POLICIES)}) without a token_policy on "
                                f"attention_backend cpu, not {cfg.policy!r}"
                                + (f" with token_policy {cfg.token_policy}"
                                   if cfg.token_policy else "")
                                + (f" on {cfg.attention_backend}"
                                   if cfg.attention_backend != "cpu" else ""),
                                "full_block_size")
    if cfg.mask_path is not None and cfg.policy not in HEAD_MASK_POLICIES:
        raise KVPolicyError(
            f"mask_path only applies to {', '.join(HEAD_MASK_POLICIES)}, not {cfg.policy!r}",
            "mask_path")
