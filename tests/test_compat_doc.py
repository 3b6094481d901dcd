"""docs/results/compat.md is generated from tests/compat_matrix.py, and every cell's claim names
tests that exist (CI runs them; slow-tier ones run with `pytest -m slow`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from compat_matrix import COLUMNS, ROWS, STATUSES, node_ids, render

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


def test_every_named_test_exists():
    ids = node_ids()
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "",
                           "-p", "no:cacheprovider", *ids],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    collected = {line.strip() for line in proc.stdout.splitlines() if "::" in line}
    assert set(ids) <= collected, sorted(set(ids) - collected)


def test_vllm_api_has_no_best_of():
    """vLLM 0.32's completion request has no best_of (an unknown field is ignored)."""
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    assert "best_of" not in CompletionRequest.model_fields
    request = CompletionRequest.model_validate({"model": "m", "prompt": "p", "best_of": 3})
    assert request.n == 1
