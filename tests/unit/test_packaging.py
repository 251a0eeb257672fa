"""hpcckpt installs into an environment that already has its own (CUDA) torch."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _requirements() -> list[str]:
    tomllib = pytest.importorskip("tomllib")
    with open(REPO / "pyproject.toml", "rb") as f:
        return list(tomllib.load(f)["project"]["dependencies"])


def test_metadata_states_a_torch_range_not_a_pin() -> None:
    from packaging.requirements import Requirement

    torch = [Requirement(r) for r in _requirements() if Requirement(r).name == "torch"]
    assert len(torch) == 1
    spec = torch[0].specifier
    assert not any(s.operator in ("==", "===", "~=") for s in spec), f"torch is pinned: {spec}"
    # The range admits the site torch of the GPU nodes (2.11) and the bootstrap's (2.13).
    assert spec.contains("2.11.0") and spec.contains("2.13.0")


def test_installing_into_an_env_with_torch_installs_nothing_else(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-build-isolation",
                           "--no-index", "--disable-pip-version-check", "--report", str(report), "-q", str(REPO)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    names = [item["metadata"]["name"] for item in json.loads(report.read_text())["install"]]
    assert names == ["hpcckpt"], f"pip would also install or replace: {names}"
