"""Which vLLM features an evicting policy can be served with exactly (no vLLM import).

Speculative decoding: a verification step runs the last sampled token and K drafts of a request
as K + 1 queries; the policies make every one of them see what it would see decoded alone
(docs/design.md, "Speculative decoding"), so any proposer whose drafts are plain token ids is
exact. `ngram` is such a proposer and is tested (tests/test_speculative.py). Proposers that run
layers of their own (a draft model, EAGLE, MTP, ...) would send those layers through our
attention backend with the target model's policy (head mask, token ledger) and are refused;
`suffix` and custom proposers are refused too, as untested (`suffix` also needs a package this
build does not ship). `full` is stock vLLM: every method vLLM supports.
"""

from __future__ import annotations

SUPPORTED_SPECULATIVE_METHODS = ("ngram",)


def speculative_error(policy_config, method: str | None) -> str | None:
    """The one-line refusal for serving `policy_config` (a KVPolicyConfig) with speculative
    method `method` (vLLM's resolved `speculative_config.method`; None: no speculation), or
    None when the pair is served exactly."""
    if method is None or policy_config.policy == "full":
        return None
    if method in SUPPORTED_SPECULATIVE_METHODS:
        return None
    return (f"--speculative-config method {method!r} is not supported with --kv-policy "
            f"{policy_config.policy}; supported: {', '.join(SUPPORTED_SPECULATIVE_METHODS)}")


def speculative_slack(vllm_config) -> int:
    """K = num_speculative_tokens of a VllmConfig (0 without speculation): the streaming-head
    ring keeps K slots beyond sink + window so rejected drafts never overwrite a token still
    inside the window."""
    spec = getattr(vllm_config, "speculative_config", None)
    return int(getattr(spec, "num_speculative_tokens", None) or 0)
