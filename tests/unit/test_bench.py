"""``hpcckpt bench --quick --json`` on the CPU: the real measurements at tiny sizes, every figure reported.

This is the bench's CPU fallback (no GPU here): the same phases as on a GPU node, with
host copies in place of the pinned device copies. Progress goes to stderr, the JSON
alone to stdout, and a --dir that does not exist yet is created.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.native, pytest.mark.slow]

ENGINE_KEYS = {"stall_s", "persist_s", "persist_gbps", "load_s", "load_gbps", "first_stall_s", "first_vs_steady",
               "save_call_s",
               # side-by-side references: the disk measured next to each checkpoint and load
               "raw_write_gbps", "persist_vs_raw_write", "raw_read_gbps", "load_vs_raw_read",
               "load_fresh_s", "load_fresh_vs_raw_read", "raw_read_fresh_vs_raw_read"}


def finite_positive(v: object) -> bool:
    return isinstance(v, float) and math.isfinite(v) and v > 0


def test_bench_quick_json_has_every_key(tmp_path: Path) -> None:
    plot = tmp_path / "bench.png"
    work = tmp_path / "not" / "yet"  # created by the bench, parents too
    out = subprocess.run([sys.executable, "-m", "hpcckpt.cli", "bench", "--quick", "--json", "--device", "cpu",
                          "--dir", str(work), "--plot", str(plot)],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout)  # stdout holds the JSON and nothing else
    progress = [line for line in out.stderr.splitlines() if line.startswith("[bench")]
    assert len(progress) >= 5 and any("cold loads" in line for line in progress), out.stderr[-2000:]
    assert res["device"] == "cpu" and res["state_bytes"] > 0
    assert set(res["limits"]) >= {"write_gbps", "write_dd_gbps", "read_gbps", "memcpy_gbps"}
    assert "pinned_d2h_gbps" not in res["limits"]  # no GPU: no device copy limits are invented
    assert set(res["engines"]) == {"sync", "concurrent"}
    for name, figures in res["engines"].items():
        assert set(figures) >= ENGINE_KEYS, name
        for key in ENGINE_KEYS:
            assert finite_positive(figures[key]), (name, key, figures[key])
    conc = res["engines"]["concurrent"]
    assert finite_positive(conc["snapshot_gbps"]) and conc["snapshot_source"] in ("outside", "engine d2h stats")
    assert set(res["overhead"]) == {"sync", "concurrent"}
    for per in res["overhead"].values():
        assert set(per) == {"1", "10", "50"}
        assert all(math.isfinite(v) for v in per.values())
    # every interval saved at least once: the quick run is long enough for interval 50
    assert res["overhead_detail"]["steps"] >= 50
    assert len(res["sizes"]) >= 1 and res["sizes"][-1]["state_bytes"] == res["state_bytes"]
    assert res["engines"]["sync"]["torch_load_s"] > 0  # the torch.load reference ran on the sync archive
    # peak RSS of each resume's process beyond its start, per byte of state (torch.load's too)
    assert all(finite_positive(e["load_held_vs_state"]) for e in res["engines"].values())
    assert all(finite_positive(e["save_held_vs_state"]) for e in res["engines"].values())  # each save in its own child
    assert finite_positive(res["engines"]["sync"]["torch_load_held_vs_state"])
    # a small state saved at every step: the per-save fixed cost of each engine
    small = res["small_state"]
    assert small["every"] == 1 and small["state_bytes"] > 0 and finite_positive(small["step_s"])
    for name in ("sync", "concurrent"):
        e = small["engines"][name]
        assert math.isfinite(e["overhead"]) and math.isfinite(e["per_save_ms"]) and e["blocked_per_save_ms"] >= 0
    # where the run's time went, phase by phase
    assert set(res["phases_s"]) == set(res["phases_cpu_s"]) == {"limits", "engines", "overhead", "small_state"}
    assert set(res["overhead_min"]) == set(res["overhead_blocked"]) == {"sync", "concurrent"}
    staging = res["staging"]
    if staging["supported"]:
        assert set(staging["fractions"]) == {"1.0", "0.5", "0.25"}
        assert all(finite_positive(v["stall_s"]) for v in staging["fractions"].values())
        assert all(finite_positive(v["held_vs_state"]) for v in staging["fractions"].values())
    t = res["targets"]
    assert t["device"] == "cpu" and t["snapshot_copy_limit"] == "memcpy_gbps"
    assert t["load_vs_read"] == conc["load_vs_raw_read"]
    assert t["persist_vs_write"] == conc["persist_vs_raw_write"]
    assert t["first_vs_steady"] == conc["first_vs_steady"]
    assert isinstance(t["load_vs_torch_load_reachable"], bool) and t["load_vs_torch_load_ceiling"] > 0
    assert set(t["disk_absorbs"]) == {"1", "10", "50"}
    assert "stall_vs_sync" in t
    assert t["small_state_per_save_ms"] == small["engines"]["concurrent"]["per_save_ms"]
    assert t["small_state_floor_per_save_ms"] == small["engines"]["floor"]["per_save_ms"]  # the CPU's floor
    assert plot.stat().st_size > 10_000
    # The scratch files are gone: only the plot and the (now empty) work dir are left.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.png", "not"]
    assert list(work.iterdir()) == []


def test_bench_small_state_alone_measures_the_size_and_step_asked(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "hpcckpt.cli", "bench", "--small-state", "0.5,3", "--quick", "--json",
                          "--device", "cpu", "--dir", str(tmp_path / "work")],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    small = json.loads(out.stdout)
    assert small["device"] == "cpu" and small["every"] == 1 and small["target_step_s"] == 0.003
    assert 0.3e6 < small["state_bytes"] < 0.8e6  # about the 0.5 MB asked
    assert finite_positive(small["step_s"]) and small["steps"] == 30
    assert set(small["engines"]) == {"floor", "sync", "concurrent"}  # on a CPU, the floor beside the engines
    for name in ("floor", "sync", "concurrent"):
        e = small["engines"][name]
        assert math.isfinite(e["overhead"]) and math.isfinite(e["per_save_ms"]) and e["blocked_per_save_ms"] >= 0
        assert len(e["wall_all_s"]) == len(e["baseline_all_s"]) == 1
        # where a save's time went in CPU time: the process's, and the training thread's share of it
        assert math.isfinite(e["cpu_per_save_ms"]) and math.isfinite(e["training_cpu_per_save_ms"])
    assert list((tmp_path / "work").iterdir()) == []  # scratch removed


def test_the_floor_writes_the_state_bytes_at_every_save(tmp_path: Path) -> None:
    """The yardstick does the work it stands for: after each save the file holds the bytes of
    the tensors it copies (the parameters and optimizer state, changed in place by training)
    as they were at that save."""
    import torch

    from hpcckpt.bench.floor import ALIGN, Floor
    from hpcckpt.bench.synthetic import PeerRig

    rig = PeerRig(200_000)
    m = Floor(tmp_path / "floor", rig)
    written = []
    try:
        params = {p.data_ptr() for p in rig.model.parameters()}
        assert params <= {t.data_ptr() for t in m.sources}  # the live tensors' memory, not copies
        for step in (1, 2):
            rig.step()
            expected = bytearray()
            for t in m.sources:
                expected += bytes(-len(expected) % ALIGN)
                expected += t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            m.persist_s(m.start(step))
            written.append((tmp_path / "floor" / "floor.bin").read_bytes()[:len(expected)])
            assert written[-1] == bytes(expected)
    finally:
        m.close()
    assert written[0] != written[1]  # training changed them between the saves
    assert m.proc.returncode == 0  # the writer process exits once the bench closes the method
