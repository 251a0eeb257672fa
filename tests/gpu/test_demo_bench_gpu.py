"""``hpcckpt demo --device cuda`` is bit-identical, and ``hpcckpt bench --device cuda --quick --json``
reports the GPU figures (``pytest -m gpu``; skipped without CUDA).

Both run through the CLI in child processes, which the subprocess call reaps; their
scratch files live under pytest's tmp_path.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.gpu, pytest.mark.native, pytest.mark.slow]


def cli(*args: str, timeout: int = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hpcckpt.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("engine,extra", [("sync", ()), ("concurrent", ("--every", "3", "--preempt-at", "7,18"))])
def test_demo_on_cuda_is_bit_identical(tmp_path: Path, engine: str, extra: tuple[str, ...]) -> None:
    out = cli("demo", "--device", "cuda", "--engine", engine, "--steps", "30", "--seed", "3", "--json", "--no-plot",
              "--dir", str(tmp_path), *extra)
    assert out.stdout, out.stderr[-3000:]
    res = json.loads(out.stdout)
    assert res["device"] == "cuda"
    assert res["identical"] is True, (res, out.stderr[-3000:])
    assert out.returncode == 0
    assert res["max_abs_param_diff"] == 0.0 and res["preempted_at"] and res["resumed_from"] == res["preempted_at"]


def test_bench_quick_on_cuda_reports_the_gpu_figures(tmp_path: Path) -> None:
    out = cli("bench", "--device", "cuda", "--quick", "--json", "--dir", str(tmp_path / "bench"))
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout)
    assert res["device"] == "cuda" and res["machine"]["gpu"]
    for key in ("pinned_d2h_gbps", "pinned_h2d_gbps", "pageable_d2h_gbps", "write_gbps", "read_gbps"):
        assert math.isfinite(res["limits"][key]) and res["limits"][key] > 0, key
    for name in ("sync", "concurrent"):
        e = res["engines"][name]
        for key in ("stall_s", "first_stall_s", "first_vs_steady", "persist_s", "persist_vs_raw_write", "load_s",
                    "load_vs_raw_read"):
            assert math.isfinite(e[key]) and e[key] > 0, (name, key)
    assert res["engines"]["concurrent"]["snapshot_gbps"] > 0
    assert res["engines"]["sync"]["torch_load_s"] > 0
    assert set(res["overhead"]["concurrent"]) == {"1", "10", "50"}
    assert res["overhead_detail"]["model"]["device"] == "cuda"
    t = res["targets"]
    assert t["device"] == "cuda" and t["snapshot_copy_limit"] == "pinned_d2h_gbps"
    for key in ("stall_vs_sync", "snapshot_vs_copy_limit", "first_vs_steady", "persist_vs_write", "load_vs_read",
                "load_vs_torch_load"):
        assert isinstance(t[key], float) and math.isfinite(t[key]), key
    if res["staging"]["supported"]:
        assert set(res["staging"]["fractions"]) == {"1.0", "0.5", "0.25"}
    assert list((tmp_path / "bench").iterdir()) == []  # scratch files removed
