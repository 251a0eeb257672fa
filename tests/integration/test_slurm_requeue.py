"""Requeue from facts, confirmed: a stop after which Slurm itself will NOT run the job
again (a PreemptMode=CANCEL preemption whose TERM arrives before hpcckpt's end-time poll)
still comes back, by a confirmed requeue or a successor, and finishes bit-identical;
`requeued` is recorded only with Slurm's evidence. Which the job notices first, the TERM
(reason "signal") or the end time Slurm pulled in to now (reason "deadline"), is a race on a
loaded machine; either way history must say preemption.

Slurm's own TIMEOUT kill takes the same path (a COMPLETING job requeued, confirmed by its
restart count); it is not a test here: reaching it means a process that does not read its
end time, i.e. the batch shell's `hpcckpt requeue`, which then races KillWait (5 s here)."""

from __future__ import annotations

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
    cluster.wait_completed(last, 900, run_dir / f"slurm-{job}.out")
    return last, requeue


@pytest.mark.long(88)
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
    # TERM and the pulled-in end time arrive together (GraceTime=0): either may be seen first.
    assert stop["reason"] in {"signal", "deadline"} and stop["committed_step"] == stop["step"], stop
    history = slurm_cluster.history(run_dir / "ckpt")
    assert history["finished"] and history["lost_steps_total"] == 0
    assert [r["cause"] for r in history["rows"]] == ["preemption"], history["rows"]
