"""The README's demo, end to end through the CLI: preempt, requeue (local), resume, bit-identical."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = [pytest.mark.native, pytest.mark.slow]


def demo(tmp: Path, *args: str) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-m", "hpcckpt.cli", "demo", "--dir", str(tmp), "--json", *args],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.stdout, out.stderr[-3000:]
    res = json.loads(out.stdout)
    assert out.returncode == (0 if res["identical"] else 1)
    return res


@pytest.mark.parametrize("seed,extra", [(1, ()), (2, ("--preempt-at", "9,23", "--no-plot"))])
def test_demo_sync_is_bit_identical(tmp_path: Path, seed: int, extra: tuple[str, ...]) -> None:
    """The first case also draws the README's loss plot (one demo run fewer than a test of its own)."""
    res = demo(tmp_path, "--engine", "sync", "--seed", str(seed), "--steps", "30", *extra)
    assert res["identical"] is True, res
    if "--no-plot" in extra:
        assert "plot" not in res
    else:
        assert Path(str(res["plot"])).stat().st_size > 1000
    assert res["max_abs_param_diff"] == 0.0
    assert set(res) >= {"identical", "steps", "preempted_at", "resumed_from", "max_abs_param_diff", "device"}
    import torch
    assert res["device"] == ("cuda" if torch.cuda.is_available() else "cpu")  # --device auto
    assert res["preempted_at"] and res["resumed_from"] == res["preempted_at"]
    if extra:
        assert len(res["preempted_at"]) == 2
