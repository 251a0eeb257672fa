"""Parsing of Slurm's text output; the inputs were captured from Slurm 22.05 (slurm/localcluster)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from hpcckpt.cluster.base import Cause, Reservation, node_is_draining
from hpcckpt.cluster.causes import STATE_CAUSE, classify, parse_jobcomp_line, parse_sacct, runs_from_jobcomp
from hpcckpt.cluster.scontrol import (
    batch_script_args,
    parse_config,
    parse_duration_s,
    parse_kv_line,
    parse_reservations,
    parse_slurm_time,
    refine_cause,
    requeue_evidence,
    successor_environment,
    successor_sbatch_args,
)

JOB_HOSTILE = (
    'JobId=6 JobName=evil "name"; rm -rf / UserId=x UserId=root(0) GroupId=root(0) MCS_label=N/A '
    "Priority=4294901755 Nice=0 Account=(null) QOS=(null) JobState=RUNNING Reason=None Dependency=(null) "
    "Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=0:0 RunTime=00:00:01 TimeLimit=00:10:00 "
    "TimeMin=N/A SubmitTime=2026-11-21T00:05:41 EligibleTime=2026-11-21T00:05:41 "
    "AccrueTime=2026-11-21T00:05:41 StartTime=2026-11-21T00:05:41 EndTime=2026-11-21T00:15:41 "
    "Deadline=N/A PreemptEligibleTime=2026-11-21T00:05:41 PreemptTime=None SuspendTime=None "
    "SecsPreSuspend=0 LastSchedEval=2026-11-21T00:05:41 Scheduler=Main Partition=low "
    "AllocNode:Sid=localhost:2957 ReqNodeList=(null) ExcNodeList=(null) NodeList=n[1-2] BatchHost=n1 "
    "NumNodes=2 NumCPUs=4 NumTasks=2 CPUs/Task=1 ReqB:S:C:T=0:0:*:* TRES=cpu=4,node=2,billing=4 "
    "Socks/Node=* NtasksPerN:B:S:C=0:0:*:* CoreSpec=* MinCPUsNode=1 MinMemoryNode=0 MinTmpDiskNode=0 "
    "Features=(null) DelayBoot=00:00:00 OverSubscribe=NO Contiguous=0 Licenses=(null) Network=(null) "
    "Command=(null) WorkDir=/tmp/t1/we ird;\"dir' StdErr=/tmp/t1/we ird;\"dir'/out-6 StdIn=/dev/null "
    "StdOut=/tmp/t1/we ird;\"dir'/out-6 Power= ")

RESERVATION = (
    "ReservationName=maint window StartTime=2026-11-21T00:13:35 EndTime=2026-11-21T00:43:35 "
    "Duration=00:30:00 Nodes=n2 NodeCnt=1 CoreCnt=2 Features=(null) PartitionName=(null) "
    "Flags=MAINT,IGNORE_JOBS,SPEC_NODES TRES=cpu=2 Users=root Groups=(null) Accounts=(null) "
    "Licenses=(null) State=INACTIVE BurstBuffer=(null) Watts=n/a MaxStartDelay=(null)")

JOBCOMP = (
    'JobId=1 UserId=root(0) GroupId=root(0) Name=weird name; "x" JobState=PENDING Partition=low '
    "TimeLimit=525600 StartTime=2026-11-21T00:01:47 EndTime=2026-11-21T00:01:49 NodeList=n1 NodeCnt=1 "
    "ProcCnt=1 WorkDir=/tmp/t1 ReservationName= Tres=cpu=1,mem=2000M,node=1,billing=1 Account= QOS= "
    "WcKey= Cluster=unknown SubmitTime=2026-11-21T00:01:46 EligibleTime=2026-11-21T00:01:46 "
    "DerivedExitCode=0:0 ExitCode=0:0 \n")
JOBCOMP_PREEMPTED = JOBCOMP.replace("JobId=1 ", "JobId=2 ").replace("JobState=PENDING", "JobState=PREEMPTED") \
    .replace("TimeLimit=525600", "TimeLimit=1")


def test_job_line_keeps_hostile_name_and_paths_whole() -> None:
    job = parse_kv_line(JOB_HOSTILE)
    assert job["JobName"] == 'evil "name"; rm -rf / UserId=x'
    assert job["UserId"] == "root(0)"
    assert job["WorkDir"] == "/tmp/t1/we ird;\"dir'"
    assert job["StdOut"] == "/tmp/t1/we ird;\"dir'/out-6"
    assert job["JobState"] == "RUNNING" and job["PreemptTime"] == "None"
    assert job["NodeList"] == "n[1-2]" and job["Power"] == ""


@pytest.mark.parametrize(("text", "seconds"), [
    ("00:10:00", 600.0), ("1-02:03:04", 93784.0), ("10", 600.0), ("45:30", 2730.0),
    ("2-05", 2 * 86400 + 5 * 3600.0), ("UNLIMITED", None), ("N/A", None), ("", None)])
def test_durations(text: str, seconds: float | None) -> None:
    assert parse_duration_s(text) == seconds


def test_timestamps_are_local_time() -> None:
    expected = time.mktime((2026, 11, 21, 0, 5, 41, 0, 0, -1))
    assert parse_slurm_time("2026-11-21T00:05:41") == expected
    assert parse_slurm_time("Unknown") is None and parse_slurm_time("None") is None


def test_reservations_and_overlap() -> None:
    (res,) = parse_reservations(RESERVATION + "\n")
    assert res.name == "maint window" and res.nodes == ("n2",) and res.is_maintenance
    assert res.end_s - res.start_s == 1800
    assert res.overlaps(nodes=["n1", "n2"], start_s=res.start_s - 10, end_s=res.start_s + 1)
    assert not res.overlaps(nodes=["n1"], start_s=res.start_s - 10, end_s=res.end_s)
    assert not res.overlaps(nodes=["n2"], start_s=0, end_s=res.start_s)
    assert parse_reservations("No reservations in the system\n") == []
    everywhere = Reservation(name="all", start_s=10, end_s=20, nodes=(), flags=("MAINT",))
    assert everywhere.overlaps(nodes=["x"], start_s=0, end_s=11)


@pytest.mark.parametrize(("state", "draining"), [
    ("ALLOCATED+DRAIN", True), ("IDLE+DRAIN", True), ("MIXED", False), ("IDLE", False),
    ("DOWN+FAIL", True), ("ALLOCATED+NOT_RESPONDING", False), ("drained", True), ("", False)])
def test_node_draining(state: str, draining: bool) -> None:
    assert node_is_draining(state) is draining


def test_config() -> None:
    conf = parse_config("Configuration data as of 2026-11-21T00:03:32\nJobRequeue              = 1\n"
                        "KillWait                = 5 sec\nSLURM_VERSION           = 22.05.8\n")
    assert conf == {"JobRequeue": "1", "KillWait": "5 sec", "SLURM_VERSION": "22.05.8"}


def test_jobcomp_lines() -> None:
    rec = parse_jobcomp_line(JOBCOMP)
    assert rec["Name"] == 'weird name; "x"' and rec["JobState"] == "PENDING"
    runs = runs_from_jobcomp([JOBCOMP, JOBCOMP_PREEMPTED], {"2"})
    assert len(runs) == 1 and runs[0].cause is Cause.PREEMPTION and runs[0].time_limit_s == 60
    unlimited = runs_from_jobcomp([JOBCOMP], {"1"})[0]
    assert unlimited.time_limit_s is None and unlimited.cause is None


def test_sacct_rows_skip_steps() -> None:
    text = ("12|PREEMPTED|2026-11-21T00:01:00|2026-11-21T00:02:00|00:10:00\n"
            "12.batch|CANCELLED|2026-11-21T00:01:00|2026-11-21T00:02:00|\n"
            "12|TIMEOUT|2026-11-21T00:03:00|2026-11-21T00:13:00|00:10:00\n")
    assert [r.cause for r in parse_sacct(text)] == [Cause.PREEMPTION, Cause.TIME_LIMIT]
    assert STATE_CAUSE["NODE_FAIL"] is Cause.NODE_FAILURE


def test_classify_prefers_what_the_job_and_slurm_know() -> None:
    runs = runs_from_jobcomp([JOBCOMP_PREEMPTED], {"2"})
    start = runs[0].start_s or 0.0
    assert classify({"reason": "deadline"}, None, None, None) is Cause.TIME_LIMIT
    assert classify({"reason": "maintenance"}, None, None, None) is Cause.MAINTENANCE
    assert classify({"reason": "deadline"}, None, None, None, "preemption") is Cause.PREEMPTION
    assert classify({"reason": "signal"}, "SIGUSR2", start + 5, runs[0]) is Cause.PREEMPTION
    # Already requeued by Slurm when the job asked: it looked like an operator's requeue, but
    # Slurm's record of the run says PREEMPTED; without such a record the guess stands.
    assert classify({"reason": "signal"}, "SIGTERM", start + 5, runs[0], "operator_requeue") is Cause.PREEMPTION
    assert classify({"reason": "signal"}, "SIGTERM", start + 5, None, "operator_requeue") is Cause.OPERATOR_REQUEUE
    pending = runs_from_jobcomp([JOBCOMP.replace("TimeLimit=525600", "TimeLimit=10")], {"1"})[0]
    t0 = pending.start_s or 0.0
    assert classify({"reason": "signal"}, "SIGUSR2", t0 + 590, pending) is Cause.TIME_LIMIT
    assert classify({"reason": "signal"}, "SIGUSR2", t0 + 30, pending) is Cause.SIGNAL
    assert classify({"reason": "signal"}, "SIGTERM", t0 + 30, pending) is Cause.PREEMPTION


def test_refine_cause_from_job_record() -> None:
    job = parse_kv_line(JOB_HOSTILE)
    assert refine_cause("signal", job) == "signal" and requeue_evidence(job, 0) is None
    assert refine_cause("time_limit", {**job, "PreemptTime": "2026-11-21T00:06:00"}) == "preemption"
    pending = {**job, "JobState": "PENDING"}
    # Pending again without a preemption: someone ran `scontrol requeue` (an operator).
    assert requeue_evidence(pending, 0) == "JobState=PENDING" and refine_cause("signal", pending) == "operator_requeue"
    assert refine_cause("maintenance", pending) == "maintenance"
    # A stop on a pulled-in end time: Slurm already requeued the preempted job (PreemptTime is
    # gone from the pending record), so it stays a preemption; still running with no
    # PreemptTime, the end time was pulled in by a shortened limit.
    assert refine_cause("preemption", pending) == "preemption"
    assert refine_cause("preemption", {**job, "JobState": "RUNNING"}) == "time_limit"
    assert refine_cause("preemption", {**job, "JobState": "RUNNING", "PreemptTime": "2026-11-21T00:06:00"}) == \
        "preemption"
    assert refine_cause("signal", None) == "signal"
    assert refine_cause("signal", {**job, "JobState": "TIMEOUT"}) == "time_limit"
    assert refine_cause("signal", {**job, "JobState": "COMPLETING", "Reason": "TimeLimit"}) == "time_limit"
    assert refine_cause("signal", {**job, "JobState": "PREEMPTED"}) == "preemption"
    # COMPLETING, PREEMPTED, TIMEOUT are how a job that will NOT run again looks too: no evidence.
    for state in ("COMPLETING", "PREEMPTED", "TIMEOUT", "RUNNING"):
        assert requeue_evidence({**job, "JobState": state}, 0) is None
    assert requeue_evidence({**job, "JobState": "COMPLETING", "Restarts": "3"}, 2) == \
        "Restarts=3 (this run started as 2)"


def test_successor_keeps_environment_but_not_this_jobs_slurm_variables() -> None:
    env = successor_environment({"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "2", "SLURM_CONF": "/c",
                                 "SBATCH_PARTITION": "x", "HPCCKPT_DIR": "/ck pt", "PATH": "/bin"}, "7")
    assert env == {"SLURM_CONF": "/c", "HPCCKPT_DIR": "/ck pt", "PATH": "/bin",
                   "_HPCCKPT_PREDECESSOR_JOB_ID": "7", "_HPCCKPT_SUCCESSOR_GENERATION": "1"}
    # a job whose environment came from an older version: its names are read, and not passed on
    env = successor_environment({"HPCCKPT_SUCCESSOR_GENERATION": "2", "HPCCKPT_PREDECESSOR_JOB_ID": "5"}, "7")
    assert env == {"_HPCCKPT_PREDECESSOR_JOB_ID": "7", "_HPCCKPT_SUCCESSOR_GENERATION": "3"}
    args = successor_sbatch_args(parse_kv_line(JOB_HOSTILE), Path("/s.sbatch"), "6")
    assert args[:3] == ["sbatch", "--parsable", "--dependency=afterany:6"]
    assert '--job-name=evil "name"; rm -rf / UserId=x' in args
    assert "--time=00:10:00" in args and "--requeue" in args and "--nodes=2" in args
    assert "--exclusive" in args and "--ntasks=2" in args and not any(a.startswith("--array") for a in args)
    assert "--chdir=/tmp/t1/we ird;\"dir'" in args and args[-1] == "/s.sbatch"


def test_successor_is_given_the_batch_scripts_own_arguments(tmp_path: Path) -> None:
    # What the templates export, read back exactly (blanks, quotes, newlines, empty, '$'),
    # and put after the script on the successor's sbatch command line.
    import subprocess

    from hpcckpt.cluster import render

    text = render.render("criu")
    block = [line for line in text.splitlines() if "_HPCCKPT_BATCH_ARG" in line and not line.startswith("#")]
    assert len(block) == 2, block
    argv = ["python", "train.py", "--name", "a b", "it's \"x\"", "c\nd", "", "$HOME"]
    out = subprocess.run(["bash", "-euc", "\n".join(block) + '\nexec env -0', "criu.sbatch", *argv],
                         env={"SLURM_JOB_ID": "77", "PATH": os.environ["PATH"]},
                         capture_output=True, check=True).stdout
    environ = dict(item.split("=", 1) for item in out.decode().split("\0") if item)
    assert batch_script_args(environ, "77", proc_root=tmp_path) == argv
    # Another job's (inherited) variables are not this job's arguments; nothing else knows them.
    assert batch_script_args(environ, "78", proc_root=tmp_path) is None
    assert batch_script_args({**environ, "_HPCCKPT_BATCH_ARGC": "9"}, "77", proc_root=tmp_path) is None
    # A job whose stored batch script came from an older template exported the names without the
    # leading underscore (a job queued or requeued across the upgrade): read all the same.
    older = {k[1:] if k.startswith("_HPCCKPT_") else k: v for k, v in environ.items()}
    assert batch_script_args(older, "77", proc_root=tmp_path) == argv
    args = successor_sbatch_args(parse_kv_line(JOB_HOSTILE), Path("/s.sbatch"), "77", argv)
    assert args[-len(argv) - 1:] == ["/s.sbatch", *argv]
    assert successor_sbatch_args(parse_kv_line(JOB_HOSTILE), Path("/s.sbatch"), "77")[-1] == "/s.sbatch"
    # The successor's environment does not carry them (its own batch shell exports its own).
    assert not [k for k in successor_environment(environ, "77") if "HPCCKPT_BATCH_ARG" in k]
    assert not [k for k in successor_environment(older, "77") if "HPCCKPT_BATCH_ARG" in k]


def test_batch_script_arguments_from_the_batch_shell_above_this_process(tmp_path: Path) -> None:
    # A script of the user's own (no exported variables): the batch shell's command line,
    # `bash [-l] <spool>/job<ID>/slurm_script ARGS...`, found by walking up /proc.
    def proc(pid: int, ppid: int, *argv: bytes) -> None:
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "cmdline").write_bytes(b"".join(a + b"\0" for a in argv))
        (tmp_path / str(pid) / "stat").write_text(f"{pid} (odd ) name) S {ppid} 1 1 0 -1\n")

    proc(300, 200, b"python", b"train.py")
    proc(200, 100, b"/bin/bash", b"-l", b"/var/spool/slurmd/job00077/slurm_script", b"train.py", b"a b", b"")
    proc(100, 1, b"slurmstepd: [77.batch]")
    assert batch_script_args({}, "77", proc_root=tmp_path, pid=300) == ["train.py", "a b", ""]
    assert batch_script_args({}, "77", proc_root=tmp_path, pid=100) is None  # not under the batch shell
    assert batch_script_args({}, "77", proc_root=tmp_path, pid=999) is None  # no such process
