"""Real preemption: a `high` partition job preempts the demo running in `low`
(PreemptMode=REQUEUE, GraceTime): TERM, final checkpoint within the grace time,
requeue, restart, bit-identical result; once, and three times in one run."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from conftest import SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def _preempt_after_progress(cluster: SlurmCluster, job: str, run_dir: Path, min_new_steps: int) -> None:
    """Wait until the job runs and has trained ``min_new_steps`` more steps, then preempt it."""
    cluster.wait_for(job, {"RUNNING"}, 240, run_dir / f"slurm-{job}.out")
    base = cluster.trace_steps(run_dir)
    cluster.wait_until(lambda: cluster.trace_steps(run_dir) >= base + min_new_steps, 120,
                       f"{min_new_steps} more training steps")
    high = cluster.preempt()
    cluster.wait_for(high, {"RUNNING", "COMPLETING", "COMPLETED"}, 240)


def _check_run(cluster: SlurmCluster, job: str, run_dir: Path, reference: str, interruptions: int) -> None:
    cluster.wait_completed(job, 400, run_dir / f"slurm-{job}.out")
    assert cluster.result_digest(run_dir) == reference, "preempted run is not bit-identical"
    ledger = cluster.read_ledger(run_dir / "ckpt")
    starts = [e for e in ledger if e["event"] == "start"]
    assert [s["restart_count"] for s in starts] == list(range(interruptions + 1))
    # Slurm announces a preemption twice: EndTime moves to now + GraceTime (the policy
    # re-reads it) and TERM arrives; whichever comes first stops the job.
    stops = [e for e in ledger if e["event"] == "stop" and e["reason"] != "done"]
    assert len(stops) == interruptions
    for stop in stops:
        assert stop["reason"] in {"signal", "deadline"}, stop
        assert stop["committed_step"] == stop["step"], "final checkpoint must be at the stop step"
    assert cluster.job(job)["Restarts"] == str(interruptions)
    history = cluster.history(run_dir / "ckpt")
    assert history["finished"] is True
    assert [r["cause"] for r in history["rows"]] == ["preemption"] * interruptions
    assert history["lost_steps_total"] == 0, history["rows"]


def test_preempted_by_high_priority_job_resumes_identically(
        slurm_cluster: SlurmCluster, tmp_path: Path, reference_digest: Callable[[int], str]) -> None:
    steps = 60
    run_dir = tmp_path / "run"
    job = slurm_cluster.submit_demo("single", run_dir, "-p", "low", "--exclusive", steps=steps)
    _preempt_after_progress(slurm_cluster, job, run_dir, 8)
    _check_run(slurm_cluster, job, run_dir, reference_digest(steps), 1)


@pytest.mark.long(160)
def test_three_preemptions_in_one_run(
        slurm_cluster: SlurmCluster, tmp_path: Path, reference_digest: Callable[[int], str]) -> None:
    # Training goes on while a preemption is on its way (the scheduler's next pass plus the
    # job's 2 s end-time poll: ~5 s, ~25 steps), so the run must be long enough to still be
    # training at the third one: 250 steps leave each of the three ~16 s of sleeps, three times
    # what a notice took under load.
    steps = 250
    run_dir = tmp_path / "run"
    job = slurm_cluster.submit_demo("single", run_dir, "-p", "low", "--exclusive", steps=steps, sleep_s=0.2)
    for restart in range(3):
        slurm_cluster.wait_until(
            lambda r=restart: sum(1 for e in slurm_cluster.read_ledger(run_dir / "ckpt")
                                  if e["event"] == "start") > r, 240, f"run {restart} to start")
        _preempt_after_progress(slurm_cluster, job, run_dir, 5)
    _check_run(slurm_cluster, job, run_dir, reference_digest(steps), 3)
