"""Per-request overrides of the served policy: the OpenAI body's `vllm_xargs` (vLLM passes them
as `sampling_params.extra_args`). The rules live here, beside `KVPolicyConfig`, and are used in
two places: the API server refuses a bad key with HTTP 400 before the engine sees it
(`check_vllm_xargs`, handed to server/ at install time), and the engine applies the valid ones
(`effective_config`, through `ServedPolicy.for_request`). No vLLM import.
"""

from __future__ import annotations

import math
from typing import Any

from vllm_kvevict.config import TOKEN_EVICTION_POLICIES as TOKEN_EVICTION


# key -> (KVPolicyConfig field, description for error messages)
OVERRIDE_KEYS = {
    "kv_sparsity": ("sparsity", "a number in [0, 1] (token sparsity p)"),
    "kv_obs_window": ("obs_window", "an integer >= 1 (observation window k, in tokens)"),
    # decode-time eviction: on a server started with --kv-decode-budget only (its worker
    # keeps decode queries and compresses during decode only then)
    "kv_decode_budget": ("decode_budget", "an integer >= 1 (decode-time eviction: tokens per "
                                          "KV head)"),
    "kv_decode_interval": ("decode_interval", "an integer >= 1 (generated tokens between two "
                                              "decode-time compressions)"),
}
DECODE_KEYS = ("kv_decode_budget", "kv_decode_interval")
# Keys about the request itself, for every policy (not a policy setting).
TEACHER_FORCED = "kv_teacher_forced"
TEACHER_FORCED_TEXT = ("an integer >= 0: the prompt's last n tokens are a teacher-forced "
                       "continuation, served as decode tokens (to score an answer with "
                       "prompt_logprobs); at least one prompt token stays prompt")
# vllm_xargs keys vLLM itself reads; never ours to judge.
VLLM_OWN_XARGS = frozenset({"kv_transfer_params", "ec_transfer_params", "kv_cache_report_mode",
                            "session_id"})
# Server settings a request may not change (the KV layout and masks are fixed at start-up).
PATH_KEYS = frozenset({"mask_path", "kv_mask", "kv_mask_path", "mask", "kv_mask_file"})
SERVER_KEYS = frozenset({"policy", "kv_policy", "sparsity", "sink", "kv_sink", "window",
                         "kv_window", "obs_window", "pool_kernel", "kv_pool_kernel", "eviction",
                         "kv_eviction", "tiers", "kv_tiers"}) | PATH_KEYS


def _valid_keys_text(max_model_len: int | None) -> str:
    window = OVERRIDE_KEYS["kv_obs_window"][1]
    if max_model_len:
        window = f"an integer in [1, {max_model_len}] (observation window k, in tokens)"
    return (f"kv_sparsity ({OVERRIDE_KEYS['kv_sparsity'][1]}), kv_obs_window ({window}): "
            f"only for policies {', '.join(TOKEN_EVICTION)}; kv_decode_budget, "
            f"kv_decode_interval (integers >= 1): the same, on a server started with "
            f"--kv-decode-budget; {TEACHER_FORCED} ({TEACHER_FORCED_TEXT}): every policy")


def override_error(key: str, value: Any, policy: str, max_model_len: int | None = None,
                   obs_window_max: int | None = None, decode_eviction: bool = False
                   ) -> str | None:
    """Why `vllm_xargs[key] = value` is refused (None: accepted or not ours).
    `obs_window_max`: the served `KVPolicyConfig.max_obs_window` (None: max_model_len);
    `decode_eviction`: the server runs with a decode budget."""
    valid = _valid_keys_text(max_model_len)
    if key in VLLM_OWN_XARGS:
        return None
    if key in PATH_KEYS:
        return (f"vllm_xargs key {key!r} is refused: a request may not name a file path "
                f"(head masks are chosen at server start with --kv-mask). Per-request KV keys: "
                f"{valid}.")
    if key in SERVER_KEYS:
        return (f"vllm_xargs key {key!r} is a server setting (--kv-* flags at start-up), not "
                f"per request. Per-request KV keys: {valid}.")
    if key == TEACHER_FORCED:
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0 and (
                not max_model_len or value < max_model_len):
            return None
        bound = f" and < {max_model_len}" if max_model_len else ""
        return (f"vllm_xargs[{key!r}] = {value!r} is invalid: expected an integer >= 0{bound}. "
                f"Per-request KV keys: {valid}.")
    if key not in OVERRIDE_KEYS:
        if key.startswith("kv_"):
            return f"unknown vllm_xargs key {key!r}. Per-request KV keys: {valid}."
        return None  # another extension's key: passed through untouched
    if policy not in TOKEN_EVICTION:
        return (f"vllm_xargs key {key!r} only applies to token-eviction policies "
                f"({', '.join(TOKEN_EVICTION)}); this server runs kv policy {policy!r}, whose KV "
                f"layout is fixed at start-up. Per-request KV keys: {valid}.")
    if key in DECODE_KEYS:
        if not decode_eviction:
            return (f"vllm_xargs key {key!r} needs a server started with --kv-decode-budget "
                    f"(decode-time eviction is off on this server). Per-request KV keys: "
                    f"{valid}.")
        expected = "an integer >= 1"
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
    elif key == "kv_sparsity":
        expected = OVERRIDE_KEYS[key][1]
        ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
              and math.isfinite(value) and 0.0 <= value <= 1.0)
    else:
        bound = min(b for b in (max_model_len, obs_window_max, math.inf) if b)
        expected = f"an integer in [1, {bound}]" if bound != math.inf else "an integer >= 1"
        if obs_window_max and bound == obs_window_max:
            expected += (" (--kv-attention-backend flex with patched eviction: at most the "
                         "served --kv-obs-window)")
        ok = (isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= bound)
    if not ok:
        return (f"vllm_xargs[{key!r}] = {value!r} is invalid: expected {expected}. "
                f"Per-request KV keys: {valid}.")
    return None


def check_vllm_xargs(xargs: Any, policy: str, max_model_len: int | None = None,
                     obs_window_max: int | None = None, decode_eviction: bool = False
                     ) -> str | None:
    """First refusal for a request's vllm_xargs (None: fine). Non-dicts are vLLM's to judge."""
    if not isinstance(xargs, dict):
        return None
    for key, value in xargs.items():
        error = override_error(str(key), value, policy, max_model_len, obs_window_max,
                               decode_eviction)
        if error:
            return error
    return None


def request_overrides(extra_args: Any, policy: str, obs_window_max: int | None = None,
                      decode_eviction: bool = False) -> dict[str, Any]:
    """The valid per-request overrides among sampling_params.extra_args (engine side: anything
    that slipped past the API check, e.g. from the offline API, is ignored, never fatal)."""
    if not isinstance(extra_args, dict):
        return {}
    return {key: extra_args[key] for key in OVERRIDE_KEYS if key in extra_args and
            override_error(key, extra_args[key], policy, None, obs_window_max,
                           decode_eviction) is None}


def teacher_forced(extra_args: Any) -> int:
    """The request's teacher-forced tail n (0: none; engine side: an invalid value is ignored)."""
    if not isinstance(extra_args, dict) or TEACHER_FORCED not in extra_args:
        return 0  # the common case, every step of every request: no message built
    value = extra_args[TEACHER_FORCED]
    return 0 if override_error(TEACHER_FORCED, value, "full") is not None else value


def policy_prompt_len(num_prompt_tokens: int, extra_args: Any) -> int:
    """The prompt as the KV policy serves it: vLLM's prompt without its teacher-forced tail,
    whose tokens are served as decode tokens (at least one token stays prompt)."""
    return max(num_prompt_tokens - teacher_forced(extra_args), min(num_prompt_tokens, 1))


def request_prompt_len(request) -> int:
    """`policy_prompt_len` of a vLLM request (read through its plain attributes)."""
    params = getattr(request, "sampling_params", None)
    return policy_prompt_len(request.num_prompt_tokens, getattr(params, "extra_args", None))


def effective_config(cfg, extra_args: Any):
    """(KVPolicyConfig with the request's overrides applied, the overrides used)."""
    overrides = request_overrides(extra_args, cfg.policy, cfg.max_obs_window,
                                  cfg.decode_budget is not None)
    if not overrides:
        return cfg, {}
    return cfg.replace(**{OVERRIDE_KEYS[k][0]: v for k, v in overrides.items()}), overrides
