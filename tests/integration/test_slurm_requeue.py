"""Requeue from facts, confirmed: stops after which Slurm itself will NOT run the job
again (a PreemptMode=CANCEL preemption whose TERM arrives before hpcckpt's end-time poll,
Slurm's own TIMEOUT kill) still come back, by a confirmed requeue or a successor, and
finish bit-identical; `requeued` is recorded only with Slurm's evidence."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from conftest import SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def _ensure_cancel_partition(cluster: SlurmCluster) -> None:
    """slurm/localcluster configures `cancel`; a cluster started before it did gets it now."""
    if "PartitionName=cancel" in cluster.run(["scontrol", "show", "partition", "-o", "cancel"], check=False):
        return
    nodes = cluster.run(["sinfo", "-h", "-p", "low", "-o", "%N"]).strip()
    cluster.run(["scontrol", "create", "PartitionName=cancel", f"Nodes={nodes}", "PriorityTier=1",
                 "PreemptMode=CANCEL", "GraceTime=0", "OverSubscribe=NO", "State=UP"])


def _requeues(cluster: SlurmCluster, run_dir: Path, source: str) -> list[dict[str, Any]]:
    return [e for e in cluster.read_ledger(run_dir / "ckpt") if e["event"] == "requeue" and e["source"] == source]


def _finished_after_comeback(cluster: SlurmCluster, job: str, run_dir: Path,
                             source: str = "checkpointer") -> tuple[str, dict[str, Any]]:
    """Wait for the confirmed requeue (by ``source``) and for the job (or its successor) to finish."""
    cluster.wait_until(lambda: bool(_requeues(cluster, run_dir, source)), 400, f"the requeue record of {source}")
    requeue = _requeues(cluster, run_dir, source)[-1]
    assert requeue["requeued"] is True and requeue["evidence"], requeue
    last = str(requeue["successor_job_id"] or job)
    assert cluster.wait_done(last, 900, run_dir / f"slurm-{job}.out") == "COMPLETED", requeue
    return last, requeue


def test_cancel_mode_preemption_comes_back(
        slurm_cluster: SlurmCluster, tmp_path: Path, reference_digest: Callable[[int], str]) -> None:
    _ensure_cancel_partition(slurm_cluster)
    steps = 60
    run_dir = tmp_path / "run"
    job = slurm_cluster.submit_demo("single", run_dir, "-p", "cancel", "--exclusive", steps=steps)
    slurm_cluster.wait_for(job, {"RUNNING"}, 120, run_dir / f"slurm-{job}.out")
    slurm_cluster.wait_until(lambda: slurm_cluster.trace_steps(run_dir) >= 8, 120, "8 training steps")
    slurm_cluster.preempt()  # PreemptMode=CANCEL, GraceTime=0: TERM now, the end of the job after KillWait
    _finished_after_comeback(slurm_cluster, job, run_dir)

    assert slurm_cluster.result_digest(run_dir) == reference_digest(steps), "not bit-identical"
    ledger = slurm_cluster.read_ledger(run_dir / "ckpt")
    stop = next(e for e in ledger if e["event"] == "stop" and e["reason"] != "done")
    assert stop["reason"] == "signal" and stop["committed_step"] == stop["step"]
    history = slurm_cluster.history(run_dir / "ckpt")
    assert history["finished"] and history["lost_steps_total"] == 0
    assert [r["cause"] for r in history["rows"]] == ["preemption"], history["rows"]


def test_slurm_timeout_kill_comes_back(
        slurm_cluster: SlurmCluster, tmp_path: Path, reference_digest: Callable[[int], str]) -> None:
    # The training process does not ask Slurm for its end time (local backend) and listens
    # to TERM only: the first it hears is the TERM of Slurm's own TIMEOUT. It saves and
    # exits 75; the batch shell's `hpcckpt requeue` meets a job Slurm has already ended.
    steps, sleep_s = 90, 0.75  # at least 67 s of training: more than the 1-minute limit
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    command = (f'env HPCCKPT_CLUSTER=local HPCCKPT_SIGNALS=SIGTERM {sys.executable} -m hpcckpt.demo.train '
               f'--dir "$HPCCKPT_RUN_DIR" --steps {steps} --every 100000 --step-sleep {sleep_s}')
    script = slurm_cluster.render("single", run_dir / "single.sbatch", TIME="1", LEAD_S="0", RUN_DIR=str(run_dir),
                                  OUTPUT=f"{run_dir}/slurm-%j.out", COMMAND=command, JOB_NAME="hpcckpt-timeout")
    job = slurm_cluster.sbatch(script)
    _, requeue = _finished_after_comeback(slurm_cluster, job, run_dir, source="cli")

    assert slurm_cluster.result_digest(run_dir) == reference_digest(steps), "not bit-identical"
    assert requeue["cause"] == "time_limit", requeue
    history = slurm_cluster.history(run_dir / "ckpt")
    assert history["finished"] and history["lost_steps_total"] == 0
    assert {r["cause"] for r in history["rows"]} == {"time_limit"}, history["rows"]
