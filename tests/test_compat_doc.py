"""docs/results/compat.md is generated from tests/compat_matrix.py, and every cell's claim names
tests that exist (CI runs them; slow-tier ones run with `pytest -m slow`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from compat_matrix import COLUMNS, ROWS, STATUSES, node_ids, render, slow_node_ids

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "results" / "compat.md"


def test_every_cell_has_a_status_and_evidence():
    for row in ROWS:
        assert set(row.cells) == set(COLUMNS), row.feature
        for column, cell in row.cells.items():
            assert cell.status in STATUSES, (row.feature, column)
            assert cell.tests, (row.feature, column)
            assert cell.status != "n/a" or cell.why, (row.feature, column)


def test_compat_page_is_the_matrix():
    assert PAGE.read_text() == render(), (
        "docs/results/compat.md is stale: python tests/compat_matrix.py > docs/results/compat.md")


def test_every_named_test_exists_in_the_tier_the_page_says():
    ids = node_ids()
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "",
                           "-p", "no:cacheprovider", *ids], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "KVEVICT_LIST_SLOW": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [line.strip() for line in proc.stdout.splitlines()]
    collected = {line for line in lines if "::" in line and not line.startswith("slow-tier: ")}
    assert set(ids) <= collected, sorted(set(ids) - collected)
    # "(s)" on the page is the slow marker in the code, both ways
    slow = {line.removeprefix("slow-tier: ") for line in lines if line.startswith("slow-tier: ")}
    assert slow & set(ids) == slow_node_ids(), sorted(slow & set(ids) ^ slow_node_ids())


def test_vllm_api_has_no_best_of():
    """vLLM 0.32's completion request has no best_of (an unknown field is ignored)."""
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    assert "best_of" not in CompletionRequest.model_fields
    request = CompletionRequest.model_validate({"model": "m", "prompt": "p", "best_of": 3})
    assert request.n == 1
