"""Requeue refused (the job was submitted with --no-requeue): hpcckpt submits a
successor job with --dependency=afterany:<id> that inherits the checkpoint directory
and finishes the training bit-identical."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from conftest import SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def test_refused_requeue_submits_successor_that_finishes(
        slurm_cluster: SlurmCluster, tmp_path: Path, reference_digest: Callable[[int], str]) -> None:
    steps = 50
    run_dir = tmp_path / "run with space"
    job = slurm_cluster.submit_demo("single", run_dir, "--no-requeue", steps=steps)
    slurm_cluster.wait_until(lambda: slurm_cluster.trace_steps(run_dir) >= 8, 120, "8 training steps")
    slurm_cluster.run(["scancel", "--signal=USR2", "--batch", job])
    slurm_cluster.wait_done(job, 120, run_dir / f"slurm-{job}.out")

    ledger = slurm_cluster.read_ledger(run_dir / "ckpt")
    requeue = [e for e in ledger if e["event"] == "requeue" and e.get("method") == "successor"]
    assert requeue, f"no successor recorded: {[e for e in ledger if e['event'] == 'requeue']}"
    successor = str(requeue[-1]["successor_job_id"])
    assert "disabled" in str(requeue[-1]["detail"]).lower()
    assert f"afterany:{job}" in slurm_cluster.job(successor).get("Dependency", "") or \
        slurm_cluster.state(successor) != "PENDING"
    assert slurm_cluster.wait_done(successor, 300, run_dir / f"slurm-{job}.out") == "COMPLETED"

    assert slurm_cluster.result_digest(run_dir) == reference_digest(steps), "not bit-identical"
    starts = [e for e in slurm_cluster.read_ledger(run_dir / "ckpt") if e["event"] == "start"]
    assert [s["job_id"] for s in starts] == [job, successor]
    stop = next(e for e in ledger if e["event"] == "stop")
    assert starts[1]["resumed_from"] == stop["committed_step"] == stop["step"]
