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
