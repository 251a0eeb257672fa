"""Multi-level checkpoints (hpcckpt.levels) on 4 gloo ranks on CPU, as 2 nodes of 2 ranks.

Node-local + partner every step, the shared level every 10: a run stops at step 25 without
a final save (as a crash would), a node's node-local directory is lost, and the next run
restores step 25 from the partner copies, bit-identical to the state that was saved.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from hpcckpt.levels import local_root
from hpcckpt.levels.restore import _plan
from hpcckpt.levels.topology import Topology
from hpcckpt.store import catalog
from tests.unit.test_distributed_state import assert_equal_states, dumps, result, run_world

WORLD = 4


def test_topology_pairs_each_rank_with_the_same_place_on_the_next_node() -> None:
    t = Topology(0, ("a", "a", "b", "b", "c"))
    assert t.nodes == ["a", "b", "c"] and t.leaders == [0, 2, 4]
    assert [t.partner(r) for r in range(5)] == [2, 3, 4, 4, 0]
    assert t.wards(4) == [2, 3] and t.wards(0) == [4]
    assert Topology(0, ("a", "a")).partner(1) is None


def test_plan_takes_the_newest_step_some_node_holds_whole_unless_the_shared_level_is_newer() -> None:
    files = {"rank-0.pt": 10, "rank-1.pt": 10, "manifest.json": 5}
    whole = {"files": files, "have": list(files)}
    half = {"files": files, "have": ["rank-0.pt", "manifest.json"]}
    views = [{"7": whole, "8": half}, None, {"7": whole}, None]
    assert _plan(views, [0, 2], None) == {"step": 7, "transfers": []}  # 8: nobody holds rank-1.pt
    views[2] = {"7": whole, "8": {"files": files, "have": ["rank-1.pt"]}}
    assert _plan(views, [0, 2], None) == {"step": 8, "transfers": [[2, 0, "rank-1.pt", 10], [0, 2, "manifest.json", 5],
                                                                    [0, 2, "rank-0.pt", 10]]}
    assert _plan(views, [0, 2], 9) is None


def _dirs(tmp: Path) -> tuple[Path, str]:
    return tmp / "ckpt", str(tmp / "local" / "%n")


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["sync", "concurrent"])
def test_a_lost_node_local_directory_is_restored_from_the_partner_copies(tmp_path: Path, engine: str) -> None:
    ckpt, local = _dirs(tmp_path)
    common = ("--ckpt", str(ckpt), "--engine", engine, "--local-every", "1", "--local-dir", local,
              "--ranks-per-node", "2", "--every", "10")
    run_world(tmp_path, WORLD, "--phase", "save", "--stop-at", "30", "--crash-at", "25", *common)
    assert [i.step for i in catalog.committed_newest_first(ckpt)][0] == 20  # shared: every 10
    node1 = local_root(ckpt, local, "node-1", None)
    assert catalog.inspect_step(node1, 25) is not None
    shutil.rmtree(node1.parent)  # node 1's node-local storage is gone
    run_world(tmp_path, WORLD, "--phase", "resume", "--total", "30", *common)
    for r in range(WORLD):
        got = result(tmp_path, "resume", r)
        assert (got["restored"], got["level"]) == (25, "partner")
    for r, (saved, restored) in enumerate(zip(dumps(tmp_path, "saved", WORLD), dumps(tmp_path, "restored", WORLD))):
        assert_equal_states(restored, saved, f"rank {r}")
    # Training went on at every level: each node holds whole copies (its ranks' and its partner's
    # files) of the newest local_keep=2 steps, and the run's end reached the shared level.
    node0 = local_root(ckpt, local, "node-0", None)
    assert [i.step for i in catalog.committed_newest_first(node0)] == [30, 29]
    assert [i.step for i in catalog.committed_newest_first(node1)] == [30, 29]
    assert [i.step for i in catalog.committed_newest_first(ckpt)][0] == 30


@pytest.mark.slow
def test_without_node_local_copies_the_shared_level_is_restored(tmp_path: Path) -> None:
    ckpt, local = _dirs(tmp_path)
    common = ("--ckpt", str(ckpt), "--local-every", "1", "--local-dir", local, "--ranks-per-node", "2",
              "--every", "10")
    run_world(tmp_path, WORLD, "--phase", "save", "--stop-at", "30", "--crash-at", "25", *common)
    shutil.rmtree(tmp_path / "local")
    run_world(tmp_path, WORLD, "--phase", "resume", "--total", "30", *common)
    assert {(result(tmp_path, "resume", r)["restored"], result(tmp_path, "resume", r)["level"])
            for r in range(WORLD)} == {(20, "shared")}


@pytest.mark.slow
def test_a_shared_step_written_by_a_newer_hpcckpt_is_not_passed_over_for_an_older_node_local_one(
        tmp_path: Path) -> None:
    """The shared level's newest step is in a format this version does not read (a newer
    hpcckpt wrote it; made here by renaming step 20 to 30 and marking it hpcckpt/99), and the
    node-local level holds step 25: restoring 25 would lose steps 26-30. Every rank refuses,
    naming the newer checkpoint, and nothing is deleted."""
    import json

    from hpcckpt.store.commit import MANIFEST, seal_manifest
    ckpt, local = _dirs(tmp_path)
    common = ("--ckpt", str(ckpt), "--local-every", "1", "--local-dir", local, "--ranks-per-node", "2",
              "--every", "10")
    run_world(tmp_path, WORLD, "--phase", "save", "--stop-at", "30", "--crash-at", "25", *common)
    (ckpt / "step-20").rename(ckpt / "step-30")
    m = json.loads((ckpt / "step-30" / MANIFEST).read_text())
    m["format"] = "hpcckpt/99"  # sealed as written: no format this version encodes
    (ckpt / "step-30" / MANIFEST).write_bytes(seal_manifest(m))
    codes = run_world(tmp_path, WORLD, "--phase", "resume", "--total", "40", *common, expect=None)
    assert all(c != 0 for c in codes), codes
    logs = [(tmp_path / f"log-resume-r{r}.txt").read_text() for r in range(WORLD)]
    assert all("written by a newer hpcckpt" in log and "will not resume an older checkpoint" in log
               for log in logs), logs[0][-2000:]
    node0 = local_root(ckpt, local, "node-0", None)
    assert (ckpt / "step-30").is_dir() and catalog.inspect_step(node0, 25) is not None
