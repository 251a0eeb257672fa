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

ENGINE_KEYS = {"stall_s", "persist_s", "persist_gbps", "load_s", "load_gbps",
               # side-by-side references: the disk measured next to each checkpoint and load
               "raw_write_gbps", "persist_vs_raw_write", "raw_read_gbps", "load_vs_raw_read",
               "load_fresh_s", "load_fresh_vs_raw_read", "raw_read_fresh_vs_raw_read"}


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
    assert res["engines"]["sync"]["torch_load_s"] > 0  # the torch.load reference ran on the sync archive
    assert set(res["overhead_min"]) == set(res["overhead_blocked"]) == {"sync", "concurrent"}
    t = res["targets"]
    assert t["load_vs_read"] == res["engines"]["concurrent"]["load_vs_raw_read"]
    assert t["persist_vs_write"] == res["engines"]["concurrent"]["persist_vs_raw_write"]
    assert isinstance(t["load_vs_torch_load_reachable"], bool) and t["load_vs_torch_load_ceiling"] > 0
    assert "stall_vs_sync" in t
    assert plot.stat().st_size > 10_000
    # The scratch files are gone: nothing but the plot is left in --dir.
    assert [p.name for p in tmp_path.iterdir()] == ["bench.png"]
