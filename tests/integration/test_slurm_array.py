"""Array tasks: an array task whose requeue is refused (--no-requeue) comes back as the
same task (its successor has --array=T: the same SLURM_ARRAY_TASK_ID, %a and resources),
resumes the task's own checkpoint and finishes bit-identical; the ledger and `hpcckpt
history` name it A_T, as Slurm does, never by its raw job id."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.integration.test_slurm_successor import assert_same_job

if TYPE_CHECKING:
    from conftest import SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


@pytest.mark.long(80)
def test_array_task_with_refused_requeue_comes_back_as_the_same_task(
        slurm_cluster: SlurmCluster, tmp_path: Path, reference_digest: Callable[[int], str]) -> None:
    steps = 40
    run_dir = tmp_path / "task"
    array = slurm_cluster.submit_demo("single", run_dir, "--array=3", "--no-requeue", "--cpus-per-task=2",
                                      steps=steps)
    task = f"{array}_3"
    slurm_cluster.wait_for(task, {"RUNNING"}, 120)
    original = slurm_cluster.job(task)
    slurm_cluster.wait_until(lambda: slurm_cluster.trace_steps(run_dir) >= 8, 120, "8 training steps")
    slurm_cluster.run(["scancel", "--signal=USR2", "--batch", task])
    slurm_cluster.wait_until(lambda: any(e["event"] == "requeue" and e.get("successor_job_id")
                                         for e in slurm_cluster.read_ledger(run_dir / "ckpt")), 120, "a successor")
    requeue = [e for e in slurm_cluster.read_ledger(run_dir / "ckpt") if e["event"] == "requeue"][-1]
    successor = str(requeue["successor_job_id"])
    assert successor.endswith("_3") and successor != task, requeue
    # Compared in the same state (a pending job shows requests, e.g. NumNodes=1-1, a running one its allocation).
    slurm_cluster.wait_for(successor, {"RUNNING", "COMPLETING", "COMPLETED"}, 120)
    assert_same_job(original, slurm_cluster.job(successor))
    slurm_cluster.wait_completed(successor, 300)

    assert slurm_cluster.result_digest(run_dir) == reference_digest(steps), "not bit-identical"
    ledger = slurm_cluster.read_ledger(run_dir / "ckpt")
    starts = [e for e in ledger if e["event"] == "start"]
    assert [s["job_id"] for s in starts] == [task, successor]
    assert requeue["job_id"] == task
    history = slurm_cluster.history(run_dir / "ckpt")
    [row] = history["rows"]
    assert (row["job_id"], row["cause"], row["successor_job_id"], row["resumed_by"]) == \
        (task, "signal", successor, successor)
    assert f" {task} " in slurm_cluster.hpcckpt("history", str(run_dir / "ckpt")).stdout


@pytest.mark.long(210)
def test_history_of_an_array_task_names_it_and_each_cause(
        slurm_cluster: SlurmCluster, tmp_path: Path, reference_digest: Callable[[int], str]) -> None:
    # Task 1 of an array in `low`: first an operator's `scontrol requeue`, then a preemption.
    # The second run has ~55 s of training left when the preemption is submitted, so that it is
    # still training when the preemption reaches it however loaded the machine (with 60 steps it
    # once finished first: 10 s were not enough).
    steps = 150  # runs 0 and 1 train 8 + 5 steps and what comes before each stop lands (~25 at most)
    run_dir = tmp_path / "task"
    array = slurm_cluster.submit_demo("single", run_dir, "--array=1", "-p", "low", "--exclusive", steps=steps,
                                      sleep_s=0.2)
    task = f"{array}_1"

    def runs_started() -> int:
        return sum(1 for e in slurm_cluster.read_ledger(run_dir / "ckpt") if e["event"] == "start")

    slurm_cluster.wait_until(lambda: runs_started() >= 1 and slurm_cluster.trace_steps(run_dir) >= 8, 120,
                             "8 training steps")
    slurm_cluster.run(["scontrol", "requeue", task])  # an operator's requeue: TERM, then pending again
    slurm_cluster.wait_until(lambda: runs_started() >= 2, 240, "the run after the operator's requeue")
    base = slurm_cluster.trace_steps(run_dir)
    slurm_cluster.wait_until(lambda: slurm_cluster.trace_steps(run_dir) >= base + 5, 120, "5 more steps")
    high = slurm_cluster.preempt()
    slurm_cluster.wait_for(high, {"RUNNING", "COMPLETING", "COMPLETED"}, 240)
    slurm_cluster.wait_completed(task, 400, run_dir / f"slurm-{array}.out")

    assert slurm_cluster.result_digest(run_dir) == reference_digest(steps), "not bit-identical"
    ledger = slurm_cluster.read_ledger(run_dir / "ckpt")
    assert {e["job_id"] for e in ledger} == {task}, "every event names the task A_T"
    requeues = [e for e in ledger if e["event"] == "requeue"]
    assert all(r["requeued"] is True and r["evidence"] for r in requeues), requeues
    history = slurm_cluster.history(run_dir / "ckpt")
    assert [(r["job_id"], r["cause"]) for r in history["rows"]] == \
        [(task, "operator_requeue"), (task, "preemption")], history["rows"]
    assert history["finished"] and history["lost_steps_total"] == 0


@pytest.mark.long(250)
def test_a_duplicate_of_an_array_task_is_superseded_in_history(
        slurm_cluster: SlurmCluster, tmp_path: Path, reference_digest: Callable[[int], str]) -> None:
    # A second job on the directory of a running array task (as a successor and a requeued
    # original both started would be): it leaves at once, exit 0, and history names it, the
    # cause 'superseded' and the task that held the directory; the task finishes untouched.
    steps = 250  # 50 s of training left after the duplicate is submitted: it starts and gives way first
    run_dir = tmp_path / "task"
    array = slurm_cluster.submit_demo("single", run_dir, "--array=2", "-p", "low", steps=steps, sleep_s=0.2)
    task = f"{array}_2"
    slurm_cluster.wait_until(lambda: slurm_cluster.trace_steps(run_dir) >= 5, 120, "5 training steps")
    dup = slurm_cluster.sbatch(run_dir / "single.sbatch", "-p", "low")
    try:
        slurm_cluster.wait_completed(dup, 240, run_dir / f"slurm-{dup}.out")
        assert slurm_cluster.trace_steps(run_dir) < steps, "the task ended before its duplicate started"
        slurm_cluster.wait_completed(task, 400, run_dir / f"slurm-{array}.out")
    finally:
        slurm_cluster.cancel(dup)
        slurm_cluster.cancel(task)
    assert slurm_cluster.result_digest(run_dir) == reference_digest(steps), "not bit-identical"
    history = slurm_cluster.history(run_dir / "ckpt")
    assert [(r["job_id"], r["cause"], r["resumed_by"]) for r in history["rows"]] == \
        [(dup, "superseded", task)], history["rows"]
    assert history["finished"]
    table = slurm_cluster.hpcckpt("history", str(run_dir / "ckpt")).stdout
    assert "superseded" in table and task in table, table
