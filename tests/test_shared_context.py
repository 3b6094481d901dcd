"""loadtest/shared_context.py without a server: the contexts and prompts, the statistics, the
report's pairing (the served run is docs/results/shared-context/)."""

from __future__ import annotations

import math

import pytest

from loadtest.shared_context import (VARIANTS, compare, make_context, paired_interval, report,
                                     summarize, turn_separator, wilson)


@pytest.fixture(scope="module")
def builder():
    from vllm_kvevict.evaluation.tasks import PromptBuilder, load_tokenizer

    return PromptBuilder(load_tokenizer())


def test_a_context_holds_every_needle_and_its_questions_share_it(builder):
    ctx = make_context(builder, 3, 1024, 4, seed=0)
    assert 900 < len(ctx.head_ids) <= 1024 + 2 and len(set(ctx.keys)) == 4
    text = builder.tokenizer.decode(list(ctx.head_ids))
    for key, value in zip(ctx.keys, ctx.values):
        assert f"The special magic number for {key} is: {value}." in text
    asked, opening = ctx.question(builder, 2)
    question = builder.tokenizer.decode(asked + opening)
    assert ctx.keys[2] in question and question.endswith("mentioned in the provided text is")
    assert make_context(builder, 3, 1024, 4, seed=0) == ctx  # deterministic
    assert make_context(builder, 4, 1024, 4, seed=0).values != ctx.values
    assert builder.tokenizer.decode(turn_separator(builder.tokenizer)).startswith("<|im_end|>")


def test_wilson_and_the_paired_interval():
    lo, hi = wilson(20, 24)
    assert lo < 20 / 24 < hi and 0 <= lo and hi <= 1
    assert wilson(24, 24)[1] == 1.0 and wilson(0, 24)[0] == 0.0
    assert all(math.isnan(x) for x in wilson(0, 0))
    assert paired_interval([0.0] * 30) == (0.0, 0.0)
    lo, hi = paired_interval([-1.0] * 10 + [0.0] * 20)
    assert hi < 0  # a loss on a third of the questions is resolved
    lo, hi = paired_interval([-1.0, 1.0] * 10)
    assert lo < 0 < hi


def test_summary_pairs_the_same_questions(tmp_path):
    records = []
    for setting, wrong, ttft in (("a", set(), 2.0), ("b", {(0, 1), (1, 1)}, 1.0)):
        for variant in VARIANTS:
            for c in range(3):
                for q in range(4):
                    records.append({"setting": setting, "variant": variant, "context": c,
                                    "question": q, "correct": float((c, q) not in wrong),
                                    "ttft_s": ttft if q else 3.0, "cached_tokens": 100 * q,
                                    "prompt_tokens": 1000, "kv_bytes_peak": 2**20})
    rows = summarize(records, ["a", "b"])
    assert [(r["setting"], r["n"]) for r in rows] == [("a", 12), ("b", 12)] * 2
    b = next(r for r in rows if r["setting"] == "b")
    assert b["accuracy"] == 10 / 12 and b["ttft_later_s"] == 1.0
    c = compare(rows, "a", "b", "shared")
    assert c["n"] == 12 and c["diff"] == pytest.approx(-2 / 12) and c["ttft_ratio"] == 0.5
    text = report(records, ["a", "b"], [("a", "b")], tmp_path, "cmd")
    assert "| shared | b - a | 12 | -16.7% |" in text
    assert (tmp_path / "table.md").exists() and (tmp_path / "shared.png").exists()
