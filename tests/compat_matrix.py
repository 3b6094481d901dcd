"""The compatibility matrix: vLLM features a user turns on (rows) x KV policies (columns). Each
cell is "exact" (tests compare the served tokens with the feature on against the reference
oracle doing the same), "refused" (tests check the one-line start-up error) or "n/a" (with
why, and a test that pins the reason). Every cell names its tests; `tests/test_compat_doc.py`
checks that each named test exists and that docs/results/compat.md is this table, and CI runs
the tests (slow-tier ones, marked (s), run with `pytest -m slow`).

    python tests/compat_matrix.py > docs/results/compat.md     # regenerate the page
"""

from __future__ import annotations

from dataclasses import dataclass

# column -> the parameter id its per-policy tests use
COLUMNS = {
    "full": "full",
    "streaming": "streaming",
    "duo 0.3": "duo-0.3",
    "prulong 0.7": "prulong-0.7",
    "snapkv naive": "snapkv-naive-0.5",
    "snapkv patched": "snapkv-patched-0.5",
    "pyramidkv naive": "pyramidkv-naive-0.5-tiers3",
    "pyramidkv patched": "pyramidkv-patched-0.7",
    "prulong 0.5 + snapkv patched 0.5": "hybrid-prulong-0.5-snapkv-patched-0.5",
    "snapkv naive + decode eviction": "snapkv-naive-0.5-decode",
}
HYBRID = "prulong 0.5 + snapkv patched 0.5"  # --kv-token-policy (tests/test_hybrid.py)
# --kv-decode-budget 64 --kv-decode-interval 4 (tests/test_decode_eviction.py)
DECODE = "snapkv naive + decode eviction"
DECODE_TEST = "tests/test_decode_eviction.py::test_decode_eviction_matches_reference"
DECODE_REFUSED = lambda why: Cell("refused", (
    "tests/test_decode_eviction_unit.py::test_refusals_name_the_flag_and_the_valid_values",
    f"tests/test_features.py::test_vllm_serve_refuses[decode-{why}]"),
    "decode-time eviction is tested with one decode token per step and the model's cache dtype "
    "so far: refused at start-up (--kv-decode-budget)")
HEAD_MASKS = ("streaming", "duo 0.3", "prulong 0.7")  # prefix caching on (sink_window.py)

EVICTING = [c for c in COLUMNS if c != "full"]
NOT_CACHING = [c for c in EVICTING if c not in HEAD_MASKS]
# naive token eviction: prefix caching when asked for (integration/kv_cache/prefix_cache.py)
TOKEN_CACHING = ("snapkv naive", "pyramidkv naive")
# patched token eviction: prefix caching under --kv-prefix-reuse across-questions
PATCHED_REUSE = ("snapkv patched", "pyramidkv patched", HYBRID)
# tests/test_pool_storage.py: prefix hits against the reference (prulong decoding in place,
# sink 32 in 32-token blocks, in CI; the rest slow)
POOL_STORAGE = lambda c: (("(s)" + f"tests/test_pool_storage.py::test_pool_storage_matches_reference"
                           f"[{COLUMNS[c]}]",)
                          + (("tests/test_pool_storage.py::test_pool_storage_matches_reference"
                              "[prulong-0.7-e256]",) if c == "prulong 0.7" else ()))
# The per-request rows (tests/test_compat.py) cost a server start and reference decodes per
# column; CI runs a head mask's column and patched token eviction's (CI's budget), the slow tier
# the others.
PATCHED_COLUMNS = ("snapkv patched", "pyramidkv patched", HYBRID)
SLOW_COLUMNS = ("full", "streaming", "duo 0.3", "snapkv naive", "pyramidkv naive",
                "pyramidkv patched", HYBRID, DECODE)
STATUSES = ("exact", "refused", "n/a")
# tests/test_tensor_parallel.py: one TP = 2 server per column on a 4-KV-head model
TP_IDS = {"full": "kv4-full", "streaming": "kv4-streaming", "duo 0.3": "kv4-duo-0.3",
          "prulong 0.7": "kv4-prulong-0.7", "snapkv naive": "kv4-snapkv-naive-0.5",
          "snapkv patched": "kv4-snapkv-patched-0.5",
          "pyramidkv naive": "kv4-pyramidkv-naive-0.5-tiers2",
          "pyramidkv patched": "kv4-pyramidkv-patched-0.7",
          DECODE: "kv4-snapkv-naive-0.5-decode",
          HYBRID: "kv4-hybrid-prulong-0.5-snapkv-patched-0.5"}
# tests/test_triton_vllm.py's tiny-model cells (CI but TRITON_TINY_SLOW)
TRITON_TINY = {"prulong 0.7": "prulong", DECODE: "snapkv-naive-decode",
               HYBRID: "hybrid-patched", "pyramidkv patched": "pyramidkv-patched"}
TRITON_TINY_SLOW = ("prulong", "pyramidkv-patched")
TP_CI = ("prulong 0.7",)  # CI's budget: data parallelism runs token eviction in CI
# tests/test_data_parallel.py: the same tiny model and policies as tensor parallel
DP_IDS = {column: test_id.removeprefix("kv4-") for column, test_id in TP_IDS.items()}
DP_CI = ("snapkv patched",)
FP8_CI = ("prulong 0.7", "snapkv patched")  # tests/test_fp8.py: the same model and ids
FP8_IDS = {c: i for c, i in TP_IDS.items() if c != DECODE}  # (refused with a decode budget)
FLEX_CI = ("prulong 0.7",)  # tests/test_flex_vllm.py (and its soak)
# tests/test_v2_runner.py, (parameter id, attention backend): CI serves a head mask on the
# portable path (the CUDA combination: V2 runner + FlexAttention) and patched token eviction
# (question rows) on the CPU path; the slow tier every other column
V2_CI = []  # (CI's budget: V2 in CI is the fast layout's case, tests/test_v2_runner.py)
V2_SLOW = [("prulong-0.7", "flex"), ("snapkv-patched-0.5", "cpu"), ("full", "cpu"), ("streaming", "cpu"), ("duo-0.3", "cpu"), ("prulong-0.7", "cpu"),
           ("snapkv-naive-0.5", "cpu"), ("pyramidkv-naive-0.5-tiers3", "cpu"),
           ("pyramidkv-patched-0.7", "cpu"), ("pyramidkv-patched-0.7", "flex"),
           ("hybrid-prulong-0.5-snapkv-patched-0.5", "cpu"), ("snapkv-naive-0.5-decode", "cpu")]
V2_COMPILED = ("prulong-0.7", "snapkv-patched-0.5")  # without --enforce-eager (slow tier)
# tensor and data parallel under V2 (tests/test_tensor_parallel.py, test_data_parallel.py):
# every column; CI a head mask's TP (the balanced head order) and token eviction's DP
V2_TP = tuple(TP_IDS)
V2_TP_CI = ()  # (CI's budget: TP 2's CI case and its soak run the V1 runner)
V2_DP = [(c, "cpu") for c in DP_IDS] + [("prulong 0.7", "flex"), ("snapkv patched", "flex")]
V2_DP_CI = ()  # (CI's budget: DP 2's CI case and its soak run the V1 runner)
# forced preemption under V2 (`--kv-admission vllm`): column -> test id; CI token eviction's
V2_PREEMPTION = {"snapkv patched": "snapkv-patched", "prulong 0.7": "prulong"}


@dataclass(frozen=True)
class Cell:
    status: str
    tests: tuple[str, ...]  # pytest node ids; "(s)" prefix: slow tier
    why: str = ""


@dataclass(frozen=True)
class Row:
    feature: str
    cells: dict[str, Cell]


C = "tests/test_compat.py::"


def each(status: str, test: str, columns=tuple(COLUMNS), why: str = "",
         ids: dict[str, str] | None = None) -> dict[str, Cell]:
    """One cell per column; `{id}` in `test` is the column's parameter id."""
    ids = ids or COLUMNS
    slow = lambda c: "(s)" if test.startswith(C) and c in SLOW_COLUMNS else ""
    return {c: Cell(status, (slow(c) + test.format(id=ids[c]),), why) for c in columns}


SPEC_IDS = {**COLUMNS, "pyramidkv naive": "pyramidkv-naive-0.5"}
SLOW_SPEC = ("full", "pyramidkv naive", "duo 0.3", "streaming", "snapkv naive",
             "snapkv patched", "pyramidkv patched")  # CI: a head mask (CI's budget)
ADMISSION = "tests/test_admission.py::"
ADMISSION_IDS = {"full": "full", "streaming": "streaming", "duo 0.3": "duo",
                 "prulong 0.7": "prulong", "snapkv naive": "snapkv-naive",
                 "snapkv patched": "snapkv", "pyramidkv naive": "pyramidkv-naive",
                 "pyramidkv patched": "pyramidkv-patched", HYBRID: "prulong-snapkv"}
TESTED_ADMISSION = ("prulong 0.7", "snapkv patched")  # both modes tested; the rest: stock only
RESERVE_IN_CI = ()  # reserve mode (the default) under pressure: slow tier (CI's budget)
FORCED_IN_CI = ("prulong 0.7",)  # CI: forced preemption under a head mask (prefix caching on)
# and its short soak (tests/test_admission.py); the rest: slow (CI's budget)

HYBRID_TEST = "tests/test_hybrid.py::"
HYBRID_UNTESTED = ("not yet tested with a token policy on a head mask, so refused at start-up "
                   "(--kv-token-policy)")

ROWS = [
    Row("feature off (greedy, 128-token chunks)",
        {**each("exact", C + "test_baseline_matches_reference[{id}]"),
         DECODE: Cell("exact", (f"(s){C}test_baseline_matches_reference[{COLUMNS[DECODE]}]",
                                f"{DECODE_TEST}[snapkv-naive-0.5]",
                                f"(s){DECODE_TEST}[pyramidkv-patched-0.7]"))}),
    Row("structured outputs (JSON schema)",
        each("exact", C + "test_structured_output_matches_constrained_reference[{id}]")),
    Row("`prompt_logprobs`",
        each("exact", C + "test_prompt_logprobs_match_reference[{id}]")),
    Row("teacher-forced tail (`vllm_xargs.kv_teacher_forced`, with `prompt_logprobs`)",
        each("exact", C + "test_teacher_forced_tail_matches_reference_decode[{id}]")),
    Row("`echo` + `logprobs`",
        each("exact", C + "test_echo_with_logprobs_matches_reference[{id}]")),
    Row("`n` > 1",
        each("exact", C + "test_n_children_are_each_the_reference[{id}]")),
    Row("`best_of`",
        each("n/a", "tests/test_compat_doc.py::test_vllm_api_has_no_best_of",
             why="vLLM 0.32's OpenAI API has no `best_of` (it ignores the field)")),
    Row("beam search (`use_beam_search`)",
        each("exact", C + "test_beam_search_matches_reference_beam_search[{id}]")),
    Row("LoRA adapter (`--enable-lora`)", {
        **each("exact", C + "test_lora_adapter_matches_merged_reference[{id}]",
               [c for c in COLUMNS if c not in PATCHED_COLUMNS]),
        **{c: Cell("refused", (
            f"tests/test_features.py::test_lora_refused_with_patched_eviction[{COLUMNS[c]}]",
            "tests/test_features.py::test_vllm_serve_refuses[lora]"),
            "patched eviction's question rows are extra tokens of the step that vLLM's LoRA "
            "layers do not index (the worker stopped on it); naive eviction serves LoRA")
           for c in PATCHED_COLUMNS}}),
    Row("`--max-num-seqs 1` (queued requests)",
        each("exact", C + "test_queued_requests_each_match_reference[{id}]")),
    Row("preemption (pool too small; `--kv-admission reserve` and `vllm`)", {
        **{c: Cell("exact", (
            ("" if c in RESERVE_IN_CI else "(s)")
            + f"{ADMISSION}test_no_preemption_and_exact_outputs_under_pressure"
              f"[{ADMISSION_IDS[c]}]",
            ("" if c in FORCED_IN_CI else "(s)")
            + f"{ADMISSION}test_forced_preemption_replays_exactly[{ADMISSION_IDS[c]}]",
            *((f"(s){ADMISSION}test_forced_preemption_replays_exactly[prulong-nopc]",)
              if c == "prulong 0.7" else ())))
           for c in TESTED_ADMISSION},
        **{c: Cell("exact", (
            f"(s){ADMISSION}test_forced_preemption_replays_exactly[{ADMISSION_IDS[c]}]",))
           for c in COLUMNS if c not in (*TESTED_ADMISSION, DECODE)},
        DECODE: Cell("exact", (f"(s){ADMISSION}test_forced_preemption_replays_exactly"
                               "[snapkv-decode]",))}),
    Row("prefix caching (vLLM's default)", {
        "full": Cell("exact", ("(s)" + C + "test_repeated_prompt_prefix_cache[full]",)),
        **{c: Cell("exact", (("(s)" if c in SLOW_COLUMNS else "") + C
                             + f"test_repeated_prompt_prefix_cache[{COLUMNS[c]}]",
                             *POOL_STORAGE(c),
                             *(("(s)tests/test_pool_storage.py::test_pool_storage_matches_reference"
                                "[prulong-0.7-dense]",) if c == "prulong 0.7" else ())),
                   "served from the cached sink + window blocks; hits at chunk boundaries and "
                   "inside a prompt's last chunk (vLLM's default retention), at any block with "
                   "`--prefix-cache-retention-interval None`")
           for c in HEAD_MASKS},
        **each("n/a", C + "test_repeated_prompt_prefix_cache[{id}]", NOT_CACHING,
               why="switched off at start-up for token-evicting policies unless asked for "
                   "(logged; `/v1/kv_stats` shows it): patched scoring uses the prompt's last "
                   "tokens; naive eviction serves it when asked for, patched under a declared "
                   "reuse mode (next row)")}),
    Row("`--enable-prefix-caching` asked for explicitly", {
        "full": Cell("exact", ("(s)" + C + "test_repeated_prompt_prefix_cache[full]",)),
        **{c: Cell("refused", (
            f"tests/test_features.py::test_explicit_prefix_caching"
            f"[{COLUMNS[c]}]", "tests/test_features.py::test_vllm_serve_refuses[prefix-caching]"))
           for c in NOT_CACHING if c not in TOKEN_CACHING + PATCHED_REUSE},
        **{c: Cell("exact", (
            "(s)tests/test_token_prefix_cache.py::"
            f"test_patched_reuse_across_questions_matches_the_reference[{COLUMNS[c]}]",
            "tests/test_token_prefix_cache.py::"
            "test_the_ledger_tells_which_reused_chunks_another_question_selected",
            "tests/test_token_prefix_cache.py::test_patched_reuse_is_a_declared_opt_in",
            f"tests/test_features.py::test_explicit_prefix_caching[{COLUMNS[c]}]",
            *(("tests/test_token_prefix_cache.py::"
               "test_a_head_mask_with_a_token_policy_hits_every_group_at_one_boundary",
               "(s)tests/test_token_prefix_cache.py::test_prefix_hits_match_the_reference"
               "[hybrid-prulong-0.5-snapkv-naive-0.5]") if c == HYBRID else ())),
            "under the declared mode `--kv-prefix-reuse across-questions` (refused without "
            "it): a hit reuses chunks selected under the earlier request's question, as the "
            "reference given those questions; kv_stats counts them "
            "(`reused_chunks_other_question`). A head mask with a token policy (snapkv; "
            "pyramidkv refused): its streaming heads' sink + window blocks are keyed at the "
            "same chunk boundaries, registered with the full heads' rows; naive eviction "
            "there is exact without the mode")
           for c in PATCHED_REUSE},
        **{c: Cell("exact", (
            ("(s)" if c == "snapkv naive" else "") + "tests/test_token_prefix_cache.py::"
            f"test_prefix_hits_match_the_reference[{COLUMNS[c]}]",
            "tests/test_token_prefix_cache.py::"
            "test_manager_hits_the_last_cached_boundary_and_copies_the_partial_tail",
            f"tests/test_features.py::test_explicit_prefix_caching[{COLUMNS[c]}]",
            *(("(s)tests/test_tensor_parallel.py::"
               "test_tp2_prefix_caching_with_naive_token_eviction",
               "(s)tests/test_data_parallel.py::"
               "test_dp2_prefix_caching_with_naive_token_eviction",
               "(s)tests/test_token_prefix_cache.py::test_prefix_hits_with_a_lora_adapter")
              if c == "snapkv naive" else ())),
            "a hit at a chunk boundary (`--kv-eviction-chunk`, by default the step budget) "
            "reuses the compacted blocks; tensor and data parallel (each replica its own "
            "cache) and LoRA adapters (vLLM's block hashes name the adapter and the "
            "cache_salt) too; no "
            "speculative decoding yet")
           for c in TOKEN_CACHING},
        **{c: Cell("exact", ("tests/test_features.py::"
                             f"test_explicit_prefix_caching[{COLUMNS[c]}]",
                             *POOL_STORAGE(c)))
           for c in HEAD_MASKS}}),
    Row("KV connector (`--kv-transfer-config`)", {
        "full": Cell("exact", ("tests/test_vllm_features.py::"
                               "test_full_policy_with_the_users_kv_connector_keeps_kv_stats",)),
        **{c: Cell("refused", (
            f"tests/test_features.py::test_connector_refused[{COLUMNS[c]}]",
            "tests/test_vllm_features.py::"
            "test_evicting_policy_with_a_kv_connector_is_refused_at_startup"))
           for c in EVICTING}}),
    Row("fp8 KV cache (`--kv-cache-dtype fp8`, also `fp8_e4m3`, `fp8_e5m2`)",
        {**{c: Cell("exact", (("" if c in FP8_CI else "(s)")
                           + f"tests/test_fp8.py::test_fp8_serves_the_reference_tokens"
                           f"[{TP_IDS[c]}]",
                           *(("(s)tests/test_serve_full.py::test_full_policy_fp8_is_stock",)
                             if c == "full" else ()),
                           *(("tests/test_fp8.py::test_fp8_serves_the_reference_tokens"
                              "[kv4-prulong-0.7-fast-layout]",) if c == "prulong 0.7" else ())),
                 "against the reference quantizing its cache as vLLM's CPU kernels do (prulong "
                 "with no --block-size too: the fast layout); refused "
                 "with --kv-eviction-chunk (tests/test_features.py::test_vllm_serve_refuses"
                 "[fp8])")
         for c in COLUMNS if c not in (HYBRID, DECODE)},
         DECODE: DECODE_REFUSED("fp8"),
         HYBRID: Cell("exact", ("(s)" + HYBRID_TEST + "test_hybrid_serves_the_reference_tokens"
                                              "[snapkv-patched-h0.5-t0.5-c128-fp8]",),
                      "against the reference quantizing its cache as vLLM's CPU kernels do; "
                      "refused with --kv-eviction-chunk (tests/test_features.py::"
                      "test_vllm_serve_refuses[fp8])")}),
    Row("compile mode (no `--enforce-eager`)", {
        **{c: Cell("exact", ("(s)tests/test_vllm_features.py::"
                             f"test_compiled_mode_matches_reference[{COLUMNS[c]}]",))
           for c in ("prulong 0.7", "pyramidkv patched", HYBRID, DECODE)},
        **{c: Cell("exact", ("(s)scripts/policy_matrix.py --compiled",))
           for c in COLUMNS if c not in ("prulong 0.7", "pyramidkv patched", HYBRID, DECODE)}}),
    Row("speculative decoding, ngram", {
        **{c: Cell("exact", (("(s)" if c in SLOW_SPEC else "") + "tests/test_speculative.py::"
                             f"test_ngram_speculation_matches_one_token_decode[{SPEC_IDS[c]}]",))
           for c in COLUMNS if c not in (HYBRID, DECODE)},
        DECODE: DECODE_REFUSED("spec"),
        HYBRID: Cell("refused", (HYBRID_TEST + "test_hybrid_refuses_what_it_is_not_tested_with",),
                     HYBRID_UNTESTED)}),
    Row("speculative decoding, draft model / EAGLE / MTP / medusa / suffix",
        each("refused", "tests/test_speculative.py::test_speculative_methods_refused_or_served",
             why="a drafter's own layers would run through the policy's attention")),
    Row("prompt embeddings (`--enable-prompt-embeds`)",
        {c: Cell("refused", (f"tests/test_features.py::test_prompt_embeds_refused[{COLUMNS[c]}]",),
                 "untested: patched eviction appends question rows to the input ids that "
                 "embeddings replace") for c in COLUMNS}),
    Row("per-request `seed` with a prompt longer than one step",
        each("exact", C + "test_seeded_sampling_over_several_prefill_steps_matches_reference[{id}]")),
    Row("async scheduling (`--async-scheduling`)",
        each("n/a", "tests/test_vllm_contract.py::test_cpu_platform_turns_async_scheduling_off",
             why="vLLM 0.32's CPU platform turns it off; off the CPU platform the plugin turns "
                 "it off for a policy and refuses it asked for (untested)")),
    Row("vLLM's V2 model runner (`VLLM_USE_V2_MODEL_RUNNER=1`; the default where Triton runs)",
        {c: Cell("exact", tuple(("" if (COLUMNS[c], b) in V2_CI else "(s)")
                                + f"tests/test_v2_runner.py::test_v2_runner_serves_the_reference"
                                  f"[{COLUMNS[c]}-{b}]" for b in ("cpu", "flex")
                                if (COLUMNS[c], b) in V2_CI + V2_SLOW)
                 + (("(s)tests/test_v2_runner.py::test_v2_runner_compiled_serves_the_"
                     f"reference[{COLUMNS[c]}]",) if COLUMNS[c] in V2_COMPILED else ())
                 + (("(s)"  # (CI's budget)
                     + "tests/test_v2_runner.py::test_v2_runner_preemption_replays_exactly"
                       f"[{V2_PREEMPTION[c]}]",) if c in V2_PREEMPTION else ())
                 + ((("" if c in V2_TP_CI else "(s)") + "tests/test_tensor_parallel.py::test_tp2_"
                     f"under_the_v2_runner_serves_the_reference_tokens[{TP_IDS[c]}]",)
                    if c in V2_TP else ())
                 + (("tests/test_v2_runner.py::test_v2_runner_fast_layout_serves_the_reference"
                     "[prulong-0.7-fast-layout]",
                     "(s)tests/test_tensor_parallel.py::test_tp2_fast_layout_serves_the_"
                     "reference_tokens[v2]") if c == "prulong 0.7" else ())
                 + tuple(("" if (c, b) in V2_DP_CI else "(s)") + "tests/test_data_parallel.py::"
                         f"test_dp2_serves_the_reference_tokens_per_replica[{DP_IDS[c]}-{b}-v2]"
                         for b in ("cpu", "flex") if (c, b) in V2_DP),
                 "vLLM 0.32's V2 runner, its Triton kernels in Triton's interpreter (no Triton "
                 "CPU backend here): a batch of three prompts, then a repeat (a prefix hit where "
                 "the policy caches); compiled too (prulong, patched snapkv); forced preemption "
                 "(patched snapkv, prulong); tensor parallel 2 and data parallel 2 (tiny Qwen3, "
                 "4 KV heads); prulong's fast layout, alone and at TP 2; fp8, "
                 "speculation or LoRA under V2: "
                 "refused (tests/test_features.py::test_v2_model_runner_refuses_what_is_untested_"
                 "there)")
         for c in COLUMNS}),
    Row("FlexAttention path (`--kv-attention-backend flex`, 256-token chunks)",
        {**{c: Cell("exact", (("" if c in FLEX_CI else "(s)")
                              + f"tests/test_flex_vllm.py::test_flex_matches_reference"
                                f"[{COLUMNS[c]}]",),
                    "vLLM's FlexAttention backend, subclassed (docs/flex_attention.md): head "
                    "masks as block-sparse masks, streaming heads' blocks freed in vLLM's "
                    "pool as on the CPU path (a cache layer per KV head, layer-outer; prefix "
                    "caching on, tests/test_flex_vllm.py::"
                    "test_flex_prefix_cache_hits_match_reference); token eviction as on the "
                    "CPU path")
            for c in COLUMNS if c not in (HYBRID, DECODE)},
         DECODE: Cell("exact", (f"(s){DECODE_TEST}[snapkv-naive-0.5-flex]",),
                      "decode-time eviction on the flex path: three prompts at once, 100 tokens "
                      "each, a compression every 32"),
         HYBRID: Cell("exact", ("(s)tests/test_flex_vllm.py::test_flex_matches_reference"
                                "[hybrid-prulong-0.5-snapkv-patched-0.5]",
                                "(s)tests/test_flex_vllm.py::test_flex_matches_reference"
                                "[hybrid-prulong-0.5-snapkv-naive-0.5]",
                                "(s)tests/test_flex_vllm.py::test_flex_eviction_chunk_over_several"
                                "_steps[hybrid-prulong-0.5-snapkv-patched-0.5]",
                                "tests/test_flex_vllm.py::test_streaming_question_rows_see_what_"
                                "the_cpu_path_lays_out[canonical-32]",
                                "(s)tests/test_tensor_parallel.py::test_tp2_flex_serves_the_reference"
                                f"_tokens[{HYBRID}]"),
                      "full heads evicting tokens in their head slots, streaming heads "
                      "block-sparse, patched scoring's question rows on both; TP 2 too")}),
    Row("Triton path (`--kv-attention-backend triton`, Triton's interpreter on the CPU)",
        {c: Cell("exact", (("" if c == "prulong 0.7" else "(s)")
                           + f"tests/test_triton_vllm.py::test_triton_matches_reference"
                             f"[{COLUMNS[c]}]",)
                 + ((("(s)" if TRITON_TINY[c] in TRITON_TINY_SLOW else "")
                     + "tests/test_triton_vllm.py::test_triton_serves_the_reference_on_a_tiny_"
                       f"model[{TRITON_TINY[c]}]",) if c in TRITON_TINY else ()),
                 "our head-pages kernel (docs/kernels.md) over the flex path's storage: a head "
                 "mask's full and streaming heads in one launch per layer; token eviction's "
                 "heads over their kept pages at the step plan's slots, patched questions as "
                 "extra rows (the hybrid's streaming heads: a second launch, their question rows "
                 "dense); the bundled model's 300-token prompts in 256-token steps, then a "
                 "repeat (a prefix hit where the policy caches); CI: prulong 0.7 so, snapkv + "
                 "decode-time eviction and the hybrid on a tiny random llama3 (4 layers, 2 KV "
                 "heads), 300 tokens in 128-token steps")
         for c in COLUMNS}),
    Row("tensor parallel (`--tensor-parallel-size 2`)",
        {**{c: Cell("exact", (("" if c in TP_CI else "(s)")
                              + "tests/test_tensor_parallel.py::"
                              f"test_tp2_serves_the_reference_tokens[{TP_IDS[c]}]",
                              *(("(s)tests/test_tensor_parallel.py::test_tp2_serves_the_reference"
                                 "_tokens[kv1-replicated-prulong-0.7]",
                                 "(s)tests/test_tensor_parallel.py::test_tp2_fast_layout_serves_"
                                 "the_reference_tokens[v1]")
                                if c == "prulong 0.7" else ()),
                              *(("(s)tests/test_tensor_parallel.py::test_tp2_serves_the_reference"
                                 "_tokens[kv1-replicated-snapkv-patched-0.5]",)
                                if c == "snapkv patched" else ())),
                    "when the ranks split the KV heads evenly, a head mask's heads in the "
                    "balanced order (--kv-tp-head-order), the fast layout's blocks where the "
                    "sink fills them (prulong); with fewer KV heads than ranks (vLLM "
                    "replicates them) every policy but the hybrid is served, token eviction "
                    "gathering a replicated head's score from its replicas' query shares (the "
                    "hybrid refused: tests/test_features.py::test_parallel_layouts)")
            for c in COLUMNS}}),
    Row("data parallel (`--data-parallel-size 2`, two API servers)",
        {**{c: Cell("exact", (("" if c in DP_CI else "(s)")
                              + "tests/test_data_parallel.py::"
                              f"test_dp2_serves_the_reference_tokens_per_replica[{DP_IDS[c]}]",
                              *((f"(s)tests/test_data_parallel.py::test_dp2_serves_the_reference_"
                                 f"tokens_per_replica[{DP_IDS[c]}-flex]",)
                                if c in ("prulong 0.7", "snapkv patched") else ())),
                    "one engine core per replica, kv_stats naming it (on the flex path too); "
                    "vLLM's default of one API server per replica: lookups, aggregates and the "
                    "live view the same from each, every request counted once in /metrics")
            for c in COLUMNS}}),
    Row("pipeline parallel (> 1)",
        {c: Cell("refused", (f"tests/test_features.py::test_parallel_layouts[{COLUMNS[c]}]",
                             "tests/test_features.py::test_vllm_serve_refuses[pp]",
                             "(s)tests/test_pipeline_parallel.py::"
                             "test_stock_vllm_cpu_pipeline_parallel_fails_on_its_first_request"),
                 "not built (other layers per pipeline stage), and vLLM CPU 0.32's own pipeline "
                 "parallel fails on its first request without the plugin (AssertionError in "
                 "GPUModelRunner.sync_and_gather_intermediate_tensors on the second stage)")
         for c in COLUMNS}),
]


def node_ids() -> list[str]:
    """Every pytest node id the matrix names (slow ones included, scripts excluded)."""
    out = []
    for row in ROWS:
        for cell in row.cells.values():
            out += [t.removeprefix("(s)") for t in cell.tests if "::" in t]
    return sorted(set(out))


def slow_node_ids() -> set[str]:
    """The node ids the matrix marks (s): they must be exactly the slow-tier ones it names."""
    return {t.removeprefix("(s)") for row in ROWS for cell in row.cells.values()
            for t in cell.tests if t.startswith("(s)") and "::" in t}


def render() -> str:
    names = list(COLUMNS)
    lines = [
        "# Compatibility: vLLM features x KV policies",
        "",
        "Generated by `python tests/compat_matrix.py` (the table's source; "
        "`tests/test_compat_doc.py` keeps this page equal to it and checks every test it names "
        "exists). **exact**: the served tokens with the feature on equal the plain-PyTorch "
        "reference doing the same (greedy; log-probs within 2e-3 where compared). **refused**: "
        "the server stops at start-up with one line naming the flag. **n/a**: see the note. "
        "Cells marked ° are checked by slow-tier tests (`pytest -m slow`) or a script run "
        "(`docs/results/policy_matrix-compiled/`), not in CI; the rest run in CI (`make test`). "
        "The Triton path's row: its cells ran on 78c211c, 15 passed (`pytest "
        "tests/test_triton_vllm.py -m '' -k 'matches_reference or tiny'`, 28 minutes on two "
        "cores); each other row's cells as of the commit its tests last ran on.",
        "",
        "Policies as tested: streaming sink 16 / window 64; duo and prulong at sparsity 0.3 / 0.7 "
        "with the shipped masks; snapkv at 0.5; pyramidkv naive at 0.5 with 3 tiers, patched "
        "at 0.7; the bundled SmolLM2-135M-Instruct in float32, vLLM CPU 0.32.0. The preemption, "
        "speculation, connector and compile-mode rows use their own tests' settings (e.g. "
        "sparsity 0.9 in pools of a few blocks). The tensor-parallel and fp8 rows run on a tiny "
        "random Qwen3 with 4 KV heads (tests/test_tensor_parallel.py, tests/test_fp8.py); fp8 "
        "under `full` is also compared with stock vLLM on the same fp8 cache, bit for bit. "
        "The streaming, duo and prulong columns keep their streaming heads in vLLM's block "
        "pool with prefix caching on (vLLM's default). "
        "The last column is a head mask composed with token eviction (`--kv-policy prulong "
        "--kv-sparsity 0.5 --kv-token-policy snapkv --kv-token-sparsity 0.5`, sink 16 / window "
        "64, the shipped mask; its fp8 row on the tiny Qwen3 with a random mask); also tested "
        "in tests/test_hybrid.py, tests/test_admission.py and tests/test_pool_no_leak.py. "
        "The column after it is snapkv naive 0.5 with decode-time eviction (`--kv-decode-budget "
        "64 --kv-decode-interval 4`: a compression every 4 generated tokens, so the rows' short "
        "generations compress too); also tested in tests/test_decode_eviction.py (pyramidkv, "
        "per-request budgets, blocks returned) and tests/test_admission.py.",
        "",
        "| feature | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    notes: list[str] = []
    for row in ROWS:
        cells = []
        for name in names:
            cell = row.cells[name]
            mark = "°" if any(t.startswith("(s)") for t in cell.tests) else ""
            text = cell.status + mark
            if cell.why:
                if cell.why not in notes:
                    notes.append(cell.why)
                text += f" [{notes.index(cell.why) + 1}]"
            cells.append(text)
        lines.append(f"| {row.feature} | " + " | ".join(cells) + " |")
    lines += ["", *[f"[{i + 1}] {n}" for i, n in enumerate(notes)], "", "## Tests per cell", ""]
    for row in ROWS:
        lines.append(f"- {row.feature}:")
        by_test: dict[str, list[str]] = {}  # test (without its parameter) -> columns
        for name in names:
            for test in row.cells[name].tests:
                slow = test.startswith("(s)")
                shown = f"`{test.removeprefix('(s)').split('[')[0]}`"
                if slow:
                    shown += (" (slow)" if "::" in test else
                              " (script run, `docs/results/policy_matrix-compiled/`)")
                if name not in by_test.setdefault(shown, []):
                    by_test[shown].append(name)
        for shown, cols in by_test.items():
            lines.append(f"  - {shown}: {'all' if cols == names else ', '.join(cols)}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render(), end="")
