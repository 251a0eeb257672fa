"""Multi-level checkpoints as a guest on a shared node (issue 51, items 1 and 2).

- A node-local root and the directory holding it are used only when they are this user's own
  and private (``fsio.owned_private`` / ``fsio.safe_parent``, the rule ``JobEnv.staging_dir``
  applies): another user's directory, a world-writable one or a symlink is refused with a
  ConfigError naming the path and the fix; a missing one is made 0700.
- The pointer file is never written through a link planted under its temporary name.
- Run lineage: a run after the checkpoint directory was deleted starts afresh, although the
  node-local copies of the old run are still there (they are removed, with a log line).
- A node-local step whose file fails its read on one node is mended from the partner copy and
  restored (not an older step from the shared level).

The ownership cases chown directories to another uid: they need root (CI runs as root).
"""
from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest

from hpcckpt.errors import ConfigError
from hpcckpt.levels import POINTER, _point, local_root
from hpcckpt.store import catalog
from hpcckpt.store.scavenge import level_key
from tests.unit.test_distributed_state import assert_equal_states, dumps, result, run_world

OTHER_UID = 65534  # nobody: owns what "another user" made


def _needs_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("making a directory another user's (chown) needs root")


def test_a_missing_node_local_root_is_made_private(tmp_path: Path) -> None:
    root = local_root(tmp_path / "ckpt", str(tmp_path / "local" / "%n"), "node-0", None)
    assert root == tmp_path / "local" / "node-0" / level_key(tmp_path / "ckpt")
    for d in (root, root.parent):
        st = os.lstat(d)
        assert st.st_uid == os.geteuid() and (st.st_mode & 0o777) == 0o700, (d, oct(st.st_mode))


@pytest.mark.parametrize("case", ["other user's parent", "other user's root", "world-writable parent",
                                  "world-writable root", "root is a symlink"])
def test_a_node_local_root_another_user_could_have_made_or_changed_is_refused(tmp_path: Path, case: str) -> None:
    if "other user" in case:
        _needs_root()
    ckpt, base = tmp_path / "ckpt", tmp_path / "local"
    root = base / level_key(ckpt)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    base.mkdir(mode=0o700)
    bad = base
    if case == "root is a symlink":
        root.symlink_to(elsewhere)
        bad = root
    elif "root" in case:
        root.mkdir(mode=0o700)
        bad = root
    if case.startswith("world-writable"):
        bad.chmod(0o777)
    elif case.startswith("other user's"):
        bad.chmod(0o777)
        os.chown(bad, OTHER_UID, OTHER_UID)
    with pytest.raises(ConfigError) as err:
        local_root(ckpt, str(base), "node-0", None)
    text = str(err.value)
    assert str(bad) in text and "HPCCKPT_LOCAL_DIR" in text and "local_dir=" in text, text
    assert not any(elsewhere.iterdir())  # nothing was made through a link


@pytest.mark.parametrize("case", ["made by another user", "a symlink"])
def test_the_default_root_in_a_directory_another_user_made_is_refused(tmp_path: Path, case: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The default /dev/shm/hpcckpt-<uid> made first by another user (0777), or planted as a
    link to a directory of hers: refused, nothing made in it."""
    import hpcckpt.levels as levels
    shm = tmp_path / "shm"
    shm.mkdir()
    shm.chmod(0o1777)
    monkeypatch.setattr(levels, "SHM", shm)
    base = shm / f"hpcckpt-{os.geteuid()}"
    hers = tmp_path / "hers"
    hers.mkdir(mode=0o777)
    hers.chmod(0o777)
    if case == "a symlink":
        base.symlink_to(hers)
    else:
        _needs_root()
        base.mkdir(mode=0o777)
        base.chmod(0o777)
        os.chown(base, OTHER_UID, OTHER_UID)
    with pytest.raises(ConfigError) as err:
        levels.local_root(tmp_path / "ckpt", None, "node-0", None)
    assert str(base) in str(err.value) and "HPCCKPT_LOCAL_DIR" in str(err.value), str(err.value)
    assert not any(hers.iterdir()) and (case == "a symlink" or not any(base.iterdir()))


def test_the_pointer_is_never_written_through_a_planted_link(tmp_path: Path) -> None:
    root = local_root(tmp_path / "ckpt", str(tmp_path / "local"), "node-0", None)
    victim = tmp_path / "victim"
    victim.write_bytes(b"the user's own file\n")
    victim.chmod(0o600)
    for pid in range(os.getpid() - 50, os.getpid() + 50):
        (root / f"{POINTER}.{pid}").symlink_to(victim)
    _point(root, tmp_path / "ckpt")
    assert victim.read_bytes() == b"the user's own file\n"
    assert (root / POINTER).is_file() and not (root / POINTER).is_symlink()
    assert str(tmp_path / "ckpt") in (root / POINTER).read_text()


def test_the_run_lineage_is_made_once_and_kept(tmp_path: Path) -> None:
    from hpcckpt.levels import shared_lineage
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    first = shared_lineage(ckpt)
    assert shared_lineage(ckpt) == first and len(first) == 32
    shutil.rmtree(ckpt)
    ckpt.mkdir()
    assert shared_lineage(ckpt) != first  # a directory made anew: another lineage


@pytest.mark.native
def test_a_run_after_the_checkpoint_directory_was_deleted_starts_afresh(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    from hpcckpt.api import Checkpointer
    from tests.helpers import tiny_state, train_step
    monkeypatch.setenv("HPCCKPT_CLUSTER", "local")
    ckpt, local = tmp_path / "ckpt", str(tmp_path / "local")
    options = {"every_steps": 5, "local_every_steps": 1, "local_dir": local}
    objs = tiny_state(0)
    with Checkpointer(ckpt, **options) as ck:  # type: ignore[arg-type]
        ck.register(**objs)
        for _ in ck.steps(7):
            train_step(objs)
    root = local_root(ckpt, local, "node-0", None)
    assert [i.step for i in catalog.committed_newest_first(root)][:1] == [7]
    shutil.rmtree(ckpt)  # the user starts over

    caplog.set_level(logging.INFO, logger="hpcckpt")
    objs = tiny_state(1)
    with Checkpointer(ckpt, **options) as ck:  # type: ignore[arg-type]
        assert ck.register(**objs) is None  # fresh: not step 7 from the old node-local copies
        assert ck.resumed_from is None
        first = [i.step for i in catalog.committed_newest_first(root)]
        for _ in ck.steps(3):
            train_step(objs)
    assert first == []  # the old lineage's steps were removed before anything was saved
    assert any("belongs to another run lineage" in r.getMessage() for r in caplog.records)
    assert [i.step for i in catalog.committed_newest_first(ckpt)][:1] == [3]


WORLD = 4


@pytest.mark.slow
@pytest.mark.native
def test_a_damaged_node_local_file_is_mended_from_the_partner_copy_before_an_older_level(tmp_path: Path) -> None:
    """2 nodes x 2 ranks, node-local + partner every step, shared every 10; stopped without a
    final save at 25. One byte of rank 2's file in node 1's step 25 flips (same size: only
    the read's checksum sees it). The resume reads step 25, fails, mends the file from node 0's
    partner copy and restores step 25 (level "partner"), bit-identical; not step 20."""
    ckpt, local = tmp_path / "ckpt", str(tmp_path / "local" / "%n")
    common = ("--ckpt", str(ckpt), "--local-every", "1", "--local-dir", local, "--ranks-per-node", "2",
              "--every", "10")
    run_world(tmp_path, WORLD, "--phase", "save", "--stop-at", "30", "--crash-at", "25", *common)
    node1 = local_root(ckpt, local, "node-1", None)
    damaged = node1 / "step-25" / "rank-2.pt"
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    run_world(tmp_path, WORLD, "--phase", "resume", "--total", "30", *common)
    for r in range(WORLD):
        got = result(tmp_path, "resume", r)
        assert (got["restored"], got["level"]) == (25, "partner"), (r, got)
    for r, (saved, restored) in enumerate(zip(dumps(tmp_path, "saved", WORLD), dumps(tmp_path, "restored", WORLD))):
        assert_equal_states(restored, saved, f"rank {r}")
