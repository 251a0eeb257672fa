"""``hpcckpt demo --engine concurrent``: preempted + resumed run is bit-identical to an uninterrupted one."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hpcckpt.store import catalog

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.native, pytest.mark.slow]


def demo(tmp: Path, *args: str) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-m", "hpcckpt.cli", "demo", "--dir", str(tmp), "--json", "--no-plot",
                          "--engine", "concurrent", *args], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert out.stdout, out.stderr[-3000:]
    res = json.loads(out.stdout)
    assert out.returncode == (0 if res["identical"] else 1), out.stderr[-3000:]
    return res


@pytest.mark.parametrize("seed,extra", [(3, ("--every", "2")), (4, ("--every", "5", "--preempt-at", "7,18"))])
def test_demo_concurrent_is_bit_identical(tmp_path: Path, seed: int, extra: tuple[str, ...]) -> None:
    res = demo(tmp_path, "--seed", str(seed), "--steps", "30", *extra)
    assert res["identical"] is True, res
    assert res["max_abs_param_diff"] == 0.0
    assert res["preempted_at"] and res["resumed_from"] == res["preempted_at"]
    # The checkpoints really came from the concurrent engine (HDF5 rank files) and verify fully.
    ckpt = tmp_path / "preempted" / "ckpt"
    infos = [i for i in catalog.scan(ckpt, full=True) if i.status == "committed"]
    assert infos
    for info in infos:
        assert info.manifest is not None and info.manifest["engine"] == "concurrent"
        assert info.manifest["ranks"]["0"]["format"] == "hdf5"
        assert info.problems == []
