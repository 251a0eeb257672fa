"""Deterministic kill points: SIGKILL just before every fsync / rename / write of the
commit protocol in turn. Whatever the point, the newest committed checkpoint and the one
LATEST names verify, and the next run resumes from it."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from hpcckpt.store import catalog
from hpcckpt.store.commit import TRASH_PREFIX, read_latest
from tests import prefork
from tests.conftest import REPO

pytestmark = [pytest.mark.fault, pytest.mark.native, pytest.mark.slow]


def check_root(root: Path) -> int | None:
    latest = read_latest(root)
    if latest is not None:
        assert catalog.check(root / latest, full=True)[1] == [], latest
    infos = catalog.scan(root)
    # a step directory is whole or absent: never half-written, never half-deleted
    assert all(i.status == "committed" for i in infos if catalog.STEP_RE.match(i.path.name)), infos
    committed = [i for i in infos if i.status == "committed"]
    for info in committed:
        assert catalog.check(info.path, full=True)[1] == [], info.path
    return committed[-1].step if committed else None


def _run(root: Path, engine: str, func: str, n: int) -> subprocess.CompletedProcess[str]:
    return prefork.run(["-m", "tests.fault.kill_at_call", str(root), engine, func, str(n)], cwd=REPO, timeout=300)


# Where each run (six saves) dies, per chain: within the calls a run makes of that function
# (10-11 os.replace a run, each commit's rename among them; 6 os.pwrite: each commit's LATEST).
KILL_POINTS = {"os.fsync": [(1, 11, 21, 31), (6, 16, 26)], "os.write": [(1, 11, 21, 31), (6, 16, 26)],
               "os.replace": [(1, 4, 7, 10), (3, 6, 9)], "os.pwrite": [(1, 3, 5), (2, 4, 6)]}


@pytest.mark.parametrize("engine", ["sync", "concurrent"])
@pytest.mark.parametrize("func", list(KILL_POINTS))
def test_kill_before_each_protocol_call(tmp_path: Path, engine: str, func: str) -> None:
    """Two chains of runs, each in its own directory: every run resumes from what the one
    before it left and dies at the n-th call (counted from its own start), so the kill
    points fall on a first save in an empty directory and on later saves of resumed runs;
    a last run of each chain must finish."""
    killed = 0
    for chain, points in enumerate(KILL_POINTS[func]):
        root = tmp_path / f"{func}-{chain}"
        newest: int | None = None
        for n in points:
            p = _run(root, engine, func, n)
            # killed at the n-th call, or finished its steps before making n calls; a run
            # that resumed from what the killed one before it left never fails otherwise
            assert p.returncode == -9 or (p.returncode == 0 and "finished" in p.stdout), p.stderr[-2000:]
            killed += p.returncode == -9
            step = check_root(root)
            assert step is not None or newest is None, "a kill lost the committed checkpoints"
            assert newest is None or step >= newest, (newest, step)
            newest = step
        # the restarted run resumes from the newest good checkpoint and finishes its steps
        p = _run(root, engine, func, 0)
        assert p.returncode == 0 and "finished" in p.stdout, p.stderr[-2000:]
        after = check_root(root)
        assert after is not None and (newest is None or after > newest)
    assert killed >= 3, f"{func} was called too rarely to kill the process"


@pytest.mark.parametrize("func,n", [("os.unlink", 1), ("os.unlink", 2), ("os.unlink", 3), ("os.rmdir", 1)])
def test_kill_during_pruning_leaves_no_half_deleted_checkpoint(tmp_path: Path, func: str, n: int) -> None:
    """Retention (keep=2) deletes a step directory: killed at its n-th file or directory removal."""
    root = tmp_path / "ck"
    p = _run(root, "sync", func, n)
    assert p.returncode == -9, p.stderr[-2000:]  # pruning happens on every save from the third on
    before = check_root(root)
    leftovers = [e for e in root.iterdir() if e.name.startswith(TRASH_PREFIX)]
    assert leftovers  # the directory being deleted was renamed aside first: invisible to ls
    p2 = _run(root, "sync", func, 0)
    assert p2.returncode == 0 and "finished" in p2.stdout, p2.stderr[-2000:]
    after = check_root(root)
    assert after is not None and before is not None and after > before
    assert not [e for e in root.iterdir() if e.name.startswith(TRASH_PREFIX)]  # swept by the next prune
