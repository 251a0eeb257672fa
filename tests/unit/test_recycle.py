"""A pruned checkpoint's rank file reused by the next save (``engines/recycle``): every
checkpoint still reads back exactly, the spare is never listed or left behind, one of
another layout is never written into, and a crash's spare is swept once stale."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from hpcckpt.engines.recycle import Recycler
from hpcckpt.store import catalog
from hpcckpt.store.commit import SPARE_PREFIX, STALE_SPARE_AGE_S, discard, sweep_candidates
from tests.unit.test_concurrent_engine import Rig, assert_same

pytestmark = pytest.mark.native


def _spares(root: Path) -> list[str]:
    return [n for n in os.listdir(root) if n.startswith(SPARE_PREFIX)]


def test_saves_overwrite_pruned_files_and_read_back_exactly(tmp_path: Path) -> None:
    rig = Rig(tmp_path / "ck", keep=1)
    try:
        inodes = []
        for step in range(1, 8):
            rig.train_step()
            want = rig.snapshot(step)
            rig.engine.save(rig.state.capture(step=step), step).wait()
            rig.engine._queue.join()  # its pruned step kept or deleted: what the next save finds is known
            assert_same(rig.load(step), want)  # the newest, written over a pruned step's blocks
            inodes.append(os.stat(tmp_path / "ck" / f"step-{step}" / "rank-0.h5").st_ino)
            assert [i.step for i in catalog.scan(tmp_path / "ck")] == [step]  # a spare is never listed
        # Steps 4 to 7: a pruned step is reused once the next commit's fsync of the root made its
        # removal durable (with keep=1 the prune's renames wait for it: publish.commit_and_prune).
        assert rig.engine._recycler is not None and rig.engine._recycler.reused == 4
        assert len(set(inodes)) <= 3  # three files take turns: committed, pruned (not yet durably), being written
        info = catalog.inspect_step(tmp_path / "ck", 7, full=True)
        assert info is not None and info.status == "committed", info
    finally:
        rig.engine.close()
    assert _spares(tmp_path / "ck") == []  # close deletes it
    assert sorted(os.listdir(tmp_path / "ck")) == [".hpcckpt.lock", "LATEST", "step-7"]


def test_a_recycled_save_rewrites_the_pruned_manifest_in_place_and_adds_no_entry(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The commit of a save made of a spare keeps the spare's manifest inode (rewritten with
    this step's manifest, of another length) and fsyncs no directory but the root; what it
    commits verifies in full and reads back exactly."""
    from hpcckpt.store import commit as commit_mod
    root = tmp_path / "ck"
    rig = Rig(root, keep=1)
    synced: list[str] = []
    real = commit_mod.fsync_path
    monkeypatch.setattr(commit_mod, "fsync_path", lambda p: (synced.append(str(p)), real(p))[1])
    try:
        manifests = {}
        for step in (1, 2, 30, 4000, 50000):  # the step's digits change the manifest's length
            rig.train_step()
            want = rig.snapshot(step)
            synced.clear()
            reused = rig.engine._recycler.reused  # type: ignore[union-attr]
            rig.engine.save(rig.state.capture(step=step), step).wait()
            rig.engine._queue.join()
            st = os.stat(root / f"step-{step}" / "manifest.json")
            manifests[step] = (st.st_ino, st.st_size)
            assert_same(rig.load(step), want)
            info = catalog.inspect_step(root, step, full=True)
            assert info is not None and info.status == "committed", info
            recycled = rig.engine._recycler.reused > reused  # type: ignore[union-attr]
            # Steps 1, 2 and 30 made fresh directories: step 1, pruned at step 2's commit, is
            # reused once step 30's fsync of the root made that durable.
            assert recycled == (step >= 4000)
            assert len([p for p in synced if ".tmp-" in p]) == (0 if recycled else 1), synced
            assert len([p for p in synced if p == str(root)]) == 1, synced  # one fsync of the root a commit
        assert manifests[4000][0] == manifests[1][0] and manifests[50000][0] == manifests[2][0]  # the same inodes
        assert manifests[50000][1] != manifests[2][1]  # rewritten to another length, and truncated or grown
    finally:
        rig.engine.close()


def test_rewrite_durable_rewrites_only_a_regular_file_in_place(tmp_path: Path) -> None:
    from hpcckpt.store.commit import rewrite_durable
    f = tmp_path / "m"
    f.write_bytes(b"x" * 100)
    ino = f.stat().st_ino
    assert rewrite_durable(f, b"short") and f.read_bytes() == b"short" and f.stat().st_ino == ino
    assert not rewrite_durable(tmp_path / "absent", b"y") and not (tmp_path / "absent").exists()
    (tmp_path / "link").symlink_to(f)
    with pytest.raises(OSError):
        rewrite_durable(tmp_path / "link", b"z")
    assert f.read_bytes() == b"short"


def test_a_file_of_another_layout_is_never_written_into(tmp_path: Path) -> None:
    """The state's shapes change between saves: the spare of the old layout is dropped,
    the new layout's saves start from fresh files and then recycle their own."""
    rig = Rig(tmp_path / "ck", keep=1)
    try:
        for step in range(1, 5):
            rig.train_step()
            rig.engine.save(rig.state.capture(step=step), step).wait()
            rig.engine._queue.join()
        rig.state.register("extra", torch.nn.Linear(5, 7))  # a new object: a new layout
        rig.engine.bind(rig.state)
        before = rig.engine._recycler.reused  # type: ignore[union-attr]
        for step in range(5, 9):
            rig.train_step()
            want = rig.snapshot(step)
            rig.engine.save(rig.state.capture(step=step), step).wait()
            rig.engine._queue.join()
            assert_same(rig.load(step), want)
            if step == 5:
                assert rig.engine._recycler.reused == before  # type: ignore[union-attr]
        assert rig.engine._recycler.reused > before  # type: ignore[union-attr]
    finally:
        rig.engine.close()
    assert _spares(tmp_path / "ck") == []


def test_a_spare_removed_by_someone_else_means_a_fresh_file(tmp_path: Path) -> None:
    rig = Rig(tmp_path / "ck", keep=1)
    try:
        for step in range(1, 4):
            rig.train_step()
            rig.engine.save(rig.state.capture(step=step), step).wait()
        rig.engine._queue.join()  # the finisher keeps the spare after the handle is finished
        held = _spares(tmp_path / "ck")
        assert len(held) == 1
        os.rename(tmp_path / "ck" / held[0], tmp_path / "elsewhere")
        rig.train_step()
        want = rig.snapshot(4)
        rig.engine.save(rig.state.capture(step=4), 4).wait()
        assert_same(rig.load(4), want)
    finally:
        rig.engine.close()


def test_only_one_rank_without_levels_and_with_retention_recycles(tmp_path: Path) -> None:
    rig = Rig(tmp_path / "ck", keep=None)  # type: ignore[arg-type]  # no retention: nothing pruned
    try:
        assert rig.engine._recycler is None
    finally:
        rig.engine.close()


def test_a_stale_spare_is_swept_and_a_fresh_one_kept(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    root.mkdir()
    fresh, stale = root / f"{SPARE_PREFIX}aaaa", root / f"{SPARE_PREFIX}bbbb"
    for d in (fresh, stale):
        d.mkdir()
        (d / "rank-0.h5").write_bytes(b"x" * 100)
    old = time.time() - STALE_SPARE_AGE_S - 5
    os.utime(stale, (old, old))
    assert sweep_candidates(root, exclude=set()) == [stale]
    discard(root, [])
    assert fresh.exists() and not stale.exists()


def test_keep_holds_only_a_pruned_step_of_the_current_layout(tmp_path: Path) -> None:
    rig = Rig(tmp_path / "ck", keep=1)
    try:
        rig.train_step()
        rig.engine.save(rig.state.capture(step=1), 1).wait()
        layout = rig.engine._staging.layout  # type: ignore[union-attr]
    finally:
        rig.engine.close()
    root = tmp_path / "root"
    root.mkdir()
    rec = Recycler(root, "rank-0.h5")

    def trash(name: str, *files: tuple[str, int]) -> Path:
        d = root / f".trash-{name}-0123abcd"
        d.mkdir()
        for f, size in files:
            (d / f).write_bytes(b"\0" * size)
        return d
    size = layout.template[1]  # type: ignore[index]
    unknown = trash("step-1", ("rank-0.h5", size), ("manifest.json", 10))  # no save of ours wrote it
    rec.written("step-2", layout)
    wrong_size = trash("step-2", ("rank-0.h5", size + 4096), ("manifest.json", 10))
    rec.written("step-3", layout)
    extra_file = trash("step-3", ("rank-0.h5", size), ("manifest.json", 10), ("rank-1.h5", 5))
    rec.written("step-4", layout)
    good = trash("step-4", ("rank-0.h5", size), ("manifest.json", 10))
    doomed = [unknown, wrong_size, extra_file, good]
    left = rec.keep(doomed, layout)
    assert left == [unknown, wrong_size, extra_file]
    (spare,) = [root / n for n in _spares(root)]
    assert sorted(os.listdir(spare)) == ["manifest.json", "rank-0.h5"]  # the next commit rewrites the manifest
    assert not rec.take(tmp_path / "other.tmp", object())  # type: ignore[arg-type]  # another layout
    assert rec.take(root / "step-5.tmp-x", layout) and (root / "step-5.tmp-x" / "rank-0.h5").stat().st_size == size
    assert not rec.take(root / "step-6.tmp-x", layout)  # one spare at a time
    rec.close()


def test_a_pruned_step_is_reused_or_deleted_only_after_an_fsync_of_the_root_covers_its_removal(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """keep=1: retention renames the previous step aside after the commit's fsync of the root,
    without one of its own; until the next fsync of the root (the next commit's, or close's)
    that tree stays whole (a crash may bring it back under its name: it must still be that
    checkpoint), and only then is it reused or deleted."""
    from hpcckpt.store import commit as commit_mod
    root = tmp_path / "ck"
    events: list[tuple[str, str]] = []
    real_fsync, real_rename = commit_mod.fsync_path, os.rename
    monkeypatch.setattr(commit_mod, "fsync_path", lambda p: (events.append(("fsync", str(p))), real_fsync(p))[1])
    monkeypatch.setattr(os, "rename", lambda a, b: (events.append(("rename", f"{a} -> {b}")), real_rename(a, b))[1])
    rig = Rig(root, keep=1)
    try:
        for step in (1, 2):
            rig.train_step()
            rig.engine.save(rig.state.capture(step=step), step).wait()
            rig.engine._queue.join()
        aside = [n for n in os.listdir(root) if n.startswith(".trash-step-1-")]
        assert len(aside) == 1 and rig.engine._unsynced == [root / aside[0]]  # waiting for an fsync of the root
        assert (root / aside[0] / "rank-0.h5").stat().st_size > 0 and (root / aside[0] / "manifest.json").exists()
        events.clear()
        rig.train_step()
        rig.engine.save(rig.state.capture(step=3), 3).wait()
        rig.engine._queue.join()
        assert not (root / aside[0]).exists()  # reused as the next spare, or deleted
        first_use = next(i for i, (kind, what) in enumerate(events) if kind == "rename" and what.startswith(str(root / aside[0])))
        assert ("fsync", str(root)) in events[:first_use], events  # step 3's commit made its removal durable first
    finally:
        rig.engine.close()
    assert sorted(os.listdir(root)) == [".hpcckpt.lock", "LATEST", "step-3"]  # close settled the last one
