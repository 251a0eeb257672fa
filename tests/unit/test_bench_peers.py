"""``hpcckpt bench --peers`` and ``--tensors`` at tiny sizes: the JSON is complete and every restore exact.

Real saves (torch.save + fsync, DCP, both engines), real cold restores in fresh
processes; nothing here asserts a timing value, only that each figure was measured
(finite) and that each restore reproduced the saved state bit for bit.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hpcckpt.bench.isolate import run_isolated
from hpcckpt.bench.methods import ALL, available, make_method, restore, state_digest
from hpcckpt.bench.synthetic import PeerRig
from hpcckpt.errors import HpcckptError

REPO = Path(__file__).resolve().parents[2]
METHOD_KEYS = {"stall_s", "first_stall_s", "save_call_s", "persist_s", "persist_gbps", "restore_s", "restore_gbps",
               "save_held_vs_state", "restore_held_vs_state", "save_peak_rss_bytes", "restore_peak_rss_bytes"}


def finite(v: object) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def bench(args: list[str], tmp_path: Path) -> dict:  # type: ignore[type-arg]
    out = subprocess.run([sys.executable, "-m", "hpcckpt.cli", "bench", *args, "--json", "--device", "cpu",
                          "--dir", str(tmp_path / "work")], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert list((tmp_path / "work").iterdir()) == []  # scratch files removed
    return json.loads(out.stdout)  # type: ignore[no-any-return]


@pytest.mark.native
@pytest.mark.slow
def test_peers_quick_json_has_every_method_and_exact_restores(tmp_path: Path) -> None:
    plot = tmp_path / "peers.png"
    res = bench(["--peers", "--quick", "--size-gb", "0.002", "--plot", str(plot)], tmp_path)
    have, skipped = available("cpu")
    assert set(res["methods"]) == set(have) and set(res["skipped"]) == set(skipped)
    assert set(have) | set(skipped) == set(ALL)  # every method either measured or said why not
    assert {"torch_save", "dcp_save", "dcp_async", "hpcckpt_sync", "hpcckpt_concurrent"} <= set(have)
    for name, m in res["methods"].items():
        assert METHOD_KEYS <= set(m), name
        assert all(finite(m[k]) for k in METHOD_KEYS), (name, {k: m[k] for k in METHOD_KEYS})
        assert m["restore_exact"] is True, name
        assert set(m["overhead"]) == set(m["overhead_blocked"]) == {"1", "5"}
        assert all(finite(v) for v in m["overhead"].values())
        assert m["what"]
    assert res["all_exact"] is True and res["cold_cache"] in ("drop_caches", "fadvise")
    assert res["state_bytes"] > 0 and res["tensors"] > 0
    assert set(res["vs_torch_save"]) == set(have)
    assert set(res["concurrent_ahead_of_dcp_async"]) == {"1", "5"}
    assert plot.stat().st_size > 10_000


@pytest.mark.native
@pytest.mark.slow
def test_tensors_sweep_reports_each_count_with_verify(tmp_path: Path) -> None:
    res = bench(["--tensors", "64,8", "--quick", "--size-gb", "0.001"], tmp_path)
    assert [c["tensors_requested"] for c in res["counts"]] == [8, 64]
    assert res["all_exact"] is True
    for c in res["counts"]:
        assert c["tensors"] >= c["tensors_requested"]
        assert {"torch_save", "dcp_save", "hpcckpt_sync", "hpcckpt_concurrent"} == set(c["methods"])
        for name, m in c["methods"].items():
            assert m["restore_exact"] is True and finite(m["durable_s"]) and finite(m["save_held_vs_state"]), name
            assert set(c["vs_torch"][name]) == {"durable", "restore"}
        for name in ("hpcckpt_sync", "hpcckpt_concurrent"):
            m = c["methods"][name]
            assert m["verify_ok"] is True and m["verify_problems"] == [] and finite(m["verify_vs_raw_read"])


@pytest.mark.parametrize("name", ["torch_save", "dcp_save", "dcp_async", "hpcckpt_sync"])
def test_a_restore_of_an_older_save_is_not_exact(name: str, tmp_path: Path) -> None:
    """The exactness check can fail: a checkpoint of an earlier step restores to another digest."""
    rig = PeerRig(1 << 16, tensors=8)
    m = make_method(name, tmp_path / name, rig, {})
    try:
        m.persist_s(m.start(1))
        saved = state_digest(rig)
        rig.step()
        assert state_digest(rig) != saved
    finally:
        m.close()
    assert m.newest is not None
    fresh = PeerRig(1 << 16, tensors=8, warm=False)
    restore(name, m.newest, fresh)
    assert state_digest(fresh) == saved
    assert not torch.equal(next(fresh.model.parameters()), next(rig.model.parameters()))


def _fails() -> dict:  # type: ignore[type-arg]
    raise RuntimeError("the measurement broke")


def _allocates(nbytes: int) -> dict:  # type: ignore[type-arg]
    block = bytearray(nbytes)
    return {"n": len(block)}


def test_isolated_child_reports_peak_rss_and_errors() -> None:
    got = run_isolated(_allocates, 64 << 20)
    assert got["n"] == 64 << 20
    assert got["rss"]["peak_bytes"] - got["rss"]["base_bytes"] >= 60 << 20
    with pytest.raises(HpcckptError, match="the measurement broke"):
        run_isolated(_fails)


def test_peers_options_and_overhead_arithmetic() -> None:
    """The run's shape per mode, and overhead taken against each round's own baseline (hand-made figures)."""
    from hpcckpt.bench.peers import PeersOptions, _overhead, _ratios

    q = PeersOptions.make(size_gb=None, device="cpu", dir=None, quick=True)
    assert q.size_bytes == 16_000_000 and q.intervals == (1, 5) and q.rounds == 1 and q.threads == 1
    full = PeersOptions.make(size_gb=2.0, device="cuda", dir=None, quick=False)
    assert full.size_bytes == 2_000_000_000 and full.intervals == (5, 20) and full.overhead_rounds == 3
    assert full.threads == 0
    raw = {"baseline_s": [10.0, 20.0],
           "runs": {"m": {"5": {"wall": [11.0, 30.0], "blocked": [1.0, 2.0], "drain": [1.0, 0.0]}}}}
    fig = _overhead(raw)["m"]
    assert fig["overhead"]["5"] == pytest.approx(0.3)  # median of +10% and +50%
    assert fig["overhead_with_drain"]["5"] == pytest.approx(0.35)
    assert fig["overhead_blocked"]["5"] == pytest.approx(0.1)
    one = {"stall_s": 1.0, "persist_s": 2.0, "restore_s": 4.0}
    ratios = _ratios({"torch_save": one, "hpcckpt_concurrent": {**one, "stall_s": 0.5, "overhead": {"5": 0.1}},
                      "dcp_async": {**one, "overhead": {"5": 0.2}}})
    assert ratios["vs_torch_save"]["hpcckpt_concurrent"]["stall"] == pytest.approx(0.5)
    assert ratios["concurrent_ahead_of_dcp_async"] == {"5": True}


SHARDED = {"dcp_save", "dcp_async", "hpcckpt_sync", "hpcckpt_concurrent"}
SHARDED_KEYS = {"stall_s", "first_stall_s", "save_call_s", "wait_before_step_s", "persist_s", "persist_gbps",
                "restore_s", "restore_gbps", "written_bytes", "written_vs_state"}


@pytest.mark.slow
def test_peers_mesh_2x2_puts_dcp_and_hpcckpt_side_by_side_on_fsdp_tp_state(tmp_path: Path) -> None:
    """``--peers --mesh 2x2 --quick``: 4 gloo ranks, an FSDP2 x TP model, every method's figures
    measured and every restore exact on every rank (one world, ~20 s on 2 cores)."""
    res = bench(["--peers", "--mesh", "2x2", "--quick"], tmp_path)
    assert res["kind"] == "peers_sharded" and res["mesh"] == "2x2" and res["world"] == 4
    assert set(res["methods"]) == SHARDED
    for name, m in res["methods"].items():
        assert SHARDED_KEYS <= set(m), name
        assert all(finite(m[k]) for k in SHARDED_KEYS), (name, {k: m[k] for k in SHARDED_KEYS})
        assert m["restore_exact"] is True and m["exact_ranks"] == [True] * 4, name
        assert len(m["stall_all_s"]) == len(m["persist_all_s"]) == 2 and len(m["restore_all_s"]) == 1
        # each byte of the sharded state once (DCP and hpcckpt alike), plus metadata
        assert 1.0 <= m["written_vs_state"] <= 1.05, (name, m["written_vs_state"])
        if name.startswith("hpcckpt"):  # the capture is part of the save call
            assert finite(m["save_capture_s"]) and 0 < m["save_capture_s"] <= m["save_call_s"], m
    assert res["all_exact"] is True
    # every placement the pair produces: strided FSDP over TP rows, 2-D shards, a TP-replicated bias
    placements = res["model"]["placements"]
    assert "_StridedShard" in placements["0.weight"] and "Replicate" in placements["2.bias"], placements
    assert res["model"]["hidden"] % 4 == 2
    state = res["state_bytes"]
    h = res["model"]["hidden"]
    assert state == 4 * 3 * (h * 256 + h + 256 * h + 256) + 4 * 4, state  # 4 parameters x (param, 2 moments) + steps
    assert set(res["vs_dcp"]) == {"dcp_save", "dcp_async"}
    assert set(res["vs_dcp"]["dcp_async"]) == {"hpcckpt_sync", "hpcckpt_concurrent"}


def test_peers_mesh_options_and_refusals() -> None:
    from hpcckpt.bench.peers_sharded import ShardedOptions, hidden_for, parse_mesh
    from hpcckpt.errors import ConfigError

    assert parse_mesh("2x2") == (2, 2) and parse_mesh("4X1") == (4, 1)
    for bad in ("2", "2x", "axb", "1x1", "0x4", "2x2x2", "5x5"):
        with pytest.raises(ConfigError, match="--mesh"):
            parse_mesh(bad)
    q = ShardedOptions.make(mesh="1x2", size_gb=None, dir=None, quick=True)
    assert (q.dp, q.tp, q.world, q.rounds, q.repeats, q.size_bytes) == (1, 2, 2, 1, 2, 16_000_000)
    for size in (1 << 20, 16_000_000, 256_000_000):
        h = hidden_for(size)
        assert h % 4 == 2 and abs(12 * h * 513 - size) / size < 0.03, (size, h)  # within the rounding to % 4 == 2


@pytest.mark.parametrize("args, says", [
    (["--mesh", "2x2"], "add --peers"),
    (["--peers", "--mesh", "2by2"], "DPxTP"),
    (["--peers", "--mesh", "2x2", "--plot", "x.png"], "drop --plot"),
    (["--peers", "--mesh", "2x2", "--device", "cuda"], "--device cuda"),
])
def test_peers_mesh_bad_options_are_refused_with_the_fix(args: list[str], says: str, tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "hpcckpt.cli", "bench", *args, "--quick"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and says in out.stderr, out.stderr[-2000:]
