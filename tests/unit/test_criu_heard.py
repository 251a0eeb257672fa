"""A stop the job's own processes heard, even when it ended them before the supervisor looked.

Under Slurm a preemption's TERM reaches every process of a job at once: a DataLoader worker
dies of it and the training process reaps it, possibly before the CRIU supervisor handles its
own TERM. The supervisor's survey at its loop's last turn still says that worker would have
heard it, so no image is made of the ending job (seen in a CI run: the dumped image of the
dying job was restored, and the job then failed)."""
from __future__ import annotations

import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest

from hpcckpt.criu.supervisor import Supervisor

PARENT = ("import subprocess, sys, time\n"
          "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
          "print(child.pid, flush=True)\n"
          "signal_read = sys.stdin.readline()\n"  # the test kills the child, then asks for its reaping
          "child.wait()\n"
          "print('reaped', flush=True)\n"
          "time.sleep(60)\n")


def test_a_worker_the_stop_ended_before_the_supervisor_looked_heard_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    with subprocess.Popen([sys.executable, "-c", PARENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True) as job:
        try:
            _stopped_worker_is_heard(job)
        finally:
            job.kill()


def _stopped_worker_is_heard(job: subprocess.Popen[str]) -> None:
    assert job.stdout is not None and job.stdin is not None
    worker = int(job.stdout.readline())
    sup = SimpleNamespace(pending=[], _masks={})
    fake_job = SimpleNamespace(app_pid=job.pid)
    Supervisor._survey(sup, fake_job)  # type: ignore[arg-type]  # the loop's turn before the stop
    assert worker in sup._masks
    subprocess.run(["kill", "-TERM", str(worker)], check=True)  # Slurm's TERM reaches the worker first
    job.stdin.write("go\n")
    job.stdin.flush()
    assert job.stdout.readline().strip() == "reaped"  # ... and its parent reaped it
    sup.pending = [signal.SIGTERM]
    Supervisor._survey(sup, fake_job)  # type: ignore[arg-type]  # not while the stop waits: the note stays
    heard = Supervisor._heard_by(sup, fake_job, signal.SIGTERM)  # type: ignore[arg-type]
    assert any(h.startswith(f"{worker} default") and "gone" in h for h in heard), heard
