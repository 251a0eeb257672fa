"""The one no-progress guard (``lifecycle.budget``): one file, one count per kind of allocation."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpcckpt.lifecycle.budget import BUDGET_FILE, BudgetOptions, charge, no_progress


def test_deadline_and_failure_counts_share_one_file_and_stay_apart(tmp_path: Path) -> None:
    assert no_progress(tmp_path, "deadline", progressed=False) == 1
    opts = BudgetOptions(max_failure=10, max_failures_without_progress=2)
    assert charge(tmp_path, "failure", attempt="1:0", committed_step=7, options=opts).allowed
    assert charge(tmp_path, "failure", attempt="1:1", committed_step=7, options=opts).allowed
    assert no_progress(tmp_path, "deadline", progressed=False) == 2
    saved = json.loads((tmp_path / BUDGET_FILE).read_text())
    assert saved["without_progress"] == {"deadline": 2, "failure": 1}
    assert saved["counts"] == {"failure": 2}  # the guard charges no requeue
    assert no_progress(tmp_path, "deadline", progressed=True) == 0


def test_a_budget_file_written_before_the_guard_was_one_keeps_its_failure_count(tmp_path: Path) -> None:
    (tmp_path / BUDGET_FILE).write_text(json.dumps({"counts": {"failure": 2}, "failures_without_progress": 1,
                                                    "last_failure_step": 5}))
    opts = BudgetOptions(max_failure=10, max_failures_without_progress=2)
    stuck = charge(tmp_path, "failure", attempt="2:0", committed_step=5, options=opts)
    assert not stuck.allowed and "crash loop" in stuck.reason


def test_an_unusable_file_leaves_the_guard_unconsulted(tmp_path: Path) -> None:
    (tmp_path / BUDGET_FILE).write_text("not json")
    assert no_progress(tmp_path, "deadline", progressed=False) is None


def test_an_unknown_kind_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no-progress kind 'deadlines'"):
        no_progress(tmp_path, "deadlines", progressed=False)
