"""Root's hooks among hostile users: two unprivileged users share a sticky (1777)
staging root, as the README allows. User A owns job 200 and swaps her ``job-200``
with a symlink to user B's ``job-201`` (``renameat2(RENAME_EXCHANGE)``, so the name
is always there, as fast as she can) while root's epilog cleans job 200; she also
loops ``mkfifo``/``unlink`` on ``hooks.jsonl`` while root's prolog records. The epilog
must never delete anything outside job 200's own staging, and no hook may hang.
Rounds are counted, not timed."""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.localusers import local_user

pytestmark = [pytest.mark.fault]

PROLOG, EPILOG = REPO / "slurm" / "prolog", REPO / "slurm" / "epilog"
USERS = ("hpcktest-a", "hpcktest-b")
SYSTEM_PYTHON = "/usr/bin/python3"  # the users cannot reach the venv's interpreter under /root
ROUNDS = 30

SWAPPER = r'''
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
root, mine, victim, stop = sys.argv[1:5]
os.chdir(root)
link = mine + ".x"
while not os.path.exists(stop):
    try:
        if not os.path.lexists(mine):
            os.mkdir(mine, 0o700)
        if not os.path.lexists(link):
            os.symlink(os.path.join(root, victim), link)
        libc.renameat2(-100, mine.encode(), -100, link.encode(), 2)  # RENAME_EXCHANGE
    except OSError:
        pass
'''

FIFO_LOOP = r'''
import os, sys
root, stop = sys.argv[1:3]
path = os.path.join(root, "hooks.jsonl")
while not os.path.exists(stop):
    try:
        os.mkfifo(path, 0o666)
    except OSError:
        pass
    try:
        os.unlink(path)
    except OSError:
        pass
'''


@pytest.fixture(scope="module")
def users() -> Iterator[dict[str, tuple[int, int]]]:
    if os.geteuid() != 0:
        pytest.skip("two unprivileged users and root's hooks need root (useradd, setuid)")
    if shutil.which("useradd") is None or not os.access(SYSTEM_PYTHON, os.X_OK):
        pytest.skip(f"needs useradd and {SYSTEM_PYTHON}")
    with local_user(USERS[0]) as a, local_user(USERS[1]) as b:
        yield {USERS[0]: (a.uid, a.gid), USERS[1]: (b.uid, b.gid)}


@pytest.fixture
def sticky_root() -> Iterator[Path]:
    """A shared 1777 staging root in a root-owned 0755 directory the users can reach."""
    base = Path(tempfile.mkdtemp(prefix="hpcckpt-hooks-", dir="/tmp"))
    base.chmod(0o755)
    root = base / "staging"
    root.mkdir()
    root.chmod(0o1777)
    try:
        yield root
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _hook(hook: Path, root: Path, job_id: int, uid: int, gid: int) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "SLURM_JOB_ID": str(job_id), "SLURM_JOB_UID": str(uid),
           "SLURM_JOB_GID": str(gid), "SLURMD_NODENAME": "n1", "HPCCKPT_STAGING_ROOT": str(root)}
    # A hook that hangs fails here (the timeout is far above a normal run's fraction of a second).
    return subprocess.run([str(hook)], env=env, cwd="/", capture_output=True, text=True, timeout=120, check=False)


def _as_user(script: str, uid: int, gid: int, *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([SYSTEM_PYTHON, "-c", script, *args], user=uid, group=gid, extra_groups=[],
                            cwd="/", env={"PATH": "/usr/bin:/bin"})


def _snapshot(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_epilog_swap_loop_never_deletes_another_jobs_staging(users: dict[str, tuple[int, int]],
                                                             sticky_root: Path) -> None:
    (uid_a, gid_a), (uid_b, gid_b) = users[USERS[0]], users[USERS[1]]
    assert _hook(PROLOG, sticky_root, 201, uid_b, gid_b).returncode == 0
    victim = sticky_root / "job-201"
    assert victim.is_dir() and victim.stat().st_uid == uid_b
    for i in range(5):
        (victim / f"data-{i}").write_bytes(bytes([i]) * 100)
    outside = sticky_root.parent / "outside"
    outside.mkdir()
    (outside / "keep").write_text("root's\n")
    before, before_outside = _snapshot(victim), _snapshot(outside)
    stop = sticky_root.parent / "stop"
    removed = 0
    for _ in range(ROUNDS):
        assert _hook(PROLOG, sticky_root, 200, uid_a, gid_a).returncode == 0
        mine = sticky_root / "job-200"
        if mine.is_dir() and not mine.is_symlink():
            (mine / "staged").write_bytes(b"x" * 10)
        swapper = _as_user(SWAPPER, uid_a, gid_a, str(sticky_root), "job-200", "job-201", str(stop))
        try:
            ran = _hook(EPILOG, sticky_root, 200, uid_a, gid_a)
        finally:
            stop.touch()
            swapper.wait(timeout=60)
            stop.unlink()
        assert ran.returncode == 0, ran.stderr
        removed += not os.path.lexists(mine) or mine.is_symlink()
        assert victim.is_dir() and not victim.is_symlink(), "root's epilog removed another job's staging"
        assert _snapshot(victim) == before, "root's epilog deleted inside another job's staging"
        for leftover in (sticky_root / "job-200", sticky_root / "job-200.x"):  # reset the attacker's names
            if leftover.is_symlink() or leftover.is_file():
                leftover.unlink()
            elif leftover.is_dir():
                shutil.rmtree(leftover)
    assert _snapshot(outside) == before_outside
    assert removed > 0, "the epilog never removed job 200's own staging"


def test_fifo_loop_on_the_record_file_never_hangs_a_hook(users: dict[str, tuple[int, int]],
                                                        sticky_root: Path) -> None:
    uid_a, gid_a = users[USERS[0]]
    stop = sticky_root.parent / "stop"
    looper = _as_user(FIFO_LOOP, uid_a, gid_a, str(sticky_root), str(stop))
    try:
        for job in range(300, 300 + ROUNDS // 3):
            for hook in (PROLOG, EPILOG):
                ran = _hook(hook, sticky_root, job, uid_a, gid_a)  # raises TimeoutExpired if it hangs
                assert ran.returncode == 0, ran.stderr
    finally:
        stop.touch()
        looper.wait(timeout=60)
    record = sticky_root / "hooks.jsonl"
    if os.path.lexists(record):  # whatever is left there now: root never wrote into a file of A's
        st = os.lstat(record)
        assert not (st.st_uid == uid_a and st.st_size > 0)
