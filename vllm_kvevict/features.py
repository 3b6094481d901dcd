"""Which vLLM features an evicting policy can be served with exactly (no vLLM import).

Speculative decoding: a verification step runs the last sampled token and K drafts of a request
as K + 1 queries; the policies make every one of them see what it would see decoded alone
(docs/design/worker.md, "Speculative decoding"), so any proposer whose drafts are plain token ids is
exact. `ngram` is such a proposer and is tested (tests/test_speculative.py). Proposers that run
layers of their own (a draft model, EAGLE, MTP, ...) would send those layers through our
attention backend with the target model's policy (head mask, token ledger) and are refused;
`suffix` and custom proposers are refused too, as untested (`suffix` also needs a package this
build does not ship). The same holds under `full`: a drafter's layers would run through the
plugin's stats path untested, so only ngram is served there too.
"""

from __future__ import annotations

SUPPORTED_SPECULATIVE_METHODS = ("ngram",)


def speculative_error(policy_config, method: str | None) -> str | None:
    """The one-line refusal for serving `policy_config` (a KVPolicyConfig) with speculative
    method `method` (vLLM's resolved `speculative_config.method`; None: no speculation), or
    None when the pair is served exactly."""
    if method is None:
        return None
    if getattr(policy_config, "is_hybrid", False):
        return ("--speculative-config is not supported with --kv-token-policy (untested: "
                "verification rows with patched question rows); valid: no speculation")
    if method in SUPPORTED_SPECULATIVE_METHODS:
        return None
    return (f"--speculative-config method {method!r} is not supported with --kv-policy "
            f"{policy_config.policy}; supported: {', '.join(SUPPORTED_SPECULATIVE_METHODS)}")


def connector_error(policy_config, connectors: list[str]) -> str | None:
    """A user's KV connector saves and loads whole KV blocks by token position; eviction rewrites
    them (compacted, or freed outside a head's window), so loaded blocks would have to be
    what the policy kept at the same chunk boundaries: not built, so refused."""
    if not connectors or policy_config.policy == "full":
        return None
    return (f"--kv-transfer-config connector(s) {', '.join(connectors)} cannot be combined "
            f"with --kv-policy {policy_config.policy}: a KV connector saves and loads KV blocks "
            "that eviction rewrites; with a connector use --kv-policy full (kv_stats stay on)")


# KV cache dtypes served with every policy: the model's (`auto`) and vLLM's CPU fp8 formats
# (`integration/attention/fp8.py`: streaming heads' blocks hold fp8 codes too; token eviction
# rewrites kept tokens through vLLM's own quantizing write). Decoupled eviction chunks read earlier
# steps' K/V back from the paged cache, which `paged_layout.py` knows for the model dtype only.
SUPPORTED_KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")


def kv_cache_dtype_error(policy_config, cache_dtype: str | None) -> str | None:
    cache_dtype = cache_dtype or "auto"
    if policy_config.policy == "full":
        return None
    if cache_dtype not in SUPPORTED_KV_CACHE_DTYPES:
        return (f"--kv-cache-dtype {cache_dtype} is not supported with --kv-policy "
                f"{policy_config.policy}; valid: {', '.join(SUPPORTED_KV_CACHE_DTYPES)} "
                "(--kv-policy full serves any cache dtype vLLM does)")
    if cache_dtype != "auto" and getattr(policy_config, "eviction_chunk", None) is not None:
        return (f"--kv-cache-dtype {cache_dtype} is not supported with --kv-eviction-chunk; "
                "valid with --kv-eviction-chunk: auto")
    return None


# Parallel layouts. Tensor parallel: each rank serves its contiguous slice of the KV heads, so
# of the head mask (`kv_cache_specs.layer_heads`); kv_stats count every rank. With fewer KV
# heads than ranks vLLM replicates them: a head mask masks each replica as its head; token
# eviction gathers a head's score from its replicas (`worker.replica_scores`); the hybrid is
# refused there (a rank with a streaming replica would miss a full head's exchange). Data
# parallel: one engine core per replica, each with its own policy state and stats (kv_stats
# name the replica's rank), behind any number of API servers (they share one kv_stats log:
# server/shared.py). Pipeline parallel is not built (other layers
# per stage) and vLLM CPU 0.32's own fails on its first request
# (tests/test_pipeline_parallel.py): refused, full included.
PARALLEL_FLAGS = (("tensor_parallel_size", "--tensor-parallel-size"),
                  ("pipeline_parallel_size", "--pipeline-parallel-size"),
                  ("data_parallel_size", "--data-parallel-size"))


def parallel_error(policy_config, sizes: dict[str, int], num_kv_heads: int | None = None
                   ) -> str | None:
    """`sizes`: vLLM ParallelConfig field -> value; `num_kv_heads`: the model's (None: unknown,
    tensor parallel is then not checked against it)."""
    for field, flag in PARALLEL_FLAGS[1:2]:
        size = int(sizes.get(field) or 1)
        if size != 1:
            return (f"{flag} {size} is not supported with --kv-policy {policy_config.policy} "
                    "yet (not built; vLLM CPU 0.32's own pipeline parallel fails on its first "
                    "request); valid: 1")
    tp = int(sizes.get("tensor_parallel_size") or 1)
    if tp != 1 and num_kv_heads is not None and num_kv_heads % tp:
        replicated = tp % num_kv_heads == 0  # vLLM gives each rank a replica
        if replicated and not getattr(policy_config, "is_hybrid", False):
            # a head mask masks each replica as its head; token eviction gathers a replicated
            # head's score from its replicas' shares of its queries (worker.replica_scores)
            return None
        why = ("; a head mask with --kv-token-policy is not built there: a rank whose replica "
               "is a streaming head would not take part in a full head's score exchange"
               if replicated else "")
        valid = [d for d in range(1, num_kv_heads + 1) if num_kv_heads % d == 0]
        return (f"--tensor-parallel-size {tp} does not divide the model's {num_kv_heads} KV "
                f"heads (vLLM would replicate them across ranks{why}); valid with --kv-policy "
                f"{policy_config.policy}: {', '.join(map(str, valid))}")
    return None


def tiers_error(policy_config, num_layers: int) -> str | None:
    """--kv-tiers must divide the layers: vLLM's hybrid allocator makes groups of equal layer
    counts, so it would pad the smaller tiers with phantom layers, which cost pool memory."""
    tiers = policy_config.num_tiers(num_layers)
    if num_layers % tiers == 0:
        return None
    divisors = [d for d in range(1, num_layers + 1) if num_layers % d == 0]
    return (f"--kv-tiers {tiers} does not divide the model's {num_layers} layers; valid: "
            f"{', '.join(map(str, divisors))}")


def eviction_chunk_error(policy_config, step_budget: int) -> str | None:
    """--kv-eviction-chunk with token eviction: a chunk's last step must hold its observation
    window whole (its queries score)."""
    if policy_config.eviction_chunk is None or not policy_config.evicts_tokens \
            or step_budget >= policy_config.obs_window:
        return None
    return (f"--kv-eviction-chunk needs --max-num-batched-tokens >= --kv-obs-window "
            f"({policy_config.obs_window}), got {step_budget}")


def serves_on_flex(policy_config, platform: str, chosen: str | None) -> bool:
    """Off the CPU platform a policy runs on our FlexAttention backend, registered under vLLM's
    FLEX_ATTENTION name, when the user chose no backend (`platform_error` refuses others)."""
    return policy_config.policy != "full" and platform != "cpu" and chosen is None


def decode_eviction_error(policy_config, method: str | None, cache_dtype: str | None
                          ) -> str | None:
    """Decode-time eviction (`--kv-decode-budget`) is tested against the reference with one
    decode token per step and the model's cache dtype (tensor and data parallel too); the rest
    is refused until it is (a verification step would compress in the middle of K + 1
    queries; fp8 would score the read-back codes)."""
    if getattr(policy_config, "decode_budget", None) is None:
        return None
    if method is not None:
        return ("--speculative-config is not supported with --kv-decode-budget (not built: a "
                "verification step would compress between its queries); valid: no speculation")
    if (cache_dtype or "auto") != "auto":
        return (f"--kv-cache-dtype {cache_dtype} is not supported with --kv-decode-budget; "
                "valid with --kv-decode-budget: auto")
    return None


def prompt_embeds_error(policy_config, enabled: bool) -> str | None:
    """Prompt embeddings replace input ids, which patched eviction appends its question rows
    to; untested under every policy, so refused."""
    if not enabled:
        return None
    return f"--enable-prompt-embeds is not supported with --kv-policy {policy_config.policy}"


def prefix_caching_error(policy_config, requested: bool | None) -> str | None:
    """Evicting policies run with prefix caching off unless it is exact for them: a hit would
    skip the eviction state a request builds from its first token. vLLM's default (None: not
    asked for) is switched off and logged; asking for it explicitly is refused rather than
    silently ignored, except for token eviction where `caches_token_prefixes` (naive, or patched
    under the declared reuse mode), where a hit at a chunk boundary reuses the compacted blocks
    (`token_prefix_error` checks the rest)."""
    reuse = getattr(policy_config, "prefix_reuse", "exact")
    if reuse != "exact" and requested is not True:
        return (f"--kv-prefix-reuse {reuse} needs --enable-prefix-caching (it declares what a "
                "prefix-cache hit reuses); valid: add --enable-prefix-caching, or leave "
                "--kv-prefix-reuse out")
    if requested is not True or policy_config.policy == "full" \
            or getattr(policy_config, "caches_prefixes", False) \
            or getattr(policy_config, "caches_token_prefixes", False):
        return None
    flag, why = token_prefix_reason(policy_config)
    return (f"--enable-prefix-caching is not supported with --kv-policy {policy_config.policy}"
            f"{flag} yet ({why}); valid: leave it out or pass --no-enable-prefix-caching, "
            "which evicting policies run with; prefix caching is served with --kv-policy full, "
            "with streaming/duo/prulong, and with snapkv/pyramidkv (or --kv-token-policy) "
            "--kv-eviction naive, or patched with --kv-prefix-reuse across-questions (no "
            "--kv-decode-budget, CPU attention path)")


def token_prefix_reason(policy_config) -> tuple[str, str]:
    """The flag that keeps a token-evicting configuration from prefix caching, and why."""
    if policy_config.token_policy == "pyramidkv":
        return (" --kv-token-policy pyramidkv", "not built: its layers keep unequal counts per "
                "chunk, and the pool's groups of full heads, packed by width, mix layers")
    if policy_config.eviction != "naive":
        return (f" --kv-eviction {policy_config.eviction}", "each chunk is scored with the "
                "prompt's question: a cached chunk was selected under another request's; "
                "--kv-prefix-reuse across-questions reuses it, declared in kv_stats")
    if policy_config.decode_budget is not None:
        return " --kv-decode-budget", "decode-time eviction rewrites cached blocks in place"
    return f" --kv-attention-backend {policy_config.attention_backend}", "untested"


def token_prefix_error(policy_config, prefix_caching: bool, sizes: dict[str, int],
                       speculative: str | None, lora: bool, chunk: int,
                       block_size: int) -> str | None:
    """Token eviction with prefix caching on: the parts of vLLM it is tested with (tensor
    and data parallel, LoRA; no draft tokens) and canonical chunks of whole blocks."""
    if not prefix_caching or not getattr(policy_config, "caches_token_prefixes", False):
        return None
    # (tensor parallel: the cache is the engine core's, every rank's worker starts at the hit;
    # data parallel: each replica's engine core has its own cache; both tested without a
    # head mask)
    hybrid = getattr(policy_config, "is_hybrid", False)
    what = ([f"{flag} {sizes[field]}" for field, flag in PARALLEL_FLAGS
             if sizes.get(field, 1) != 1
             and (hybrid or field == "pipeline_parallel_size")]
            + (["speculative decoding"] if speculative else [])
            # (LoRA: vLLM's block hashes, and so our boundary keys, name the adapter)
            + (["--enable-lora"] if lora and hybrid else []))
    if what:
        return (f"--enable-prefix-caching with --kv-policy {policy_config.policy} is not "
                f"supported with {', '.join(what)} yet (untested); valid: one engine without "
                "them, or --no-enable-prefix-caching")
    if block_size and chunk % block_size:
        return (f"--enable-prefix-caching with --kv-policy {policy_config.policy} needs "
                f"--kv-eviction-chunk (default --max-num-batched-tokens) to be a multiple of "
                f"--block-size {block_size}, got {chunk}")
    return None


def model_runner_error(policy_config, uses_v2: bool, turned_on: list[str]) -> str | None:
    """vLLM's V2 model runner (`VLLM_USE_V2_MODEL_RUNNER=1`, or Triton present: on CPU 0.32
    `CPUWorker` then builds `vllm.v1.worker.cpu.model_runner.CPUModelRunner`) serves every
    policy (the worker side reads it through `integration/worker/runners.py`, question rows in
    `question_rows.py`; tokens == the reference, tests/test_v2_runner.py), eager or compiled,
    tensor and data parallel (tests/test_tensor_parallel.py, test_data_parallel.py), forced
    preemption, at the model's KV-cache dtype, without speculation or LoRA. With the V2 runner,
    each of `turned_on` (the vLLM features the user turned on, by flag) is untested: refused.
    `full` runs as stock vLLM."""
    if not uses_v2 or policy_config.policy == "full" or not turned_on:
        return None
    return (f"VLLM_USE_V2_MODEL_RUNNER=1 (vLLM's V2 model runner) with --kv-policy "
            f"{policy_config.policy} is not supported with {', '.join(turned_on)} yet "
            "(untested); valid: VLLM_USE_V2_MODEL_RUNNER=0 (vLLM's V1 runner serves them), or "
            "the V2 runner with --kv-cache-dtype auto, no speculative decoding and no LoRA")


def v2_features_on(vllm_config) -> list[str]:
    """The features `model_runner_error` checks, as the flags that turned them on."""
    # (tensor and data parallel are served under V2; pipeline parallel is not)
    pipeline = int(getattr(getattr(vllm_config, "parallel_config", None),
                           "pipeline_parallel_size", 1) or 1)
    out = [f"--pipeline-parallel-size {pipeline}"] if pipeline != 1 else []
    dtype = str(getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", "auto"))
    if dtype != "auto":
        out.append(f"--kv-cache-dtype {dtype}")
    if getattr(getattr(vllm_config, "speculative_config", None), "method", None):
        out.append("--speculative-config")
    if getattr(vllm_config, "lora_config", None) is not None:
        out.append("--enable-lora")
    return out


def lora_error(policy_config, enabled: bool) -> str | None:
    """Patched eviction runs its question rows as extra tokens of the step; vLLM's LoRA layers
    index their adapters per scheduled token and do not know those rows (the worker stopped on
    a shape mismatch in the LoRA embedding). Naive eviction and head masks add no rows."""
    if not enabled:
        return None
    if policy_config.patched:
        return (f"--enable-lora is not supported with --kv-policy {policy_config.policy} "
                "--kv-eviction patched; valid with LoRA: --kv-eviction naive")
    if getattr(policy_config, "is_hybrid", False):
        return ("--enable-lora is not supported with --kv-token-policy yet (untested); valid "
                "with LoRA: no --kv-token-policy")
    return None


# Model families served with an evicting policy, each checked token for token against the
# reference oracle (tests/test_model_families*.py): plain causal GQA decoders whose every
# layer attends to the whole past. Their own q/k normalisation (Qwen3) and rotary scaling
# (Llama 3) happen before attention, where vLLM applies them too.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                           "Qwen3ForCausalLM")


def model_error(policy_config, hf_config) -> str | None:
    """Why the model (a transformers config) cannot be served exactly with the policy, or None.
    The paper's policies evict from full causal attention: a model whose layers already use a
    sliding window or attention sinks, MLA (compressed latent KV), or another attention
    pattern would need policies of its own."""
    if policy_config.policy == "full" or hf_config is None:
        return None
    text = getattr(hf_config, "get_text_config", lambda: hf_config)()
    archs = list(getattr(hf_config, "architectures", None) or [])
    name = archs[0] if archs else type(hf_config).__name__
    why = None
    if getattr(text, "kv_lora_rank", None):
        why = "it uses MLA (compressed latent KV)"
    elif "sliding_attention" in (getattr(text, "layer_types", None) or ()):
        why = "some of its layers use a sliding window"
    elif getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True):
        why = f"its layers use a sliding window of {text.sliding_window} tokens"
    elif getattr(hf_config, "is_encoder_decoder", False):
        why = "it is an encoder-decoder (cross attention)"
    elif name not in SUPPORTED_ARCHITECTURES:
        why = "its architecture is not one the policies are tested on"
    if why is None:
        return None
    return (f"model {name} cannot be served with --kv-policy {policy_config.policy}: {why}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)} with full causal attention "
            "(--kv-policy full serves any model vLLM does)")


def fast_layout(policy_config) -> tuple[int, int | None] | None:
    """(--block-size, --kv-full-block-size) the plugin picks for a head mask on the CPU path
    when the user set neither (docs/results/limits/): the streaming heads in the largest of
    128, 64 and 32 tokens whose blocks their sink fills whole and their window holds (decode
    then reads them in place, `in_place_hint`), the full heads, if any, in 128-token blocks, as
    fast as stock's cache (`full_block_error` says where that is served). A head mask with a
    token policy (the hybrid) keeps its full heads in the streaming heads' blocks (its token
    ledger counts every group in one block size). None: no head mask, not the CPU kernel (the
    flex path keeps vLLM's blocks), or vLLM's own 128-token blocks already are that layout (or
    no smaller block fits)."""
    if not policy_config.uses_head_mask or policy_config.attention_backend != "cpu":
        return None
    sink, window = policy_config.sink, policy_config.window
    fits = [b for b in (128, 64, 32) if sink % b == 0 and window >= b]
    if not fits or fits[0] == 128:
        return None
    full_heads_apart = policy_config.policy != "streaming" and not policy_config.evicts_tokens
    return fits[0], (128 if full_heads_apart else None)


def full_block_error(policy_config, block_size: int, sizes: dict[str, int],
                     uses_v2: bool, chunk: int = 0, cache_dtype: str = "auto") -> str | None:
    """`--kv-full-block-size` (full heads' groups in larger blocks than the streaming heads'):
    a multiple of vLLM's --block-size, both taking the CPU kernel's instruction path for
    blocks that are multiples of 32 (vLLM picks it per group and stores it on the layer, which
    reads both its groups), dividing the canonical prefill chunk `chunk` (prefix-cache hits
    land on its multiples; 0: none). Served and tested on one process with vLLM's V1 CPU
    runner, the model's dtype or fp8 in the cache (tests/test_fp8.py)."""
    full = policy_config.full_block_size
    if full is None or full == block_size or block_size <= 0:
        return None
    if full % block_size or block_size % 32:
        return (f"--kv-full-block-size {full} must be a multiple of --block-size {block_size}, "
                f"and --block-size a multiple of 32 (vLLM's CPU kernel reads smaller blocks on "
                f"another instruction path); valid e.g. --block-size 64 --kv-full-block-size 128")
    if chunk % full:
        return (f"--kv-full-block-size {full} must divide the canonical prefill chunk ({chunk}: "
                f"--kv-eviction-chunk, else --max-num-batched-tokens with prefix caching)")
    used = [flag for field, flag in PARALLEL_FLAGS[:2] if sizes.get(field, 1) > 1]
    if used or uses_v2:
        what = used[0] if used else "vLLM's V2 model runner"
        return (f"--kv-full-block-size {full} is not tested with {what}; serve without "
                f"--kv-full-block-size (the full heads then use --block-size {block_size})")
    return None


# vLLM's CUDA-graph modes (CompilationConfig.cudagraph_mode) that capture whole steps, attention
# included; NONE and PIECEWISE run attention outside any graph
FULL_GRAPH_MODES = ("FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")


def cudagraph_error(policy_config, mode: str | None) -> str | None:
    """A FULL CUDA graph replays attention as captured at one step; the policies build their
    block masks, step plans and evictions on the host every step (`flex_attention.py`,
    `flex_token.py`), so a replay would attend with a stale mask. Off the CPU platform (which
    has no CUDA graphs) a policy runs with PIECEWISE graphs at most. `mode`: the user's
    `cudagraph_mode` name (None: not set; start-up then sets PIECEWISE over vLLM's default)."""
    if mode is None or mode.upper() not in FULL_GRAPH_MODES:
        return None
    return (f"--compilation-config '{{\"cudagraph_mode\": \"{mode.upper()}\"}}' is not supported "
            f"with --kv-policy {policy_config.policy}: a FULL CUDA graph replays attention with "
            "the block mask captured at one step, and the policy builds its masks and eviction "
            "plans every step; valid: NONE, PIECEWISE (or leave it out: the plugin sets "
            "PIECEWISE)")
