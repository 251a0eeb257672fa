"""Two live writers in one checkpoint directory: the second is refused, naming the first.

Real processes hold the lease; a killed holder or a dead one whose lock an orphaned
child still carries never blocks the next job; a requeued instance of the same Slurm
job waits for its predecessor to die instead of failing.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hpcckpt.api import Checkpointer
from hpcckpt.store.lock import WriterBusy
from tests.conftest import REPO
from tests.helpers import tiny_state

pytestmark = [pytest.mark.native, pytest.mark.fault]

# Holds the lease: prints "ready", then, by mode, waits for stdin to close, exits after a
# moment, or hands its lock to a forked child and dies (printing the child's PID).
HOLDER = r'''
import os, sys, time
from hpcckpt.api import Checkpointer
root, mode = sys.argv[1], sys.argv[2]
ck = Checkpointer(root, every_steps=None)
if mode == "orphan":
    child = os.fork()
    if child == 0:
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):  # let the test's pipes close; only the lease descriptor stays
            os.dup2(null, fd)
        time.sleep(600)
        os._exit(0)
    print(child, flush=True)
    os._exit(0)
print("ready", flush=True)
if mode == "wait":
    sys.stdin.read()
elif mode == "brief":
    time.sleep(2)
ck.close()
'''


def holder(root: Path, mode: str, *, job: str | None, restart: int = 0) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "HPCCKPT_"))}
    env["HPCCKPT_CLUSTER"] = "local"
    if job is not None:
        env.update(SLURM_JOB_ID=job, SLURM_RESTART_COUNT=str(restart))
    return subprocess.Popen([sys.executable, "-c", HOLDER, str(root), mode], cwd=REPO, env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.fixture(autouse=True)
def _local(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("HPCCKPT_CLUSTER", "local")


def test_second_live_writer_is_refused_naming_the_holder(ckdir: Path) -> None:
    p = holder(ckdir, "wait", job="4242")
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        with pytest.raises(WriterBusy) as err:
            Checkpointer(ckdir, every_steps=None)
        msg = str(err.value)
        assert f"host {socket.gethostname()}" in msg and f"PID {p.pid}" in msg and "Slurm job 4242" in msg
        assert str(ckdir) in msg and "HPCCKPT_DIR" in msg
    finally:
        p.communicate(input="", timeout=120)
    assert p.returncode == 0, p.stderr
    with Checkpointer(ckdir, every_steps=None) as ck:  # the holder is gone: the directory is free
        assert ck.register(**tiny_state(0)) is None


def test_killed_holder_never_blocks_the_next_job(ckdir: Path) -> None:
    p = holder(ckdir, "wait", job="51")
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    p.send_signal(signal.SIGKILL)
    p.communicate(timeout=120)
    with Checkpointer(ckdir, every_steps=None) as ck:
        assert ck.register(**tiny_state(0)) is None


def test_dead_holder_whose_lock_an_orphan_keeps_is_taken_over(ckdir: Path, caplog: pytest.LogCaptureFixture) -> None:
    p = holder(ckdir, "orphan", job=None)
    out, err = p.communicate(timeout=120)
    orphan = int(out.strip())
    try:
        caplog.set_level(logging.WARNING, logger="hpcckpt")
        with Checkpointer(ckdir, every_steps=None) as ck:
            assert ck.register(**tiny_state(0)) is None
        assert any("which is gone; taking it over" in r.getMessage() for r in caplog.records)
    finally:
        os.kill(orphan, signal.SIGKILL)


def test_requeued_instance_waits_for_its_predecessor(ckdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hpcckpt.store import lock

    p = holder(ckdir, "wait", job="77", restart=0)
    assert p.stdin is not None and p.stdout is not None and p.stdout.readline().strip() == "ready"
    waited: list[str] = []
    real_pause = lock._pause

    def pause(h: lock.Holder) -> None:  # the first wait lets restart 0 finish, as Slurm's kill would
        waited.append(h.describe())
        if not p.stdin.closed:
            p.stdin.close()
        real_pause(h)

    monkeypatch.setattr(lock, "_pause", pause)
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    try:
        with Checkpointer(ckdir, every_steps=None) as ck:
            assert ck.register(**tiny_state(0)) is None
    finally:
        p.wait(timeout=120)
        for pipe in (p.stdout, p.stderr):
            pipe.close()  # type: ignore[union-attr]
    assert waited and "Slurm job 77 (restart 0)" in waited[0] and p.returncode == 0


def test_one_process_may_open_its_directory_twice(ckdir: Path) -> None:
    with Checkpointer(ckdir, every_steps=None), Checkpointer(ckdir, every_steps=None):
        pass
    p = holder(ckdir, "brief", job=None)  # both closed: another process gets the lease
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    p.communicate(timeout=120)
    assert p.returncode == 0


def test_a_duplicate_slurm_job_leaves_quietly_as_superseded(ckdir: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """Under Slurm, the run without the lease is a duplicate (a successor and a requeued
    original both started): it records 'superseded' naming the holder and exits 0."""
    from hpcckpt.lifecycle.ledger import Ledger

    p = holder(ckdir, "wait", job="4300")
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        monkeypatch.setenv("SLURM_JOB_ID", "4301")
        with pytest.raises(SystemExit) as err:
            Checkpointer(ckdir, every_steps=None)
        assert err.value.code == 0
        assert "superseded" in capsys.readouterr().err
        events = [e for e in Ledger(ckdir).read() if e["event"] == "superseded"]
        assert len(events) == 1 and events[0]["by_job_id"] == "4300", events
    finally:
        p.communicate(input="", timeout=120)
    assert p.returncode == 0, p.stderr
