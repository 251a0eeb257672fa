"""A guest of the scheduler: what Slurm recorded decides (a cancel is a cancel), a job's own
words never forge Slurm's fields, the step never waits on slurmctld, and the stop path's calls
into it are bounded."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from hpcckpt.cluster.base import Cause
from hpcckpt.cluster.env import JobEnv
from hpcckpt.cluster.scontrol import SlurmCli, cancelled, parse_kv_line, parse_squeue_fields, refine_cause, within
from hpcckpt.lifecycle.ledger import Ledger
from hpcckpt.lifecycle.requeue import requeue
from hpcckpt.policy import Policy, StopReason


def _record(**fields: str) -> dict[str, str]:
    base = {"JobId": "7", "JobState": "RUNNING", "Reason": "None", "Restarts": "0", "PreemptTime": "None"}
    return {**base, **fields}


@pytest.mark.parametrize(("fields", "expected"), [
    ({"JobState": "COMPLETING"}, True),  # scancel: CANCELLED|COMPLETING reads COMPLETING, nothing else set
    ({"JobState": "CANCELLED"}, True),
    ({"JobState": "COMPLETING", "PreemptTime": "2026-12-07T16:25:54"}, False),  # a preemption
    ({"JobState": "COMPLETING", "Reason": "TimeLimit"}, False),  # the time limit
    ({"JobState": "COMPLETING", "Restarts": "1"}, False),  # scontrol requeue: one restart more
    ({"JobState": "PENDING"}, False),
    ({"JobState": "RUNNING"}, False),
])
def test_a_cancel_is_told_from_what_slurm_recorded(fields: dict[str, str], expected: bool) -> None:
    assert cancelled(_record(**fields), 0) is expected
    assert (refine_cause("signal", _record(**fields), 0) == Cause.USER_CANCEL.value) is expected


def test_a_completing_record_without_the_restart_count_is_no_cancel() -> None:
    assert not cancelled(_record(JobState="COMPLETING"), None)


def test_a_job_name_cannot_forge_slurms_fields() -> None:
    name = "x JobState=PENDING Restarts=3 EndTime=2001-01-01T00:00:00 Partition=high"
    line = (f"JobId=27 JobName={name} UserId=u(1) GroupId=g(1) MCS_label=N/A Priority=1 Nice=0 Account=(null) "
            "QOS=(null) JobState=RUNNING Reason=None Dependency=(null) Requeue=1 Restarts=0 BatchFlag=1 "
            "Reboot=0 ExitCode=0:0 EndTime=2027-01-01T00:00:00 Partition=low "
            "Command=/a b StdOut=/evil WorkDir=/w StdErr=/o StdIn=/dev/null StdOut=/o Power=")
    naive = parse_kv_line(line)
    assert naive["JobState"] == "PENDING"  # what a first-occurrence parse believes
    assert naive["StdOut"] == "/evil"
    exact = parse_kv_line(line, exact={"JobName": name, "Command": "/a b StdOut=/evil"})
    assert (exact["JobName"], exact["JobState"], exact["Restarts"], exact["EndTime"], exact["Partition"]) == \
        (name, "RUNNING", "0", "2027-01-01T00:00:00", "low")
    assert (exact["Command"], exact["WorkDir"], exact["StdOut"]) == ("/a b StdOut=/evil", "/w", "/o")


def test_squeue_fields_parse() -> None:
    rec = parse_squeue_fields("50002|RUNNING|None|0|2026-12-07T16:25:03|2026-12-07T16:25:04|NONE|N/A|low|"
                              "UNLIMITED|50002|N/A|1|1|1|1|n1|\n")
    assert rec is not None and rec["JobState"] == "RUNNING" and rec["Partition"] == "low" and rec["NodeList"] == "n1"
    assert parse_squeue_fields("") is None


class _SlowScheduler:
    """A scheduler whose end-time query blocks until released (a frozen slurmctld)."""

    remote = True

    def __init__(self) -> None:
        self.release = threading.Event()
        self.asked = threading.Event()

    def end_time(self) -> float:
        self.asked.set()
        self.release.wait(120)
        return time.time() + 5  # within the lead: a deadline

    def reservations(self) -> list[object]:
        return []

    def node_state(self) -> str:
        return ""


def test_a_frozen_scheduler_never_holds_the_step() -> None:
    sched = _SlowScheduler()
    policy = Policy(every_steps=None, margin_s=5, poll_s=0.0, background=True)
    try:
        policy.poll(sched)  # returns at once: the query runs on its own thread
        assert sched.asked.wait(30)
        assert not sched.release.is_set()  # the step went on while the query is still blocked
        assert policy.stop_reason() is StopReason.NONE  # nothing known yet: no stop invented
        for _ in range(100):
            policy.poll(sched)  # one query in flight at a time; the step does not wait for it
    finally:
        sched.release.set()
    assert policy.watch is not None
    policy.watch.wait(30)
    policy.poll(sched)  # the answer arrived: the next step reads it
    assert policy.stop_reason() is StopReason.DEADLINE


def _hanging_slurm(tmp_path: Path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("scontrol", "squeue", "sbatch"):
        (bin_dir / tool).write_text("#!/bin/sh\nexec sleep 600\n")  # slurmctld frozen: no answer, ever
        (bin_dir / tool).chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}"}


def test_the_stop_path_is_bounded_when_slurmctld_does_not_answer(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in _hanging_slurm(tmp_path).items():
        monkeypatch.setenv(key, value)
    cluster = SlurmCli(JobEnv(environ={"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "0"}))
    started = time.monotonic()
    outcome = requeue(cluster=cluster, state_dir=tmp_path, cause="signal", committed_step=12, source="test",
                      ledger=Ledger(tmp_path), within_s=6.0)
    took = time.monotonic() - started
    # Every call waited at most what was left of the 4 s (6 s less the exit's 2 s); unbounded,
    # the stop path waited 30 s for each (stop cause, record, requeue, confirmation, successor).
    assert took < 25, f"the stop path took {took:.0f}s"
    assert not outcome.requeued and "successor" in outcome.detail, outcome
    [event] = [e for e in Ledger(tmp_path).events() if e.get("event") == "requeue"]
    assert event["requeued"] is False and "slurmctld" in str(event["detail"]), event


def test_within_keeps_the_sooner_bound() -> None:
    from hpcckpt.cluster import scontrol
    with within(100):
        outer = scontrol._DEADLINE.get()
        with within(1):
            inner = scontrol._DEADLINE.get()
            with within(50):
                assert scontrol._DEADLINE.get() == inner
        assert scontrol._DEADLINE.get() == outer
    assert scontrol._DEADLINE.get() is None
