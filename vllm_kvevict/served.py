"""The policy this server serves, built once per process and handed down.

`served_policy(vllm_config)` turns the `kv_policy` entry of vLLM's `additional_config` into a
`ServedPolicy`: the validated config, the model's shape, the resolved head mask (and the file
it came from), the policy object, and the per-request variants (`vllm_xargs` overrides, one
bounded cache). Every consumer in a process (start-up validation in the API server; scheduler
side, stats connector, worker side and attention backend in the engine core) gets the same
object, so the mask file is read once per process. `settle_config`, run once where the engine
config is created, pins the resolved mask path into `additional_config` (every later process
serves the same file) and turns prefix caching off where the policy cannot serve it; the getter
itself never changes the config.

No vLLM import: a VllmConfig is read through its plain attributes.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_kvevict.config import HEAD_MASK_POLICIES, KVPolicyConfig
from vllm_kvevict.overrides import OVERRIDE_KEYS, effective_config
from vllm_kvevict.policies import KVPolicy, build_policy
from vllm_kvevict import masks

logger = logging.getLogger("vllm.kvevict")  # under vLLM's logger: its handler and format

ADDITIONAL_CONFIG_KEY = "kv_policy"
MAX_VARIANTS = 64
KINDS = ("full", "head_mask", "token", "hybrid")  # `ServedPolicy.kind`  # distinct per-request settings kept built (oldest dropped first)


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    num_kv_heads: int
    num_q_heads: int
    head_dim: int

    @property
    def queries_per_kv(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @classmethod
    def of(cls, hf_config) -> "ModelShape":
        text = getattr(hf_config, "get_text_config", lambda: hf_config)()
        num_q = text.num_attention_heads
        num_kv = getattr(text, "num_key_value_heads", None) or num_q
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // num_q
        return cls(text.num_hidden_layers, num_kv, num_q, head_dim)


def policy_config_of(vllm_config) -> KVPolicyConfig:
    """The KVPolicyConfig a VllmConfig carries (`full` when absent)."""
    additional = getattr(vllm_config, "additional_config", None) or {}
    raw = additional.get(ADDITIONAL_CONFIG_KEY) if isinstance(additional, dict) else None
    return KVPolicyConfig.from_dict(raw)


@dataclass
class ServedPolicy:
    config: KVPolicyConfig
    model: str
    shape: ModelShape
    policy: KVPolicy
    full_heads: torch.Tensor | None = None
    mask_source: str = ""
    mask_meta: dict = field(default_factory=dict)
    _variants: OrderedDict = field(default_factory=OrderedDict, repr=False)

    @classmethod
    def build(cls, config: KVPolicyConfig, model: str, shape: ModelShape) -> "ServedPolicy":
        """Resolve the head mask (duo/prulong) and build the policy; raises KVPolicyError."""
        full_heads, source, meta = None, "", {}
        if config.policy in HEAD_MASK_POLICIES:

            full_heads, source, meta = masks.resolve_head_mask(config, model, shape.num_layers,
                                                               shape.num_kv_heads)
        policy = build_policy(config, shape.num_layers, shape.num_kv_heads,
                              full_heads=full_heads, mask_source=source)
        return cls(config, model, shape, policy, full_heads, source, meta)

    # -- per request ------------------------------------------------------------------------
    def for_request(self, extra_args: Any) -> KVPolicy:
        """The policy with a request's valid `vllm_xargs` overrides applied."""
        return self.variant(effective_config(self.config, extra_args)[1])

    def variant(self, overrides: dict[str, Any]) -> KVPolicy:
        if not overrides:
            return self.policy
        key = tuple(sorted(overrides.items()))
        policy = self._variants.get(key)
        if policy is None:
            cfg = self.config.replace(**{OVERRIDE_KEYS[k][0]: v for k, v in overrides.items()})
            policy = build_policy(cfg, self.shape.num_layers, self.shape.num_kv_heads,
                                  full_heads=self.full_heads, mask_source=self.mask_source)
            self._variants[key] = policy
            while len(self._variants) > MAX_VARIANTS:
                self._variants.popitem(last=False)
        return policy

    def params(self, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
        """The settings a request was served with (kv_stats `params`): the policy's fields,
        with the served mask named by its file."""
        config = self.variant(overrides or {}).config
        params = config.to_dict()
        params.pop("policy", None)
        mask = params.pop("mask_path", None) or self.mask_source
        if mask:
            params["mask"] = os.path.basename(mask)
        return params

    @property
    def kind(self) -> str:
        """What the glue's factories choose by (`KINDS`): `full` (stock vLLM), `head_mask`
        (streaming heads: streaming, duo, prulong), `token` (snapkv, pyramidkv) or `hybrid` (a
        head mask whose full heads evict tokens: the head-mask and token parts composed)."""
        cfg = self.config
        if cfg.policy == "full":
            return "full"
        if cfg.uses_head_mask:
            return "hybrid" if cfg.evicts_tokens else "head_mask"
        return "token"

    # -- start-up ---------------------------------------------------------------------------
    @property
    def streaming_kv_heads(self) -> int:
        return int(self.policy.streaming_heads().sum())

    def describe(self) -> dict[str, Any]:
        """Everything this server serves, for the start-up line and `GET /v1/kv_stats`."""
        out: dict[str, Any] = {"policy": self.config.policy, **self.params()}
        if self.mask_source:
            out["mask_path"] = self.mask_source
            out["mask_trained"] = {k: self.mask_meta[k] for k in
                                   ("objective", "train_sparsity", "sink", "window")
                                   if k in self.mask_meta}
        out["streaming_kv_heads"] = self.streaming_kv_heads
        out["kv_heads"] = self.shape.num_layers * self.shape.num_kv_heads
        if self.config.evicts_tokens:
            out["kv_cache_groups"] = self.config.num_tiers(self.shape.num_layers)
        return out


# One per process; rebuilt only if a process serves another configuration (unit tests do).
_served: ServedPolicy | None = None
_served_key: tuple | None = None
builds = 0  # constructions in this process (tests check it stays 1 in a server)


def _key(vllm_config) -> tuple:
    """(the policy's settings but its mask file, the model, the mask file as given)."""
    additional = getattr(vllm_config, "additional_config", None) or {}
    raw = additional.get(ADDITIONAL_CONFIG_KEY) if isinstance(additional, dict) else None
    mask = raw.get("mask_path") if isinstance(raw, dict) else None
    settings = sorted((k, v) for k, v in raw.items() if k != "mask_path") \
        if isinstance(raw, dict) else raw
    return repr(settings), str(vllm_config.model_config.model), mask


def _serves(key: tuple) -> bool:
    """This process's policy is the one `key` asks for: the same settings and model, and the
    same mask file, or the file it resolved (`settle_config` pins that into the config)."""
    return _served is not None and key[:2] == _served_key[:2] and \
        key[2] in (_served_key[2], _served.mask_source)


def serving(served: ServedPolicy, vllm_config) -> dict[str, Any]:
    """Everything the server serves: the policy (`describe`) and the engine settings that
    decide its chunks and memory. The start-up line and `GET /v1/kv_stats` params."""
    out = served.describe()
    scheduler = getattr(vllm_config, "scheduler_config", None)
    cache = getattr(vllm_config, "cache_config", None)
    out["chunk"] = getattr(scheduler, "max_num_batched_tokens", None)
    out["prefix_caching"] = getattr(cache, "enable_prefix_caching", None)
    out["block_size"] = getattr(cache, "block_size", None)
    out["kv_cache_dtype"] = str(getattr(cache, "cache_dtype", "auto"))
    parallel = getattr(vllm_config, "parallel_config", None)
    out["tensor_parallel_size"] = int(getattr(parallel, "tensor_parallel_size", 1) or 1)
    return out


def settle_config(vllm_config, prefix_caching_requested: bool | None = None) -> ServedPolicy:
    """Once, where the engine config is created (`registration.create_engine_config`, through
    start-up validation): the served policy's decisions written into vLLM's config, which every
    later process (engine core, workers) receives, so each builds the same policy from it.
    `prefix_caching_requested`: the user's flag before vLLM's default (None: not given)."""
    config = policy_config_of(vllm_config)
    cache = getattr(vllm_config, "cache_config", None)
    token_prefixes = prefix_caching_requested is True and config.caches_token_prefixes
    if config.policy != "full" and cache is not None and not config.caches_prefixes \
            and not token_prefixes:
        # Per-request eviction state starts at token 0: a prefix-cache hit would skip it
        # (streaming heads in the pool keep their state in cached blocks: sink_window.py;
        # naive token eviction, asked for, in the compacted blocks: prefix_cache.py).
        cache.enable_prefix_caching = False
    if token_prefixes and cache is not None and cache.enable_prefix_caching \
            and config.eviction_chunk is None:
        # canonical chunks: a cached row must not depend on how vLLM split the steps
        chunk = int(vllm_config.scheduler_config.max_num_batched_tokens)
        vllm_config.additional_config[ADDITIONAL_CONFIG_KEY]["eviction_chunk"] = chunk
    served = served_policy(vllm_config)
    if served.mask_source and config.mask_path != served.mask_source:
        # pin the resolved file: every later process serves exactly this mask (here, the
        # same policy: no second build, `_serves`)
        vllm_config.additional_config[ADDITIONAL_CONFIG_KEY]["mask_path"] = served.mask_source
    return served


def served_policy(vllm_config) -> ServedPolicy:
    """This process's ServedPolicy (built on first use; raises KVPolicyError). Reads the
    config only: `settle_config` is what writes the policy's decisions into it."""
    global _served, _served_key, builds
    key = _key(vllm_config)
    if _serves(key):
        return _served
    config = policy_config_of(vllm_config)
    model = str(vllm_config.model_config.model)
    served = ServedPolicy.build(config, model, ModelShape.of(vllm_config.model_config.hf_config))
    if served.mask_source and config.mask_path != served.mask_source:
        served.config = served.config.replace(mask_path=served.mask_source)
    builds += 1
    _served, _served_key = served, key
    logger.info("vllm-kvevict: serving %s (process %d, build %d)",
                " ".join(f"{k}={v}" for k, v in serving(served, vllm_config).items()),
                os.getpid(), builds)
    return served
