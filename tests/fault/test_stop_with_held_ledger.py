"""A stop signal ends the job within its grace even when the ledger cannot be written.

A real training process checkpoints every step while another process holds
``.ledger.lock`` for good (a writer stopped inside an append), or while ``ledger.jsonl``
is a FIFO. Every ledger append gives up after its bounded wait and says so; SIGUSR2
still ends the job with its final checkpoint and exit 75. The bound (60 s) is generous:
nothing here depends on how fast the machine is, only on nothing blocking for good.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from hpcckpt.lifecycle.ledger import LEDGER, LOCK
from hpcckpt.store import catalog
from tests.conftest import REPO

pytestmark = [pytest.mark.fault]

GRACE_S = 60.0  # far above what the stop needs (a few bounded 2 s lock waits); no tight timing

TRAIN = r'''
import sys, torch
from hpcckpt import Checkpointer
model = torch.nn.Linear(8, 8)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
with Checkpointer(sys.argv[1], engine="sync", every_steps=1, keep=2) as ck:
    ck.register(model=model, optimizer=opt)
    for step in ck.steps(10**9):
        opt.zero_grad(); model(torch.ones(1, 8)).sum().backward(); opt.step()
        if step == 0:
            print("ready", flush=True)
'''

HOLD = r'''
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(3600)
'''


def _line(proc: subprocess.Popen[str], want: str, within_s: float) -> None:
    """Wait (generously) for ``want`` on the process's stdout; fail, not hang, if it never comes."""
    assert proc.stdout is not None
    stdout = proc.stdout
    seen = threading.Event()

    def read() -> None:
        for line in stdout:
            if line.strip() == want:
                seen.set()
                return
    threading.Thread(target=read, daemon=True).start()
    if not seen.wait(within_s):
        proc.kill()
        err = proc.stderr.read() if proc.stderr else ""
        pytest.fail(f"never printed {want!r} within {within_s:.0f} s: {err[-3000:]}")


@pytest.fixture
def held_lock(tmp_path: Path) -> Iterator[Path]:
    root = tmp_path / "ck"
    root.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(root / LOCK)], stdout=subprocess.PIPE, text=True)
    try:
        _line(holder, "held", 60)
        yield root
    finally:
        holder.kill()
        holder.communicate()


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HPCCKPT_", "SLURM_"))}
    env["HPCCKPT_CLUSTER"] = "local"
    return env


def _stop_within_grace(root: Path) -> str:
    job = subprocess.Popen([sys.executable, "-c", TRAIN, str(root)], cwd=REPO, env=_env(), text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _line(job, "ready", 120)  # startup (torch import) and the first step, lock waits included
        job.send_signal(signal.SIGUSR2)
        try:
            _, err = job.communicate(timeout=GRACE_S)
        except subprocess.TimeoutExpired:
            job.kill()
            _, err = job.communicate()
            pytest.fail(f"SIGUSR2 did not end the job within {GRACE_S:.0f} s: {err[-3000:]}")
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    assert job.returncode == 75, err[-3000:]
    assert "stopping at step" in err and "taking the final checkpoint" in err, err[-3000:]
    return err


def test_a_stop_ends_the_job_while_another_process_holds_the_ledger_lock(held_lock: Path) -> None:
    err = _stop_within_grace(held_lock)
    assert "stayed locked" in err and "skipped, training goes on" in err, err[-3000:]
    assert not (held_lock / LEDGER).exists() or (held_lock / LEDGER).read_text() == ""  # nothing got in
    committed = [i for i in catalog.scan(held_lock) if i.status == "committed"]
    assert committed, "the final checkpoint was not committed"


def test_a_stop_ends_the_job_while_the_ledger_is_a_fifo(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    root.mkdir()
    os.mkfifo(root / LEDGER)
    err = _stop_within_grace(root)
    assert "not a regular file" in err, err[-3000:]
    assert [i for i in catalog.scan(root) if i.status == "committed"], "the final checkpoint was not committed"
