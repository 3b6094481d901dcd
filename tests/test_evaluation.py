"""The evaluation package: generated tasks (exact lengths, determinism, scorers), the critical
KV footprint and its bootstrap, bisection and cost planning, resumable results, the report, and
one small run through real `vllm serve` processes (`-m server`)."""

from __future__ import annotations

import json
import math
import random
import re

import numpy as np
import pytest
import torch

from vllm_kvevict.evaluation import grid, tasks
from vllm_kvevict.evaluation.client import example_id
from vllm_kvevict.evaluation.critical import Critical, critical_footprint, percentile_interval
from vllm_kvevict.evaluation.curves import build_curves
from vllm_kvevict.evaluation.report import load_records, report
from vllm_kvevict.evaluation.runner import ResultStore, category_scores
from vllm_kvevict.evaluation.tasks import (DEFAULT_TASKS, TASKS, PromptBuilder, make_example,
                                           score_label, score_recall)


@pytest.fixture(scope="module")
def tokenizer(bundled_model_dir):
    return tasks.load_tokenizer(str(bundled_model_dir))


@pytest.fixture(scope="module")
def builder(tokenizer):
    return PromptBuilder(tokenizer)


# ------------------------------------------------------------------------------- tasks

@pytest.mark.parametrize("task", sorted(TASKS))
@pytest.mark.parametrize("length", [1024, 2048, 4096, 8000])
def test_every_task_has_the_exact_length(builder, task, length):
    ex = make_example(builder, task, length, index=3)
    assert len(ex.prompt_ids) == length
    assert 0 <= ex.padding <= tasks.MAX_PADDING


@pytest.mark.parametrize("task", sorted(TASKS))
def test_generation_is_deterministic_and_varies_with_index_and_seed(builder, task):
    a = make_example(builder, task, 2048, 0)
    assert make_example(builder, task, 2048, 0) == a
    assert make_example(builder, task, 2048, 1).prompt_ids != a.prompt_ids
    assert make_example(builder, task, 2048, 0, seed=1).prompt_ids != a.prompt_ids
    assert example_id(a) == example_id(make_example(builder, task, 2048, 0))


@pytest.mark.parametrize("task", sorted(TASKS))
def test_prompt_is_a_chat_turn_with_the_question_in_the_observation_window(tokenizer, builder,
                                                                             task):
    ex = make_example(builder, task, 2048, 5)
    text = tokenizer.decode(list(ex.prompt_ids))
    assert text.startswith("<|im_start|>system\n")
    head, _, answer_turn = text.rpartition("<|im_start|>assistant\n")
    assert head.rstrip().endswith("<|im_end|>")
    # The question and the assistant's opening fit in patched eviction's 64-token window.
    window = tokenizer.decode(list(ex.prompt_ids[-grid.OBS_WINDOW:]))
    assert "?" in window or "item:" in window, window
    assert "<|im_start|>assistant" in window
    # The answer is in the context (labels: shown in the demonstrations); a needle is never
    # in the question window, so it has to come from far back (common words: everywhere).
    for answer in ex.answers:
        assert answer in head
        if ex.scorer == "recall" and ex.category != "aggregation":
            assert answer not in window


def test_needles_sit_outside_the_local_window(tokenizer, builder):
    """Depths are drawn in [0.05, 0.85]: the needle is never among the last 300 tokens of a
    2K prompt, where a streaming head (sink 64 + window 256) would still see it."""
    for i in range(10):
        ex = make_example(builder, "niah_single", 2048, i)
        tail = tokenizer.decode(list(ex.prompt_ids[-300:]))
        assert ex.answers[0] not in tail


def test_multikey_needles_are_all_present_and_distinct(tokenizer, builder):
    ex = make_example(builder, "niah_multikey", 4096, 2)
    text = tokenizer.decode(list(ex.prompt_ids))
    needles = re.findall(r"The special magic number for (\w+) is: (\d+)\.", text)
    assert len(needles) == 2
    assert len({k for k, _ in needles}) == 2 and len({v for _, v in needles}) == 2
    asked = re.search(r"number for (\w+) mentioned in the provided text is$", text).group(1)
    assert dict(needles)[asked] == ex.answers[0]


def test_prompt_builder_matches_the_chat_template(tokenizer, builder):
    """Tokenizing the pieces separately gives the same ids as the rendered template here."""
    content = "Hello there.\n\nWhat is it?"
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                             add_generation_prompt=True, tokenize=False)
    whole = tokenizer.encode(rendered, add_special_tokens=False)
    assert builder.head + builder.encode("Hello there.") + builder.encode("\n\nWhat is it?") \
        + builder.tail == whole


def test_vocabulary_words_are_short_and_keys_start_differently(tokenizer):
    from vllm_kvevict.evaluation import vocabulary as vocab

    firsts = [tokenizer.encode(" " + w, add_special_tokens=False)[0] for w in vocab.KEY_WORDS]
    assert len(set(firsts)) == len(firsts)
    for w in vocab.KEY_WORDS:
        assert len(tokenizer.encode(" " + w, add_special_tokens=False)) <= 2, w
    words = [w for ws in vocab.CATEGORIES.values() for w in ws]
    assert len(words) == len(set(words)), "a word in two categories has no single label"


def test_icl_labels_are_single_tokens_and_restricted(builder):
    ex = make_example(builder, "icl_classify", 2048, 0)
    assert ex.allowed_token_ids is not None and ex.max_tokens == 1
    assert len(ex.allowed_token_ids) == 10
    label_id = builder.encode(ex.answers[0])
    assert len(label_id) == 1 and label_id[0] in ex.allowed_token_ids


def test_examples_are_dealt_per_category(builder):
    exs = tasks.make_examples(builder, ["niah_single", "niah_uuid", "icl_classify"], [1024], 3)
    keys = [e.key for e in exs]
    assert keys == ["niah_single/1024/0", "niah_uuid/1024/0", "niah_single/1024/1",
                    "icl_classify/1024/0", "icl_classify/1024/1", "icl_classify/1024/2"]


def test_unknown_task_is_refused(builder):
    with pytest.raises(ValueError, match="unknown task"):
        tasks.make_examples(builder, ["no_such_task"], [1024], 1)


def test_default_tasks_exist():
    assert set(DEFAULT_TASKS) <= set(TASKS)


# ----------------------------------------------------------------------------- scorers

@pytest.mark.parametrize("prediction,answers,expected", [
    (" 4821.", ["4821"], 1.0),
    (" 48213.", ["4821"], 0.0),          # a longer number is not the answer
    (" 14821", ["4821"], 0.0),
    ("The number is 4821, I think", ["4821"], 1.0),
    (" 1234", ["4821"], 0.0),
    (":\n1. 6484\n2. 4012\n3. 69", ["6484", "4012", "6962"], 2 / 3),
    (" RED and Blue", ["red", "blue"], 1.0),  # case-insensitive
    (" redo", ["red"], 0.0),                  # whole words only
    (" f22db1", ["f22db1"], 1.0),
    ("", ["4821"], 0.0),
])
def test_score_recall(prediction, answers, expected):
    assert score_recall(prediction, answers) == pytest.approx(expected)


def test_score_recall_needs_an_answer():
    with pytest.raises(ValueError):
        score_recall("x", [])


@pytest.mark.parametrize("prediction,expected", [
    ("7", 1.0), (" 7\n", 1.0), ("3", 0.0), (" 3 7", 0.0), ("", 0.0), ("seven", 0.0)])
def test_score_label_takes_the_first_word(prediction, expected):
    assert score_label(prediction, ["7"]) == expected


# ---------------------------------------------------------------------- critical footprint

def test_interpolates_between_the_bracketing_points():
    # threshold 0.9 between (0.4, 0.8) and (0.6, 1.0): halfway -> 0.5
    c = critical_footprint([0.2, 0.4, 0.6, 0.8], [0.5, 0.8, 1.0, 1.0], 0.9)
    assert c.kind == "interpolated" and c.value == pytest.approx(0.5)
    assert c.format() == "50.0"


def test_input_order_does_not_matter():
    a = critical_footprint([0.8, 0.2, 0.6, 0.4], [1.0, 0.5, 1.0, 0.8], 0.9)
    assert a.value == pytest.approx(0.5)


def test_a_point_exactly_at_the_threshold_counts_as_reached():
    c = critical_footprint([0.3, 0.5, 0.9], [0.2, 0.9, 1.0], 0.9)
    assert c.kind == "interpolated" and c.value == pytest.approx(0.5)


def test_always_reached_is_censored_at_the_smallest_footprint():
    c = critical_footprint([0.3, 0.6, 0.9], [0.95, 0.97, 1.0], 0.9)
    assert c.kind == "always" and c.value == pytest.approx(0.3)
    assert c.format() == "<30.0"


def test_never_reached_is_censored_at_the_largest_footprint():
    c = critical_footprint([0.3, 0.6, 0.93], [0.1, 0.5, 0.85], 0.9)
    assert c.kind == "never" and c.value == pytest.approx(0.93)
    assert c.format() == ">93.0"


def test_a_lucky_low_point_under_a_failure_does_not_count():
    # From the top: 0.9 passes, 0.7 fails -> the crossing is between 0.7 and 0.9, although
    # the point at 0.3 scores high again.
    c = critical_footprint([0.3, 0.5, 0.7, 0.9], [1.0, 0.5, 0.7, 1.0], 0.9)
    assert c.kind == "interpolated"
    assert c.value == pytest.approx(0.7 + (0.9 - 0.7) * (0.2 / 0.3))


def test_undefined_without_points_or_with_a_zero_reference():
    assert critical_footprint([], [], 0.9).kind == "undefined"
    assert critical_footprint([0.5], [0.0], 0.0).kind == "undefined"
    assert critical_footprint([0.5], [1.0], 0.0).format() == "n/a"


def test_percentile_interval_keeps_censored_ends():
    samples = ([Critical("always", 0.3)] * 5 + [Critical("interpolated", v) for v in
               np.linspace(0.35, 0.6, 90)] + [Critical("never", 0.95)] * 5)
    lo, hi = percentile_interval(samples)
    assert lo.kind == "always" and hi.kind == "never"
    inner = [Critical("interpolated", v) for v in np.linspace(0.4, 0.6, 101)]
    lo, hi = percentile_interval(inner)
    # 101 sorted values: the 2.5 % and 97.5 % ends are real replicates (no interpolation)
    assert lo.value == pytest.approx(0.404) and hi.value == pytest.approx(0.596)
    assert percentile_interval([Critical("undefined", math.nan)])[0].kind == "undefined"


# -------------------------------------------------------------- curves, bootstrap, report

def synthetic_records(n_per_task: int = 6, seed: int = 0, naive_drop: float = 1.2,
                      patched_drop: float = 0.6) -> list[dict]:
    """Two categories; head-mask curves decay with sparsity, patched better than naive
    (score falls by `*_drop` x sparsity)."""
    rng = random.Random(seed)
    task_cat = {"t_recall_a": "recall", "t_recall_b": "recall", "t_icl": "icl"}
    records = []

    def add(method, sparsity, eviction, chunk, footprint, p_correct):
        for task, category in task_cat.items():
            for i in range(n_per_task):
                key = f"{method}/{eviction}/{sparsity}/{chunk}"
                records.append({
                    "setting": key, "method": method, "eviction": eviction,
                    "sparsity": sparsity, "chunk": chunk, "example": f"{task}/2048/{i}/x",
                    "task": task, "category": category, "length": 2048, "index": i,
                    # Fractional scores (as multi-value recall gives) around the curve.
                    "score": min(1.0, max(0.0, p_correct + rng.uniform(-0.15, 0.15))),
                    "footprint": footprint + rng.uniform(-0.01, 0.01),
                    "measured_footprint": footprint * 1.05, "peak_kv": footprint * 0.9})

    for chunk in (256, 1024):
        add("full", None, None, chunk, 1.0, 0.9)
        add("streaming", None, None, chunk, 0.2, 0.1)
        for s in (0.1, 0.3, 0.5, 0.7, 0.9):
            add("prulong", s, None, chunk, 1.0 - 0.8 * s, 0.9 - 0.8 * max(0.0, s - 0.4))
            for ev, drop in (("naive", naive_drop), ("patched", patched_drop)):
                add("pyramidkv", s, ev, chunk, 1.0 - 0.9 * s, 0.9 - drop * s)
    return records


def test_curves_pair_full_and_streaming_with_the_sweeps():
    curves, notes = build_curves(synthetic_records())
    assert not notes
    labels = {(c.method, c.chunk, c.category) for c in curves}
    assert ("prulong", 256, "recall") in labels and ("pyramidkv-patched", 1024, "icl") in labels
    prulong = next(c for c in curves if c.method == "prulong" and c.chunk == 256
                   and c.category == "recall")
    assert prulong.sparsities == [0.1, 0.3, 0.5, 0.7, 0.9, 1.0]  # streaming closes the curve
    assert prulong.scores.shape == (6, 12)  # 2 recall tasks x 6 examples


def test_a_newer_run_of_the_same_point_replaces_the_older_one():
    records = synthetic_records()
    newer = [dict(r, setting=r["setting"] + "/mask=new", run="2", score=0.0)
             for r in records if r["method"] == "prulong" and r["sparsity"] == 0.5]
    curves, notes = build_curves([dict(r, run="1") for r in records] + newer)
    assert any("newest run" in n for n in notes)
    prulong = next(c for c in curves if c.method == "prulong" and c.chunk == 256
                   and c.category == "recall")
    assert prulong.point_scores()[prulong.sparsities.index(0.5)] == 0.0


def test_category_score_is_the_mean_of_task_means():
    records = [
        {"category": "c", "task": "a", "score": 1.0},
        {"category": "c", "task": "a", "score": 1.0},
        {"category": "c", "task": "a", "score": 1.0},
        {"category": "c", "task": "b", "score": 0.0},
    ]
    assert category_scores(records) == {"c": 0.5}


def test_bootstrap_is_deterministic_per_seed_and_brackets_the_estimate():
    curves, _ = build_curves(synthetic_records(n_per_task=10))
    curve = next(c for c in curves if c.method == "pyramidkv-patched" and c.chunk == 256
                 and c.category == "recall")
    a = curve.bootstrap(200, seed=1)
    assert [x.sort_value for x in a] == [x.sort_value for x in curve.bootstrap(200, seed=1)]
    assert [x.sort_value for x in a] != [x.sort_value for x in curve.bootstrap(200, seed=2)]
    lo, hi = curve.interval(400, seed=1)
    point = curve.critical()
    assert lo.sort_value <= point.sort_value <= hi.sort_value


def test_missing_points_are_reported_not_silently_dropped():
    records = [r for r in synthetic_records() if not (
        r["method"] == "prulong" and r["sparsity"] == 0.5 and r["index"] == 0)]
    curves, notes = build_curves(records)
    assert any("prulong" in n and "examples answered" in n for n in notes)
    prulong = next(c for c in curves if c.method == "prulong" and c.category == "icl")
    assert len(prulong.examples) == 5


def test_report_writes_the_table_and_the_plot(tmp_path):
    results = tmp_path / "results.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in synthetic_records()))
    (tmp_path / "command.txt").write_text("python -m vllm_kvevict.evaluation run X\n")
    table, plot = report(results, tmp_path / "out", replicates=50, seed=0,
                         command="python -m vllm_kvevict.evaluation run X")
    text = table.read_text()
    for needle in ("**2048-token prompts, prefill chunk 256**",
                       "**2048-token prompts, prefill chunk 1024**", "→ PruLong",
                   "PyramidKV (naive)", "→ PyramidKV (patched)", "| Method | Recall | ICL |",
                   "measured footprint", "## Full attention", "run X"):
        assert needle in text, needle
    assert "## The paper's comparisons" in text and "## Chunk-size sensitivity" in text
    # Each method row has one cell per category, each with a bracketed interval.
    row = next(line for line in text.splitlines() if line.startswith("| → PruLong"))
    assert row.count("[") == 2
    # ... and the number of examples the curve pairs across its points
    curves, _ = build_curves(synthetic_records())
    n = {len(c.examples) for c in curves if c.method == "prulong"}
    assert row.count("(") == 2 and all(f"] ({k})" in row for k in n), row
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 10_000


def test_tasks_full_attention_fails_leave_the_curves_with_a_note(tmp_path):
    """A task enters the curves only where full attention clears its category's bar (80 %;
    ICL 60 %) at that prompt length; the full-attention table still shows it."""
    from vllm_kvevict.evaluation.report import headline_records

    records = synthetic_records()
    for r in records:
        if r["method"] == "full":  # t_recall_b at 75 %, t_icl at 65 % (both exact)
            r["score"] = {"t_recall_b": 0.75, "t_icl": 0.65}.get(r["task"], r["score"])
    kept, notes = headline_records(records)
    assert {r["task"] for r in kept} == {"t_recall_a", "t_icl"}
    assert notes == ["t_recall_b at 2048 tokens is left out of the curves: full attention "
                     "scores 75.0 % on it (6 examples), below the 80 % bar for recall tasks "
                     "(its records stay in the results file and in the full-attention table)"]
    results = tmp_path / "results.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in records))
    table, _ = report(results, tmp_path / "out", replicates=20, seed=0)
    text = table.read_text()
    assert notes[0] in text and "| t_recall_b | 6 | 75.0 |" in text
    curves, _ = build_curves(kept)
    recall = next(c for c in curves if c.method == "prulong" and c.category == "recall")
    assert all(e.startswith("t_recall_a/") for e in recall.examples)


def test_paired_comparison_sees_the_better_method():
    """Synthetic: naive PyramidKV misses 90 % already at its largest footprint, patched keeps
    it down to high sparsity, so patched is lower in (nearly) every paired replicate; a curve
    against itself ties."""
    from vllm_kvevict.evaluation.report import probability_lower

    curves, _ = build_curves(synthetic_records(n_per_task=20, naive_drop=2.0,
                                               patched_drop=0.05))
    pick = {(c.method, c.chunk, c.category): c for c in curves}
    patched = pick[("pyramidkv-patched", 256, "recall")]
    naive = pick[("pyramidkv-naive", 256, "recall")]
    assert probability_lower(patched, naive, 200, 0) > 0.9
    assert probability_lower(patched, patched, 200, 0) == 0.5


def test_report_refuses_results_without_a_full_reference(tmp_path):
    results = tmp_path / "r.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in synthetic_records()
                               if r["method"] != "full"))
    with pytest.raises(ValueError, match="full-attention"):
        report(results, tmp_path, replicates=10)


def test_load_records_skips_a_truncated_last_line(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps({"a": 1}) + "\n" + '{"a": 2, "b"')
    assert load_records(path) == [{"a": 1}]


# -------------------------------------------------------------------- grid and bisection

def test_bisection_starts_with_ends_and_middle():
    cands = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]
    assert grid.next_sparsities(cands, {}, {"r": 0.5}) == [0.1, 0.5, 0.9]


def test_bisection_halves_the_bracket_of_each_category():
    cands = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]
    measured = {0.1: {"r": 1.0, "i": 1.0}, 0.5: {"r": 0.5, "i": 1.0}, 0.9: {"r": 0.0, "i": 0.2}}
    # recall fails first at 0.5 (bracket 0.1-0.5 -> 0.3); icl at 0.9 (0.5-0.9 -> 0.7)
    assert grid.next_sparsities(cands, measured, {"r": 0.9, "i": 0.9}) == [0.3, 0.7]
    measured.update({0.3: {"r": 0.95, "i": 1.0}, 0.7: {"r": 0.1, "i": 0.3}})
    assert grid.next_sparsities(cands, measured, {"r": 0.9, "i": 0.9}) == [0.4, 0.6]
    measured.update({0.4: {"r": 0.2, "i": 1.0}, 0.6: {"r": 0.1, "i": 1.0}})
    assert grid.next_sparsities(cands, measured, {"r": 0.9, "i": 0.9}) == []


def test_bisection_stops_when_censored():
    cands = [0.1, 0.5, 0.9]
    always = {s: {"r": 1.0} for s in cands}
    never = {s: {"r": 0.0} for s in cands}
    assert grid.next_sparsities(cands, always, {"r": 0.9}) == []
    assert grid.next_sparsities(cands, never, {"r": 0.9}) == []


def test_a_resumed_run_first_reruns_every_point_an_earlier_run_measured():
    cands = [0.1, 0.3, 0.5, 0.7, 0.9]
    # an earlier, smaller run bisected to 0.3 and 0.7: new examples need those points too,
    # else the report's pairing across a curve's points drops them from the curve
    assert grid.first_round(cands, [0.3, 0.7], {"r": 0.9}, bisect=True) == [0.1, 0.3, 0.5,
                                                                            0.7, 0.9]
    assert grid.first_round(cands, [], {"r": 0.9}, bisect=True) == [0.1, 0.5, 0.9]
    # a point outside this run's candidates (the streaming end, another grid) is not added
    assert grid.first_round([0.1, 0.9], [0.5, 1.0], {"r": 0.9}, bisect=True) == [0.1, 0.9]
    assert grid.first_round(cands, [0.3], {"r": 0.9}, bisect=False) == cands


def test_setting_keys_name_the_mask_and_the_override():
    sweep = grid.Sweep("snapkv", 256, "patched", (0.5,))
    s = sweep.setting(0.5)
    assert s.key == "chunk=256/snapkv/patched/s=0.5" and s.vllm_xargs == {"kv_sparsity": 0.5}
    head = grid.Setting(grid.ServerConfig("prulong", 1024, 0.7, None, "/m/p.json"), 0.7, "ab12")
    assert head.key == "chunk=1024/prulong/s=0.7/mask=ab12" and head.vllm_xargs == {}
    assert head.server.slug == "c1024-prulong-s0.7-p"


def test_hybrid_sweeps_serve_a_head_mask_with_token_eviction_per_point():
    """`prulong+snapkv`: one curve per eviction mode along head sparsity = token sparsity,
    one server per point (the head mask is fixed at start-up), served with the head mask's
    file and --kv-token-policy."""
    spec = grid.GridSpec(tasks=("niah_single",), lengths=(1000,), per_category=1, chunks=(128,),
                         methods=("prulong+snapkv",), evictions=("patched",),
                         head_sparsities=(0.3, 0.5), masks={"prulong": "/m/p.json"})
    (sweep,) = spec.sweeps(128)
    assert (sweep.policy, sweep.eviction, sweep.candidates, sweep.mask) == (
        "prulong+snapkv", "patched", (0.3, 0.5), "/m/p.json")
    assert grid.per_point(sweep.policy) and grid.head_policy(sweep.policy) == "prulong"
    setting = sweep.setting(0.5, "ab12")
    assert setting.key == "chunk=128/prulong+snapkv/patched/s=0.5/mask=ab12"
    assert setting.vllm_xargs == {}
    served = setting.server.policy_spec()
    assert served.label == "prulong:0.5+snapkv:0.5:patched"
    full, _ = grid.estimate(spec, [(1000, 8)], categories=1)
    assert full.servers == 2 and full.requests == 2


def test_hybrid_at_a_fixed_token_sparsity_is_its_own_curve_named_and_paired_with_its_parts():
    """The compose issue's (head, token) pairs: `--hybrid-token-sparsities s,0.25` traces the
    hybrid twice along head sparsity, once with p = s (keys unchanged, so older records still
    match) and once with p fixed at 0.25 (its own key, record label, row name and comparisons
    against PruLong and patched SnapKV)."""
    from vllm_kvevict.evaluation.__main__ import build_parser
    from vllm_kvevict.evaluation.report import comparisons_table, display, line_style, parts

    args = build_parser().parse_args(["run", "--methods", "prulong+snapkv",
                                      "--hybrid-token-sparsities", "s,0.25"])
    assert args.hybrid_token_sparsities == (None, 0.25)
    for bad in ("1.5", "x", ","):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["run", "--hybrid-token-sparsities", bad])
    spec = grid.GridSpec(tasks=("niah_single",), lengths=(1000,), per_category=1, chunks=(128,),
                         methods=("prulong+snapkv",), evictions=("patched",),
                         head_sparsities=(0.5,), hybrid_token_sparsities=(None, 0.25),
                         masks={"prulong": "/m/p.json"})
    same, fixed = spec.sweeps(128)
    assert (same.label, fixed.label) == ("prulong+snapkv-patched",
                                         "prulong+snapkv-patched-t0.25")
    assert same.setting(0.5, "ab12").key == "chunk=128/prulong+snapkv/patched/s=0.5/mask=ab12"
    setting = fixed.setting(0.5, "ab12")
    assert setting.key == "chunk=128/prulong+snapkv/patched/t=0.25/s=0.5/mask=ab12"
    assert setting.server.policy_spec().label == "prulong:0.5+snapkv:0.25:patched"
    assert setting.server.slug == "c128-prulong+snapkv-patched-t0.25-s0.5-p"
    full, _ = grid.estimate(spec, [(1000, 8)], categories=1)
    assert full.servers == 2

    def record(method, eviction, sparsity, token, example, score):
        return {"setting": f"{method}/{eviction}/{token}/{sparsity}", "method": method,
                "eviction": eviction, "sparsity": sparsity, "token_sparsity": token,
                "chunk": 128, "length": 2048, "example": example, "task": "t",
                "category": "recall", "score": score, "footprint": 1.0 - (sparsity or 0.0),
                "measured_footprint": 1.0, "peak_kv": 1.0}

    records = []
    for e in ("e0", "e1"):
        records += [record("full", None, None, None, e, 1.0),
                    record("prulong", None, 0.5, None, e, 1.0),
                    record("snapkv", "patched", 0.5, None, e, 1.0),
                    record("prulong+snapkv", "patched", 0.5, None, e, 1.0),
                    record("prulong+snapkv", "patched", 0.5, 0.25, e, 0.0)]
    curves, _ = build_curves(records)
    labels = {c.method for c in curves}
    assert labels == {"prulong", "snapkv-patched", "prulong+snapkv-patched",
                      "prulong+snapkv-patched-t0.25"}
    assert display("prulong+snapkv-patched-t0.25") == (
        "PruLong + SnapKV (patched), token sparsity 0.25")
    assert display("prulong+snapkv-patched") == (
        "PruLong + SnapKV (patched), head = token sparsity")
    assert parts("prulong+snapkv-patched-t0.25") == ("prulong", "snapkv-patched")
    # drawn dashed in the s = p curve's color, never in a color another method has
    assert line_style("prulong+snapkv-patched-t0.25") == (
        line_style("prulong+snapkv-patched")[0], "--")
    assert line_style("prulong+snapkv-patched-t0.25")[0] not in {
        line_style(m)[0] for m in ("duo", "prulong", "snapkv-patched", "pyramidkv-patched")}
    assert parts("prulong") is None
    table = comparisons_table(curves, replicates=50, seed=0)
    for candidate in ("prulong+snapkv-patched", "prulong+snapkv-patched-t0.25"):
        for baseline in ("prulong", "snapkv-patched"):
            assert f"| {candidate} | {baseline} |" in table


def test_fp8_variants_serve_with_an_fp8_cache_and_close_with_fp8_streaming():
    spec = grid.GridSpec(tasks=("niah_single",), lengths=(1000,), per_category=1, chunks=(128,),
                         methods=("full", "full@fp8", "prulong@fp8"), head_sparsities=(0.5,))
    fixed = [s.server for s in spec.fixed_settings(128)]
    assert [s.policy for s in fixed] == ["full", "full@fp8"]
    assert fixed[0].server_args == [] and fixed[1].server_args == ["--kv-cache-dtype", "fp8"]
    assert fixed[1].policy_spec().policy == "full"
    (sweep,) = spec.sweeps(128)
    served = sweep.setting(0.5).server
    assert served.policy_spec().label == "prulong:0.5" and grid.per_point(sweep.policy)
    assert served.server_args == ["--kv-cache-dtype", "fp8"]
    # curves: full@fp8 is a one-point curve against full; streaming@fp8 closes prulong@fp8
    records = []
    for method, sparsity, score in (("full", None, 1.0), ("full@fp8", None, 0.5),
                                    ("prulong@fp8", 0.5, 1.0), ("streaming@fp8", None, 0.0)):
        records.append({"setting": method, "method": method, "eviction": None,
                        "sparsity": sparsity, "chunk": 128, "length": 2048, "example": "e0", "task": "t",
                        "category": "recall", "score": score, "footprint": 1.0,
                        "measured_footprint": 1.0, "peak_kv": 1.0})
    curves, _ = build_curves(records)
    by = {c.method: c for c in curves}
    assert set(by) == {"full@fp8", "prulong@fp8"}
    assert by["prulong@fp8"].sparsities == [0.5, 1.0] and by["full@fp8"].sparsities == [0.0]


def test_estimate_counts_servers_and_requests():
    spec = grid.GridSpec(tasks=("niah_single",), lengths=(1000,), per_category=1, chunks=(250,),
                         methods=("full", "streaming", "prulong", "snapkv"),
                         evictions=("naive", "patched"), head_sparsities=(0.2, 0.5),
                         token_sparsities=(0.2, 0.5, 0.8), bisect=False)
    cost = grid.CostModel(prefill_s_per_token=0.001, decode_s_per_token=0.0,
                          server_start_s=10.0)
    full, _ = grid.estimate(spec, [(1000, 8)], categories=1, cost=cost)
    # servers: full, streaming, prulong x2, snapkv naive, snapkv patched
    assert full.servers == 6
    assert full.requests == 1 + 1 + 2 + 3 + 3
    # patched runs 64 extra tokens with each of its 3 non-final chunks
    assert full.prompt_tokens == 10 * 1000 + 3 * 3 * 64
    assert full.seconds == pytest.approx(60 + full.prompt_tokens * 0.001)


def test_presets_exist_and_smoke_is_small():
    smoke = grid.preset("smoke", DEFAULT_TASKS)
    assert len(smoke.chunks) == 1 and smoke.methods == ("full", "snapkv")
    full, _ = grid.estimate(smoke, [(1024, 16)] * 8, categories=2)
    assert full.servers == 2 and full.seconds < 5 * 60
    default = grid.preset("default", DEFAULT_TASKS)
    assert len(default.chunks) == 2 and default.bisect
    with pytest.raises(ValueError):
        grid.preset("huge", DEFAULT_TASKS)


# ---------------------------------------------------------------------------- result store

def test_store_resumes_and_drops_a_cut_line(tmp_path, builder):
    ex = make_example(builder, "niah_single", 1024, 0)
    setting = grid.Setting(grid.ServerConfig("full", 256))
    path = tmp_path / "r.jsonl"
    store = ResultStore(path)
    assert not store.has(setting, ex)
    store.add({"setting": setting.key, "example": example_id(ex), "score": 1.0})
    with path.open("a") as f:
        f.write('{"setting": "cut')
    again = ResultStore(path)
    assert again.has(setting, ex) and len(again.records) == 1
    assert again.of_setting(setting, [ex])[0]["score"] == 1.0


def test_a_record_cut_by_a_smaller_budget_is_superseded(tmp_path, builder):
    """Passkey's budget is 16 tokens: an answer that stopped by itself within it, or that 16
    cut, stands; one cut at 12 (the old budget) is superseded, so the store asks again."""
    from vllm_kvevict.evaluation.client import is_current

    ex = make_example(builder, "passkey", 1024, 0)
    assert ex.max_tokens == tasks.TASKS["passkey"].max_tokens == 16
    setting = grid.Setting(grid.ServerConfig("full", 256))
    base = {"setting": setting.key, "example": example_id(ex), "task": "passkey"}
    stopped = dict(base, finish_reason="stop", completion_tokens=9)
    cut_now = dict(base, finish_reason="length", completion_tokens=16)
    cut_before = dict(base, finish_reason="length", completion_tokens=12)
    too_long = dict(base, finish_reason="stop", completion_tokens=17)
    assert is_current(stopped) and is_current(cut_now)
    assert not is_current(cut_before) and not is_current(too_long)
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(cut_before) + "\n")
    store = ResultStore(path)
    assert not store.has(setting, ex) and store.records == []
    assert store.superseded[(setting.key, example_id(ex))] == cut_before
    store.add(cut_now)
    assert ResultStore(path).has(setting, ex)


# -------------------------------------------------------------------- through vllm serve

@pytest.mark.server
@pytest.mark.slow  # 249 s on a slow CI machine: tooling, not serving (its parts are unit-tested)
def test_smoke_run_through_real_servers_resumes_and_reports(bundled_model_dir, tmp_path,
                                                            builder, hf_model):
    """Two tiny server configs (full; snapkv patched at two per-request sparsities), one
    1K-token example per task, then a resume that must start no server, then the report."""
    import conftest

    from vllm_kvevict.evaluation.runner import Runner

    while conftest._current:  # two cores: never two servers at once
        conftest._current.pop().stop()
    spec = grid.GridSpec(tasks=("niah_single", "icl_classify"), lengths=(1024,), per_category=1,
                         chunks=(256,), methods=("full", "snapkv"), evictions=("patched",),
                         token_sparsities=(0.5, 0.9), bisect=False)
    examples = tasks.make_examples(builder, spec.tasks, spec.lengths, spec.per_category)
    store = ResultStore(tmp_path / "results.jsonl")
    runner = Runner(spec, examples, store, str(bundled_model_dir), tmp_path / "logs",
                    progress=False)
    runner.run()
    assert runner.server_starts == 2 and runner.requests_run == 3 * len(examples)  # + log-probs
    records = load_records(tmp_path / "results.jsonl")
    assert len(records) == 3 * len(examples)
    for r in records:
        assert r["prompt_tokens"] == 1024
        # One request at a time: vLLM chunks at exact multiples of the token budget.
        assert r["chunk_boundaries"] == [256, 512, 768, 1024]
        assert 0 < r["footprint"] <= 1.0 and r["kv_bytes_peak"] > 0
    full = {r["task"]: r for r in records if r["method"] == "full"}
    assert full["niah_single"]["score"] == 1.0  # the bundled model finds a 1K needle
    assert full["niah_single"]["footprint"] == pytest.approx(1.0)
    # The continuous score: the gold answer's mean log-prob, teacher-forced through the policy.
    # Under full attention it is transformers' own log-prob of the gold tokens.
    example = next(e for e in examples if e.task == "niah_single")
    ids = torch.tensor([list(example.prompt_ids) + list(example.gold_ids)])
    with torch.no_grad():
        logprobs = torch.log_softmax(hf_model(ids).logits[0].float(), dim=-1)
    n, g = len(example.prompt_ids), len(example.gold_ids)
    want = float(logprobs[n - 1:n + g - 1].gather(1, ids[0, n:].view(-1, 1)).mean())
    assert full["niah_single"]["gold_tokens"] == g
    assert full["niah_single"]["gold_logprob"] == pytest.approx(want, abs=2e-3)
    assert -1.0 < want < 0  # the right answer, found: the model is confident in it
    assert all(r["gold_logprob"] < 0 and r["gold_tokens"] == len(
        next(e for e in examples if e.task == r["task"]).gold_ids) for r in records)
    snap = sorted((r for r in records if r["method"] == "snapkv"), key=lambda r: r["sparsity"])
    # The per-request sparsity reached the policy (kv_stats.params are the effective values).
    assert all(r["params"]["sparsity"] == r["sparsity"] for r in snap)
    assert {r["sparsity"] for r in snap} == {0.5, 0.9}
    # More eviction, smaller footprint: the per-request override really reached the policy.
    by_task = [r for r in snap if r["task"] == "niah_single"]
    assert by_task[1]["footprint"] < by_task[0]["footprint"] < 1.0

    again = Runner(spec, examples, ResultStore(tmp_path / "results.jsonl"),
                   str(bundled_model_dir), tmp_path / "logs", progress=False)
    again.run()
    assert again.server_starts == 0 and again.requests_run == 0

    # A record cut by a smaller generation budget than the task's today is asked again, and
    # only its answer: its gold log-prob (budget-independent) is carried, not re-measured.
    # A record without a log-prob (a --no-logprobs run) gets only the log-prob request.
    path = tmp_path / "results.jsonl"
    icl = next(r for r in records if r["method"] == "full" and r["task"] == "icl_classify")
    cut = dict(full["niah_single"], prediction=" 9", score=0.0, finish_reason="length",
               completion_tokens=2, gold_logprob=-9.0)
    edited = {json.dumps(full["niah_single"]): cut, json.dumps(icl): dict(icl, gold_logprob=None)}
    lines = [json.dumps(edited.get(line, json.loads(line))) for line in
             path.read_text().splitlines()]
    path.write_text("\n".join(lines) + "\n")
    redo = Runner(spec, examples, ResultStore(path), str(bundled_model_dir), tmp_path / "logs",
                  progress=False)
    assert len(redo.store.superseded) == 1
    redo.run()
    assert redo.server_starts == 1 and redo.requests_run == 2
    fresh = {r["task"]: r for r in load_records(path)[len(records):]}
    assert fresh["niah_single"]["prediction"] == full["niah_single"]["prediction"]
    assert fresh["niah_single"]["score"] == 1.0 and fresh["niah_single"]["run"] == redo.run_id
    assert fresh["niah_single"]["gold_logprob"] == -9.0
    got, want = dict(fresh["icl_classify"]), dict(icl, gold_run=redo.run_id)
    # the same log-prob, measured again; the rest of the record unchanged
    assert got.pop("gold_logprob") == pytest.approx(want.pop("gold_logprob"), abs=1e-4)
    assert got == want
    assert len(ResultStore(path).records) == len(records)

    table, plot = report(path, tmp_path / "report", replicates=20)
    assert "→ SnapKV (patched)" in table.read_text() and plot.exists()
    assert f"Records: {len(records)}; distinct examples: {len(examples)}; 2 more lines " \
        "superseded" in table.read_text()
    assert (tmp_path / "report" / "logprob.png").exists()  # the smoke run scored log-probs


def test_logprob_gap_and_paired_comparison_find_a_known_difference():
    """Gold log-probs: candidate (prulong) 0.02 nats/token above baseline (duo) at every
    point, plus per-example noise shared by both (paired) and a little of its own: the
    comparison finds +0.02 with an interval that excludes 0; a run without log-probs gives
    no curve log-probs and no table."""
    from vllm_kvevict.evaluation.report import logprob_comparisons_table

    rng = random.Random(1)
    records = [r for r in synthetic_records() if r["method"] in ("full", "streaming", "prulong")]
    base = {r["example"]: rng.uniform(-1.0, -0.2) for r in records}
    duo = [dict(r, method="duo", setting=r["setting"].replace("prulong", "duo"))
           for r in records if r["method"] == "prulong"]
    for r in records + duo:
        s = r["sparsity"] or 0.0
        shift = {"full": 0.0, "streaming": -2.0, "prulong": -0.3 * s,
                 "duo": -0.3 * s - 0.02}[r["method"]]
        r["gold_logprob"] = base[r["example"]] + shift + rng.uniform(-0.005, 0.005)
    curves, _ = build_curves(records + duo)
    prulong = next(c for c in curves if (c.method, c.chunk, c.category) == ("prulong", 256,
                                                                              "recall"))
    gap = prulong.logprob_gap()
    assert gap[0] == pytest.approx(-0.03, abs=0.01) and gap[-1] == pytest.approx(-2.0, abs=0.01)
    table = logprob_comparisons_table(curves, replicates=200, seed=0)
    row = next(line for line in table.splitlines() if "| 256 | recall | prulong | duo |" in line)
    mean, interval = row.split(" | ")[6].split(" [")
    lo, hi = (float(x) for x in interval.rstrip("]").split(", "))
    assert float(mean) == pytest.approx(0.02, abs=0.005) and 0 < lo <= hi < 0.04
    assert row.split(" | ")[7] == "1.00"  # higher in every replicate
    # Same footprints at equal sparsity: the matched-footprint column defers to it.
    assert "as at equal sparsity" in row
    without = build_curves(synthetic_records())[0]
    assert all(c.logprobs is None for c in without)
    assert logprob_comparisons_table(without, 50, 0) == ""


@pytest.mark.parametrize("shift", [0.0, 0.1])
def test_matched_footprint_comparison_undoes_a_footprint_offset(shift, tmp_path):
    """Naive and patched eviction on one log-prob-vs-footprint line (gap = -2 x (1 -
    footprint)), patched `shift` above it, but patched evicting more at each sparsity: at
    equal sparsity patched looks worse, at matched footprint the difference is `shift`."""
    from vllm_kvevict.evaluation.report import logprob_comparisons_table, plot_pareto

    records = [r for r in synthetic_records() if r["method"] == "full"
               or r["method"] == "pyramidkv"]
    for r in records:
        if r["method"] == "pyramidkv":
            s = r["sparsity"]
            r["footprint"] = 1.0 - (0.9 if r["eviction"] == "patched" else 0.5) * s
        r["gold_logprob"] = -0.5 - 2.0 * (1.0 - r["footprint"]) + (
            shift if r["eviction"] == "patched" else 0.0)
    curves, _ = build_curves(records)
    table = logprob_comparisons_table(curves, replicates=50, seed=0)
    row = next(line for line in table.splitlines()
               if "| 256 | recall | pyramidkv-patched | pyramidkv-naive |" in line)
    cells = row.split(" | ")
    assert float(cells[6].split(" [")[0]) == pytest.approx(-0.4 * 0.5 * 2.0 + shift, abs=1e-6)
    assert cells[8] == "55.0–91.0"  # naive at p 0.9 .. patched at p 0.1
    assert float(cells[9].split(" [")[0]) == pytest.approx(shift, abs=1e-6)
    plot_pareto(curves, tmp_path / "logprob.png", y="logprob")
    assert (tmp_path / "logprob.png").stat().st_size > 10_000


def test_chunk_sensitivity_rows_carry_paired_intervals():
    """The small chunk scoring 0.3 lower at every sparsity shows as a negative difference whose
    whole interval is below 0; equal curves give an interval around 0."""
    from vllm_kvevict.evaluation.report import chunk_sensitivity_table

    records = synthetic_records(n_per_task=10)
    for r in records:
        if r["method"] == "prulong" and r["chunk"] == 256:
            r["score"] = max(0.0, r["score"] - 0.3)
    curves, _ = build_curves(records)
    rows = {(line.split(" | ")[1], line.split(" | ")[2]): line
            for line in chunk_sensitivity_table(curves, 200, 0).splitlines()[2:]}
    cells = rows[("→ PruLong", "recall")].split(" | ")
    low, high = (float(x) for x in cells[5].split("[")[1].rstrip("]").split(", "))
    assert high < 0 and float(cells[6]) == 1.0, cells
    cells = rows[("→ PyramidKV (patched)", "recall")].split(" | ")
    low, high = (float(x) for x in cells[5].split("[")[1].rstrip("]").split(", "))
    assert low < 0 < high, cells


def test_comparisons_pair_curves_of_different_sizes_on_their_common_examples():
    """A curve with more examples than its counterpart (a run extended one setting) is
    compared on the examples both hold, with intervals, instead of printing n/a."""
    from vllm_kvevict.evaluation.curves import paired
    from vllm_kvevict.evaluation.report import chunk_sensitivity_table, comparisons_table

    records = [r for r in synthetic_records(n_per_task=10, naive_drop=2.0)
               # chunk 256 keeps 6 examples per task; naive PyramidKV at 1024 keeps 4
               if not (r["chunk"] == 256 and r["index"] >= 6)
               and not (r["chunk"] == 1024 and r["eviction"] == "naive" and r["index"] >= 4)]
    for r in records:
        if r["method"] == "prulong" and r["chunk"] == 256:
            r["score"] = max(0.0, r["score"] - 0.3)
    curves, _ = build_curves(records)
    key = {(c.method, c.chunk, c.category): c for c in curves}
    small, large = key[("prulong", 256, "recall")], key[("prulong", 1024, "recall")]
    assert (len(small.examples), len(large.examples)) == (12, 20)
    a, b = paired(small, large)
    assert a.examples == b.examples == small.examples and a.tasks == b.tasks
    assert b.scores.shape == (len(large.sparsities), 12)
    rows = {(line.split(" | ")[1], line.split(" | ")[2]): line
            for line in chunk_sensitivity_table(curves, 200, 0).splitlines()[2:]}
    cells = rows[("→ PruLong", "recall")].split(" | ")
    high = float(cells[5].split("[")[1].rstrip("]").split(", ")[1])
    assert high < 0 and float(cells[6]) == 1.0 and cells[10].endswith("(12)"), cells
    row = next(line for line in comparisons_table(curves, 200, 0).splitlines()
               if line.startswith("| 2048 | 1024 | recall | pyramidkv-patched |"))
    # 8 common examples: patched lower (naive never reaches 90 %) in most replicates
    assert "(8) |" in row and float(row.split(" | ")[-1].rstrip(" |")) > 0.75, row
