"""Shared fixtures: fresh checkpoint directories with awkward names, a tiny train state."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterator

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def ckdir(tmp_path: Path) -> Path:
    """A checkpoint dir whose path has a space, a quote and a semicolon in it."""
    d = tmp_path / "run 'a';b" / "ckpt"
    return d


@pytest.fixture
def python() -> str:
    return sys.executable


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # Tests outside Slurm tiers must not see a surrounding job's environment.
    import os
    for k in list(os.environ):
        if k.startswith("HPCCKPT_"):
            monkeypatch.delenv(k, raising=False)
    yield


def _weight(item: pytest.Item) -> int:
    """Long first: real-Slurm tests wait on Slurm's clocks, `slow` ones run whole trainings."""
    marks = {m.name for m in item.iter_markers()}
    return 0 if "slurm" in marks else 1 if "slow" in marks or "criu" in marks else 2


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist the longest tests start first (longest-first scheduling): each worker
    begins with waits on Slurm and whole trainings, and the short unit tests fill the gaps,
    instead of four workers finishing the unit tier together and then waiting on one cluster.
    Order within a weight is kept, so a run without workers is unchanged but for this sort."""
    import os
    if os.environ.get("PYTEST_XDIST_WORKER"):  # every worker collects, and sorts, the same way
        items.sort(key=_weight)
