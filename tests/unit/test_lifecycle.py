"""The one lifecycle: identity from the environment, the ledger and budget that never
block or follow a hostile file, the requeue routine's one record, history from a ledger
(array tasks as A_T, causes, unknown losses, successors, NaN), and the successor's
sbatch options read from a real `scontrol show job` record of an array task."""

from __future__ import annotations

import fcntl
import json
import math
import os
import subprocess
import sys
import threading
import tracemalloc
from pathlib import Path

import pytest

from hpcckpt.cli.main import main
from hpcckpt.cluster.base import RequeueOutcome
from hpcckpt.cluster.local import LocalCluster
from hpcckpt.cluster.scontrol import parse_kv_line, successor_sbatch_args
from hpcckpt.lifecycle import current, requeue
from hpcckpt.lifecycle.budget import BUDGET_FILE, charge
from hpcckpt.lifecycle.history import fold, interruptions, load, newest_run, runs, summary
from hpcckpt.lifecycle.ledger import LEDGER, LOCK, Ledger

ARRAY_TASK = (  # `scontrol show job -o 4_1` of `sbatch --array=1-2 --no-requeue --mem=100 --comment=hello`
    "JobId=5 ArrayJobId=4 ArrayTaskId=1 JobName=arr.sbatch UserId=root(0) GroupId=root(0) MCS_label=N/A "
    "Priority=4294901758 Nice=0 Account=(null) QOS=(null) JobState=RUNNING Reason=None Dependency=(null) "
    "Requeue=0 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=0:0 RunTime=00:00:05 TimeLimit=365-00:00:00 "
    "TimeMin=N/A SubmitTime=2026-11-25T12:35:15 EligibleTime=2026-11-25T12:35:15 AccrueTime=Unknown "
    "StartTime=2026-11-25T12:35:15 EndTime=2027-11-25T12:35:15 Deadline=N/A "
    "PreemptEligibleTime=2026-11-25T12:35:15 PreemptTime=None SuspendTime=None SecsPreSuspend=0 "
    "LastSchedEval=2026-11-25T12:35:15 Scheduler=Backfill Partition=low AllocNode:Sid=localhost:4448 "
    "ReqNodeList=(null) ExcNodeList=(null) NodeList=n1 BatchHost=n1 NumNodes=1 NumCPUs=1 NumTasks=1 "
    "CPUs/Task=1 ReqB:S:C:T=0:0:*:* TRES=cpu=1,node=1,billing=1 Socks/Node=* NtasksPerN:B:S:C=0:0:*:* "
    "CoreSpec=* MinCPUsNode=1 MinMemoryNode=100M MinTmpDiskNode=0 Features=(null) DelayBoot=00:00:00 "
    "OverSubscribe=OK Contiguous=0 Licenses=(null) Network=(null) Command=/tmp/exp27/arr.sbatch "
    "WorkDir=/work/main Comment=hello  StdErr=/tmp/exp27/arr-4_1.out StdIn=/dev/null "
    "StdOut=/tmp/exp27/arr-4_1.out Power= ")


def test_identity_names_an_array_task_as_slurm_does() -> None:
    who = current({"SLURM_JOB_ID": "5", "SLURM_ARRAY_JOB_ID": "4", "SLURM_ARRAY_TASK_ID": "1",
                   "SLURM_RESTART_COUNT": "2", "SLURM_PROCID": "0"})
    assert (who.job_id, who.raw_job_id, who.restart_count, who.attempt) == ("4_1", "5", 2, "4_1:2")
    assert who.record()["job_id"] == "4_1" and who.record()["slurm_job_id"] == "5"
    plain = current({"SLURM_JOB_ID": "9", "SLURM_RESTART_COUNT": "x"})  # a malformed count never stops a record
    assert (plain.job_id, plain.restart_count) == ("9", 0)
    local = current({"_HPCCKPT_LOCAL_RESTART": "3"})
    assert not local.in_slurm and local.restart == 3 and local.attempt.endswith(":3")
    assert current({"HPCCKPT_LOCAL_RESTART": "2"}).restart == 2  # the name older versions set


def test_successor_of_an_array_task_is_the_same_task() -> None:
    args = successor_sbatch_args(parse_kv_line(ARRAY_TASK), Path("/s.sbatch"), "4_1")
    assert args[:3] == ["sbatch", "--parsable", "--dependency=afterany:4_1"]
    for wanted in ("--array=1", "--mem=100M", "--comment=hello", "--no-requeue", "--cpus-per-task=1",
                   "--time=365-00:00:00", "--partition=low", "--output=/tmp/exp27/arr-4_1.out"):
        assert wanted in args, (wanted, args)
    assert not [a for a in args if a.startswith(("--account", "--qos", "--constraint", "--input", "--exclusive"))]
    assert args[-1] == "/s.sbatch"


def _in_thread(fn: object, *args: object) -> threading.Thread:
    t = threading.Thread(target=fn, args=args, daemon=True)  # type: ignore[arg-type]  # any callable
    t.start()
    t.join(60)  # a generous bound: the call itself must give up within seconds
    return t


def test_ledger_never_blocks_on_a_held_lock_or_a_fifo(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ledger = Ledger(tmp_path)
    ledger.append("start", resumed_from=None)
    holder = os.open(tmp_path / LOCK, os.O_RDWR)
    fcntl.flock(holder, fcntl.LOCK_EX)  # a writer stopped inside an append holds it for good
    try:
        assert not _in_thread(ledger.append, "signal").is_alive(), "the append blocked on a held lock"
    finally:
        os.close(holder)
    assert [e["event"] for e in ledger.events()] == ["start"]
    assert "stayed locked" in caplog.text and "skipped" in caplog.text
    (tmp_path / LEDGER).unlink()
    os.mkfifo(tmp_path / LEDGER)
    assert not _in_thread(ledger.append, "stop").is_alive(), "the append blocked on a FIFO"
    assert list(ledger.events()) == []
    assert "not a regular file" in caplog.text


def test_ledger_and_budget_refuse_a_link_to_dev_zero(tmp_path: Path) -> None:
    (tmp_path / LEDGER).symlink_to("/dev/zero")
    (tmp_path / BUDGET_FILE).symlink_to("/dev/zero")
    assert list(Ledger(tmp_path).events()) == []
    decision = charge(tmp_path, "signal", attempt="1:0")
    assert decision.allowed and "not consulted" in decision.reason


def test_budget_never_blocks_and_a_fifo_does_not_strand_the_job(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / BUDGET_FILE)
    out: list[object] = []
    assert not _in_thread(lambda: out.append(charge(tmp_path, "preemption", attempt="1:0"))).is_alive()
    assert out and out[0].allowed and "not consulted" in out[0].reason  # type: ignore[attr-defined]
    (tmp_path / BUDGET_FILE).unlink()
    holder = os.open(tmp_path / (BUDGET_FILE + ".lock"), os.O_RDWR | os.O_CREAT)
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        decision = charge(tmp_path, "preemption", attempt="1:1")
    finally:
        os.close(holder)
    assert decision.allowed and "stayed locked" in decision.reason


class _Refusing(LocalCluster):
    """One fault at the scheduler seam: Slurm would not take the job back and no successor could go."""

    def requeue_job(self, cause: str) -> RequeueOutcome:
        return RequeueOutcome(requeued=False, method="none", cause=cause, detail="Requested operation is disabled")


def test_requeue_records_once_and_says_why_not(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = requeue(cluster=_Refusing(), state_dir=tmp_path, cause="signal", committed_step=4, source="test")
    assert not out.requeued
    assert "NOT requeued: Requested operation is disabled" in capsys.readouterr().err
    [rec] = [e for e in Ledger(tmp_path).events() if e["event"] == "requeue"]
    assert (rec["requeued"], rec["method"], rec["source"], rec["cause"]) == (False, "none", "test", "signal")


def _ev(event: str, t: float, job: str = "4_1", **fields: object) -> dict[str, object]:
    return {"event": event, "time": t, "job_id": job, "slurm_job_id": "5", **fields}


def test_history_of_array_tasks_with_causes_successors_and_unknown_losses() -> None:
    ledger = [
        _ev("start", 100.0, restart_count=0, resumed_from=None),
        _ev("signal", 110.0, signame="SIGTERM", step=9),
        _ev("stop", 111.0, reason="signal", step=9, committed_step=9),
        _ev("requeue", 111.5, method="slurm", cause="operator_requeue", requeued=True, evidence="JobState=PENDING"),
        _ev("start", 130.0, restart_count=1, resumed_from=9),
        _ev("stop", 140.0, reason="signal", step=15, committed_step=15, signame="SIGUSR2"),
        _ev("requeue", 140.5, method="successor", cause="signal", requeued=True, successor_job_id="8_1"),
        _ev("start", 150.0, job="8_1", restart_count=0, resumed_from=15),
        _ev("commit", 155.0, job="8_1", step=float("nan"), save_s=float("nan")),
        _ev("commit", 156.0, job="8_1", step=18, save_s=0.1),
        # killed without a stop: how far it got past step 18 is unknown
        _ev("superseded", 189.0, job="4_1", restart_count=2, by_job_id="8_1",
            detail="another job holds the checkpoint directory: host h, PID 7, Slurm job 8_1"),
        _ev("start", 190.0, job="8_1", restart_count=1, resumed_from=18),
        _ev("stop", 200.0, job="8_1", reason="done", step=30, committed_step=30),
    ]
    rows = interruptions(ledger, slurm=[])
    assert [(r.job_id, r.cause, r.lost_steps, r.successor_job_id, r.resumed_by) for r in rows] == [
        ("4_1", "operator_requeue", 0, None, "4_1"),
        ("4_1", "signal", 0, "8_1", "8_1"),
        ("8_1", "unknown", None, None, "8_1"),
        ("4_1", "superseded", 0, None, "8_1")]
    assert summary(ledger, rows)["lost_steps_unknown"] == 1


def test_every_reader_splits_the_ledger_into_the_same_runs() -> None:
    """``runs``/``newest_run`` (the CLI's requeue, torchrun's should-requeue) split as the
    history's fold does: a start, a CRIU restore and a start-up's requeue each open a run."""
    ledger = [
        _ev("commit", 90.0, step=3),  # the ledger begins inside a run
        _ev("start", 100.0, resumed_from=3),
        _ev("stop", 111.0, reason="signal", step=9, committed_step=9, requeue=True),
        _ev("superseded", 112.0, by_job_id="8"),  # no run's
        _ev("criu_restore", 130.0, image="img-1"),
        _ev("requeue", 140.0, method="slurm", cause="time_limit", requeued=True, unstarted=True),
        _ev("start", 150.0, resumed_from=9),
        _ev("commit", 156.0, step=18),
    ]
    heads = [r.head["time"] for r in fold(ledger).runs]
    assert [run[0]["time"] for run in runs(ledger)] == heads == [90.0, 100.0, 130.0, 140.0, 150.0]
    assert [run[0]["time"] for run in runs(ledger, headless=False)] == heads[1:]
    assert [e["event"] for e in newest_run(ledger)] == ["start", "commit"]
    assert newest_run([]) == [] and newest_run(ledger[:1], headless=False) == []


def test_a_supervisors_note_before_its_runs_start_is_no_run() -> None:
    """A CRIU or own-mode supervisor on a partition with a GraceTime notes its end-time poll
    before it records its run's start (the order of a real ledger from the local cluster): the
    first run is not preceded by an interruption of unknown cause."""
    ledger = [
        _ev("end_poll", 99.0, poll_s=3.3, grace_s=10.0),
        _ev("start", 100.0, restart_count=0, progress_s=0.0),
        _ev("stop", 112.0, reason="preemption", image="image-000001", progress_s=12.0),
        _ev("requeue", 113.0, method="scontrol", cause="preemption", requeued=True),
        _ev("criu_restore", 126.0, restart_count=1, image="image-000001", lost_s=0.0, lost_exact=True),
        _ev("end_poll", 127.0, poll_s=3.3, grace_s=10.0),
        _ev("stop", 184.0, restart_count=1, reason="done", exit_code=0),
    ]
    assert [r.head["event"] for r in fold(ledger).runs] == ["start", "criu_restore"]
    assert [run[0]["event"] for run in runs(ledger)] == ["start", "criu_restore"]
    rows = interruptions(ledger, slurm=[])
    assert [(r.cause, r.lost_s) for r in rows] == [("preemption", 0.0)], rows


def test_history_counts_what_a_criu_job_lost_in_seconds(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """CRIU runs have no steps: the next restore says what was lost, exactly (dumped at the
    stop) or only bounded (killed; periodic images every N s)."""
    ledger = [
        _ev("start", 100.0, restart_count=0, progress_s=0.0),
        _ev("stop", 160.0, reason="preemption", signame="SIGTERM", progress_s=60.0),
        _ev("criu_restore", 180.0, restart_count=1, image="image-1", lost_s=0.0, lost_exact=True),
        _ev("criu_restore", 260.0, restart_count=2, image="image-2", lost_s=None, lost_exact=False,
            lost_at_most_s=5.0),
        _ev("stop", 300.0, restart_count=2, reason="done"),
    ]
    rows = interruptions(ledger, slurm=[])
    assert [(r.cause, r.lost_steps, r.lost_s, r.lost_exact, r.lost_at_most_s) for r in rows] == [
        ("preemption", None, 0.0, True, None), ("unknown", None, None, False, 5.0)]
    info = summary(ledger, rows)
    assert info["lost_s_total"] == 0.0 and info["lost_steps_unknown"] == 0, info
    with open(tmp_path / LEDGER, "w") as fh:
        fh.writelines(json.dumps(e) + "\n" for e in ledger)
    assert main(["history", str(tmp_path)]) == 0
    table = capsys.readouterr().out
    assert " 0.0s " in table and "<=5s" in table and "0.0 s of CRIU progress lost" in table, table


def test_history_cli_streams_a_hostile_ledger(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with open(tmp_path / LEDGER, "w") as fh:
        for i in range(3):
            fh.write(json.dumps(_ev("start", 100.0 + i, resumed_from=math.nan)) + "\n")
            fh.write(json.dumps(_ev("stop", math.nan, reason="signal", step=math.nan, committed_step=i)) + "\n")
        fh.write("x" * (3 << 20) + "\n")  # no event hpcckpt writes is this long: skipped, never held whole
        fh.write(json.dumps(_ev("stop", 200.0, reason="done", step=5)) + "\n")
    assert main(["history", str(tmp_path)]) == 0
    table = capsys.readouterr().out
    assert "4_1" in table and "unknown" not in table.splitlines()[0] and "finished" in table
    tracemalloc.start()
    folded = load(tmp_path)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert folded.finished and len(folded.runs) == 3
    assert peak < 5 << 19, f"history held {peak} bytes for a ledger with one 3 MiB line"  # 2.5 MiB


def test_cli_requeue_does_nothing_when_the_run_already_did(tmp_path: Path) -> None:
    Ledger(tmp_path).append("stop", reason="signal", step=3, committed_step=3, requeue=True)
    Ledger(tmp_path).append("requeue", method="successor", requeued=True, successor_job_id="77",
                            detail="submitted successor job 77")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "HPCCKPT_"))}
    proc = subprocess.run([sys.executable, "-m", "hpcckpt.cli", "requeue", "--dir", str(tmp_path), "--json"],
                          capture_output=True, text=True, env=env, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["already"] is True
    assert [e["event"] for e in Ledger(tmp_path).events()] == ["stop", "requeue"]  # no second record


def test_history_names_the_image_each_criu_run_resumed_from(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    ledger = [
        _ev("start", 100.0, restart_count=0, mode="criu", image=None, progress_s=0.0),
        _ev("stop", 160.0, reason="preemption", signame="SIGTERM", progress_s=60.0),
        _ev("criu_restore", 180.0, restart_count=1, image="image-000001", lost_s=0.0, lost_exact=True),
        _ev("stop", 200.0, reason="time_limit", signame="SIGUSR2", progress_s=80.0),
        _ev("start", 220.0, restart_count=2, mode="criu", image=None, fallback="app", lost_s=80.0),
        _ev("stop", 230.0, restart_count=2, reason="done"),
    ]
    rows = interruptions(ledger, slurm=[])
    assert [(r.resumed_image, r.started_over) for r in rows] == [
        ("image-000001", None), (None, "the image could not be restored (--on-restore-failure=app)")]
    assert rows[0].as_dict()["resumed_image"] == "image-000001"
    with open(tmp_path / LEDGER, "w") as fh:
        fh.writelines(json.dumps(e) + "\n" for e in ledger)
    assert main(["history", str(tmp_path)]) == 0
    table = capsys.readouterr().out
    assert " image-000001 " in table.splitlines()[1] and " none " in table.splitlines()[2], table
    assert "! #2: the next run started from the beginning: the image could not be restored" in table, table


@pytest.mark.parametrize(("error", "method"), [
    (None, "scontrol"),
    ("'scontrol requeue 7' failed (exit 1): slurm_requeue error: Socket timed out on send/recv operation", "scontrol"),
    ("'scontrol requeue 7' did not answer within 30s; is slurmctld up (scontrol ping)?", "scontrol"),
    ("'scontrol requeue 7' failed (exit 1): slurm_requeue error: Zero Bytes were transmitted or received", "scontrol"),
    ("'scontrol requeue 7' failed (exit 1): Requested operation is presently disabled for job 7", "slurm"),
    ("'scontrol requeue 7' failed (exit 1): slurm_requeue error: Job is pending execution", "slurm"),
])
def test_a_requeue_whose_answer_was_lost_is_scontrols(monkeypatch: pytest.MonkeyPatch, error: str | None,
                                                      method: str) -> None:
    """scontrol requeue on a loaded controller: the job is requeued but the command fails
    without a refusal (seen in CI, the history then naming Slurm as the requeuer). The record
    did not show the job requeued just before the call, so it was this call, not Slurm on its
    own; a refusal (the job pending or completing already) means Slurm did it meanwhile."""
    from hpcckpt.cluster import scontrol
    from hpcckpt.cluster.env import JobEnv
    from hpcckpt.errors import ClusterError
    calls: list[list[str]] = []

    def run(args: list[str], **_: object) -> str:
        calls.append(list(args))
        if args[:2] == ["scontrol", "requeue"] and error is not None:
            raise ClusterError(error)
        return ""
    records = iter([{"JobId": "7", "JobState": "RUNNING", "Restarts": "0"}])
    monkeypatch.setattr(scontrol, "run_slurm", run)
    monkeypatch.setattr(scontrol, "show_job", lambda job: next(records, {"JobId": "7", "JobState": "PENDING",
                                                                           "Restarts": "1"}))
    out = scontrol.SlurmCli(JobEnv(environ={"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "0"})).requeue_job("signal")
    assert out.requeued and out.method == method, out
    assert ["scontrol", "requeue", "7"] in calls
    assert ("answer was lost" in out.detail) == (error is not None and method == "scontrol"), out.detail


class _TimedOut(LocalCluster):
    """The local backend, except that the scheduler says the job hit its time limit."""

    def stop_cause(self, cause: str) -> str:
        return "time_limit"


def _in_job(monkeypatch: pytest.MonkeyPatch, restart: int) -> None:
    for k in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("SLURM_JOB_ID", "5")
    monkeypatch.setenv("SLURM_RESTART_COUNT", str(restart))


def test_a_run_stopped_in_its_start_up_is_requeued_once_at_a_time_limit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from hpcckpt.cli import requeue as cli_requeue
    monkeypatch.setattr(cli_requeue, "detect", _TimedOut)
    # Run 0 trained to step 7, stopped and requeued itself (its own record).
    _in_job(monkeypatch, 0)
    Ledger(tmp_path).append("start", resumed_from=None)
    Ledger(tmp_path).append("stop", reason="deadline", step=7, committed_step=7, requeue=True)
    Ledger(tmp_path).append("requeue", method="scontrol", requeued=True, detail="confirmed")
    # Run 1 was killed by the TERM before it recorded anything: run 0's requeue is not its own.
    _in_job(monkeypatch, 1)
    assert cli_requeue._newest_run(Ledger(tmp_path), current())[1] is None
    assert main(["requeue", "--dir", str(tmp_path), "--stopped-status", "143", "--json"]) == 75  # local: restart me
    req = [e for e in Ledger(tmp_path).events() if e["event"] == "requeue"][-1]
    assert req["unstarted"] is True and req["restart_count"] == 1 and req["cause"] == "time_limit", req
    assert "start-up" in req["note"] and "143" in req["note"], req
    # Run 2: the same again at its time limit: the start-up does not fit; refused, the status stands.
    _in_job(monkeypatch, 2)
    capsys.readouterr()
    assert main(["requeue", "--dir", str(tmp_path), "--stopped-status", "143"]) == 143
    assert "NOT requeued" in capsys.readouterr().out
    last = list(Ledger(tmp_path).events())[-1]
    assert last["event"] == "refused" and "--time" in last["reason"] and last["step"] == 7, last
    # Run 3 began (a start of its own) and then ended 1 after a TERM: its own decision stands.
    _in_job(monkeypatch, 3)
    Ledger(tmp_path).append("start", resumed_from=7)
    assert main(["requeue", "--dir", str(tmp_path), "--stopped-status", "1"]) == 1
    assert "began training" in capsys.readouterr().out
    assert [e["event"] for e in Ledger(tmp_path).events()][-1] == "start"  # nothing recorded
    # Run 3 stops for a requeue, records it and exits 75 as a trap runs: bash loses the status (-1).
    Ledger(tmp_path).append("stop", reason="signal", step=9, committed_step=9, requeue=True)
    Ledger(tmp_path).append("requeue", method="scontrol", requeued=True, detail="confirmed")
    assert main(["requeue", "--dir", str(tmp_path), "--stopped-status", "-1"]) == 0
    assert "already done by the run itself" in capsys.readouterr().out
    assert [e["event"] for e in Ledger(tmp_path).events()][-1] == "requeue"  # no second record
    # Run 4 trains to the end; a warning's trap runs as it exits 0 and bash loses that status.
    _in_job(monkeypatch, 4)
    Ledger(tmp_path).append("start", resumed_from=9)
    Ledger(tmp_path).append("stop", reason="done", step=20, committed_step=20, requeue=False)
    assert main(["requeue", "--dir", str(tmp_path), "--stopped-status", "-1"]) == 0
    assert main(["requeue", "--dir", str(tmp_path), "--stopped-status", "1"]) == 1  # a known failure stands


def test_a_preempted_start_up_comes_back_every_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hpcckpt.cli import requeue as cli_requeue
    monkeypatch.setattr(cli_requeue, "detect", LocalCluster)  # the cause stays a bare signal
    for restart in range(3):
        _in_job(monkeypatch, restart)
        assert main(["requeue", "--dir", str(tmp_path), "--stopped-status", "143"]) == 75
    reqs = [e for e in Ledger(tmp_path).events() if e["event"] == "requeue"]
    assert [(e["restart_count"], e["unstarted"]) for e in reqs] == [(0, True), (1, True), (2, True)]
    # then a time limit in the start-up: the runs before it were preempted, not timed out: requeued
    monkeypatch.setattr(cli_requeue, "detect", _TimedOut)
    _in_job(monkeypatch, 3)
    assert main(["requeue", "--dir", str(tmp_path), "--stopped-status", "143"]) == 75


def test_history_counts_a_run_stopped_in_its_start_up_as_an_interruption_that_lost_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ledger = [
        _ev("start", 100.0, restart_count=0, resumed_from=None),
        _ev("stop", 160.0, reason="deadline", step=12, committed_step=12, requeue=True),
        _ev("requeue", 161.0, restart_count=0, method="scontrol", cause="time_limit", requeued=True),
        # run 1 was killed by the time limit before it recorded anything: the batch shell's requeue
        _ev("requeue", 300.0, restart_count=1, method="scontrol", cause="time_limit", requeued=True,
            unstarted=True, source="cli", note="stopped in its start-up, before it began training (status 143)"),
        _ev("start", 320.0, restart_count=2, resumed_from=12),
        _ev("stop", 330.0, reason="done", step=20, committed_step=20),
    ]
    rows = interruptions(ledger, slurm=[])
    assert [(r.restart_count, r.cause, r.committed_step, r.lost_steps, r.resumed_step) for r in rows] == [
        (0, "time_limit", 12, 0, 12), (1, "time_limit", None, 0, 12)], rows
    got = summary(ledger, rows)
    assert got["finished"] and got["lost_steps_total"] == 0 and got["lost_steps_unknown"] == 0, got
    (tmp_path / LEDGER).write_text("".join(json.dumps(e) + "\n" for e in ledger))
    assert main(["history", str(tmp_path)]) == 0
    assert "unknown" not in capsys.readouterr().out
    assert main(["history", "--goodput", "--json", str(tmp_path)]) == 0
    # the goodput row of a stopped run says the cause its history row says (Slurm's reading)
    assert [r["ended"] for r in json.loads(capsys.readouterr().out)["rows"]] == ["time_limit", "start-up", "done"]


def test_a_stop_after_a_deferred_warning_is_the_preemptions_in_history_and_goodput(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The time-limit warning came long before the end and was deferred; a preemption (its TERM)
    stopped the run later: the row's signal, its time and the cause are the preemption's, and
    the goodput's row says the same cause as the history's (was: USR2 at the warning's time in
    history, 'signal' in the goodput)."""
    ledger = [
        _ev("start", 100.0, restart_count=0, resumed_from=None),
        _ev("signal", 110.0, signum=12, signame="SIGUSR2", step=5, cause="time_limit", deferred_s=250.0),
        _ev("signal", 150.0, signum=15, signame="SIGTERM", step=40, cause="preemption"),
        _ev("stop", 151.0, reason="signal", step=41, committed_step=41, requeue=True),
        _ev("requeue", 152.0, restart_count=0, method="scontrol", cause="preemption", requeued=True),
        _ev("start", 200.0, restart_count=1, resumed_from=41),
        _ev("stop", 230.0, reason="done", step=80, committed_step=80),
    ]
    rows = interruptions(ledger, slurm=[])
    assert [(r.signal, r.signal_time, r.step_at_signal, r.cause) for r in rows] == [
        ("SIGTERM", 150.0, 40, "preemption")], rows
    (tmp_path / LEDGER).write_text("".join(json.dumps(e) + "\n" for e in ledger))
    assert main(["history", "--goodput", "--json", str(tmp_path)]) == 0
    assert [r["ended"] for r in json.loads(capsys.readouterr().out)["rows"]] == ["preemption", "done"]


BLOCKED_STOP = """
import os, signal, sys, torch
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # as a launcher that blocked it would leave us
from hpcckpt import Checkpointer
model = torch.nn.Linear(2, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
ck = Checkpointer(dir=sys.argv[1], signals=("SIGTERM",))
ck.register(model=model, optimizer=opt)
for step in ck.steps(50):
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    if step == 3:
        os.kill(os.getpid(), signal.SIGTERM)
print("trained to the end", flush=True)
"""


def test_a_stop_signal_blocked_by_the_launcher_still_stops_the_run(tmp_path: Path) -> None:
    # A mask is inherited through exec. With SIGTERM blocked on the main thread the kernel hands
    # the signal to another thread (torch's, hpcckpt's) if there is one, and the stop came a
    # step late (step 5; in a process with no other thread it would stay pending for ever, as
    # the nsinit and app-mode tests of test_criu_parts show). install() unblocks it and says so.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "HPCCKPT_"))}
    got = subprocess.run([sys.executable, "-c", BLOCKED_STOP, str(tmp_path / "ck")], capture_output=True,
                         text=True, timeout=120, env=env)
    assert got.returncode == 75, got.stdout + got.stderr
    assert "trained to the end" not in got.stdout
    assert "SIGTERM was blocked in this process" in got.stderr
    assert (tmp_path / "ck" / "step-4").is_dir()


def test_a_script_with_its_own_checkpoints_is_judged_by_how_long_it_ran(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """pytorch/examples imagenet under the single template: it records nothing of hpcckpt's and
    trained a whole minute each time before the limit's TERM; the second such stop was refused
    as "its start-up does not fit the allocation" (the job TIMEOUT with epochs left)."""
    from hpcckpt.cli import requeue as cli_requeue
    monkeypatch.setattr(cli_requeue, "detect", _TimedOut)
    for restart in range(3):
        _in_job(monkeypatch, restart)
        assert main(["requeue", "--dir", str(tmp_path), "--stopped-status", "143", "--ran-s", "58"]) == 75
    reqs = [e for e in Ledger(tmp_path).events() if e["event"] == "requeue"]
    assert [(e["restart_count"], e.get("unstarted"), e["cause"]) for e in reqs] == \
        [(0, None, "time_limit"), (1, None, "time_limit"), (2, None, "time_limit")]
    assert "ran 58 s" in reqs[-1]["note"]
    # the same stop after 3 s of running: a start-up, refused at the second in a row
    _in_job(monkeypatch, 3)
    assert main(["requeue", "--dir", str(tmp_path), "--stopped-status", "143", "--ran-s", "3"]) == 75
    _in_job(monkeypatch, 4)
    assert main(["requeue", "--dir", str(tmp_path), "--stopped-status", "143", "--ran-s", "3"]) == 143
