"""Requeue refused (the job was submitted with --no-requeue): hpcckpt submits a
successor job with --dependency=afterany:<id> that is the same job (its script, every
option of its allocation, its array index), inherits the checkpoint directory and
finishes the training bit-identical."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from conftest import SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

# What must be the same in `scontrol show job` of the original and its successor.
SAME_FIELDS = ("JobName", "Partition", "Account", "QOS", "Requeue", "NumNodes", "NumCPUs", "NumTasks",
               "CPUs/Task", "MinMemoryNode", "MinMemoryCPU", "TimeLimit", "TimeMin", "Comment", "Features",
               "WorkDir", "StdOut", "StdErr", "StdIn", "TRES", "TresPerNode", "OverSubscribe", "ReqNodeList",
               "ExcNodeList", "ArrayTaskId", "Reservation", "Licenses")


def assert_same_job(original: dict[str, str], successor: dict[str, str]) -> None:
    """Field by field; names the fields that differ."""
    assert original and successor, "a job record is missing (MinJobAge too short?)"
    diff = {k: (original.get(k), successor.get(k)) for k in SAME_FIELDS if original.get(k) != successor.get(k)}
    assert not diff, f"the successor is not the same job: {diff}"


def stop_with_successor(cluster: SlurmCluster, job: str, run_dir: Path) -> str:
    """Warn the batch shell (as `--signal=B:` would), wait for the refused requeue's successor."""
    cluster.wait_until(lambda: cluster.trace_steps(run_dir) >= 8, 120, "8 training steps")
    cluster.run(["scancel", "--signal=USR2", "--batch", job])
    cluster.wait_until(lambda: any(e["event"] == "requeue" and e.get("successor_job_id")
                                   for e in cluster.read_ledger(run_dir / "ckpt")), 120, "a successor")
    requeue = [e for e in cluster.read_ledger(run_dir / "ckpt") if e["event"] == "requeue"]
    assert requeue[-1]["requeued"] is True and requeue[-1]["method"] == "successor", requeue
    assert "disabled" in str(requeue[-1]["detail"]).lower()
    return str(requeue[-1]["successor_job_id"])


def test_refused_requeue_submits_the_same_job_that_finishes(
        slurm_cluster: SlurmCluster, tmp_path: Path, reference_digest: Callable[[int], str]) -> None:
    steps = 40
    run_dir = tmp_path / "run with space"
    job = slurm_cluster.submit_demo("single", run_dir, "--no-requeue", "--cpus-per-task=2", "--mem=500",
                                    "--comment=hpcckpt successor test", steps=steps)
    slurm_cluster.wait_for(job, {"RUNNING"}, 120, run_dir / f"slurm-{job}.out")
    original = slurm_cluster.job(job)
    successor = stop_with_successor(slurm_cluster, job, run_dir)
    assert f"afterany:{job}" in slurm_cluster.job(successor).get("Dependency", "") or \
        slurm_cluster.state(successor) != "PENDING"
    # Compared in the same state (a pending job shows requests, e.g. NumNodes=1-1, a running one its allocation).
    slurm_cluster.wait_for(successor, {"RUNNING", "COMPLETING", "COMPLETED"}, 120)
    assert_same_job(original, slurm_cluster.job(successor))
    assert original["Requeue"] == "0" and original["CPUs/Task"] == "2" and original["MinMemoryNode"] == "500M"
    slurm_cluster.wait_completed(successor, 300, run_dir / f"slurm-{job}.out")

    assert slurm_cluster.result_digest(run_dir) == reference_digest(steps), "not bit-identical"
    ledger = slurm_cluster.read_ledger(run_dir / "ckpt")
    starts = [e for e in ledger if e["event"] == "start"]
    assert [s["job_id"] for s in starts] == [job, successor]
    stop = next(e for e in ledger if e["event"] == "stop")
    assert starts[1]["resumed_from"] == stop["committed_step"] == stop["step"]
    history = slurm_cluster.history(run_dir / "ckpt")
    assert history["finished"] and history["lost_steps_total"] == 0
    [row] = history["rows"]
    assert (row["cause"], row["requeue_method"], row["successor_job_id"]) == ("signal", "successor", successor)
    table = slurm_cluster.hpcckpt("history", str(run_dir / "ckpt")).stdout
    assert f"successor {successor}" in table, table
