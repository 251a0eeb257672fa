"""``hpcckpt bench --quick --json`` runs the real measurements at tiny sizes and reports every figure."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.native, pytest.mark.slow]

ENGINE_KEYS = {"stall_s", "persist_s", "persist_gbps", "load_s", "load_gbps"}


def test_bench_quick_json_has_every_key(tmp_path: Path) -> None:
    plot = tmp_path / "bench.png"
    out = subprocess.run([sys.executable, "-m", "hpcckpt.cli", "bench", "--quick", "--json", "--dir", str(tmp_path),
                          "--plot", str(plot)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout)
    assert res["state_bytes"] > 0
    assert set(res["limits"]) >= {"write_gbps", "read_gbps", "memcpy_gbps"}
    assert set(res["engines"]) == {"sync", "concurrent"}
    for name, figures in res["engines"].items():
        assert set(figures) >= ENGINE_KEYS, name
        for key in ENGINE_KEYS:
            assert isinstance(figures[key], float) and math.isfinite(figures[key]) and figures[key] > 0, (name, key)
    assert set(res["overhead"]) == {"sync", "concurrent"}
    for per in res["overhead"].values():
        assert set(per) == {"1", "10", "50"}
        assert all(math.isfinite(v) for v in per.values())
    assert len(res["sizes"]) >= 2 and res["sizes"][-1]["state_bytes"] == res["state_bytes"]
    assert "stall_vs_sync" in res["targets"]
    assert plot.stat().st_size > 10_000
    # The scratch files are gone: nothing but the plot is left in --dir.
    assert [p.name for p in tmp_path.iterdir()] == ["bench.png"]
