"""The demo under real Slurm, stopped by `scancel --signal=USR2 --batch`: it checkpoints,
requeues itself, restarts with SLURM_RESTART_COUNT=1 and ends bit-identical."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from conftest import SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

STEPS = 60


def test_scancel_signal_checkpoints_requeues_and_resumes_identically(
        slurm_cluster: SlurmCluster, tmp_path: Path, reference_digest: Callable[[int], str]) -> None:
    run_dir = tmp_path / "run"
    job = slurm_cluster.submit_demo("single", run_dir, steps=STEPS)
    out = run_dir / f"slurm-{job}.out"
    slurm_cluster.wait_until(lambda: slurm_cluster.trace_steps(run_dir) >= 10, 120, "10 training steps")
    slurm_cluster.run(["scancel", "--signal=USR2", "--batch", job])

    slurm_cluster.wait_completed(job, 240, out)
    assert slurm_cluster.result_digest(run_dir) == reference_digest(STEPS), "not bit-identical"
    ledger = slurm_cluster.read_ledger(run_dir / "ckpt")
    starts = [e for e in ledger if e["event"] == "start"]
    assert [s["restart_count"] for s in starts] == [0, 1]
    stop = next(e for e in ledger if e["event"] == "stop" and e["reason"] != "done")
    assert stop["committed_step"] == stop["step"], "final checkpoint must be at the stop step"
    assert starts[1]["resumed_from"] == stop["step"]
    signal = next(e for e in ledger if e["event"] == "signal")
    assert signal["signame"] == "SIGUSR2"
    assert slurm_cluster.job(job)["Restarts"] == "1"

    rows = slurm_cluster.history(run_dir / "ckpt")["rows"]
    assert len(rows) == 1
    assert rows[0]["lost_steps"] == 0
    assert rows[0]["cause"] == "signal"
    assert rows[0]["requeue_method"] == "scontrol"


def test_srun_step_under_batch_signal_is_warned_and_comes_back(
        slurm_cluster: SlurmCluster, tmp_path: Path, reference_digest: Callable[[int], str]) -> None:
    # `srun python train.py` in the single template: the B: signal reaches only the batch
    # shell, which forwards it to srun (and srun to its task); the rank in the step requeues.
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    command = (f'srun --ntasks=1 {sys.executable} -m hpcckpt.demo.train --dir "$HPCCKPT_RUN_DIR" '
               f"--steps {STEPS} --every 100000 --step-sleep 0.25")
    script = slurm_cluster.render("single", run_dir / "srun.sbatch", TIME="10:00", LEAD_S="50",
                                  RUN_DIR=str(run_dir), OUTPUT=f"{run_dir}/slurm-%j.out", COMMAND=command,
                                  JOB_NAME="hpcckpt-srun")
    job = slurm_cluster.sbatch(script)
    out = run_dir / f"slurm-{job}.out"
    slurm_cluster.wait_until(lambda: slurm_cluster.trace_steps(run_dir) >= 10, 120, "10 training steps")
    slurm_cluster.run(["scancel", "--signal=USR2", "--batch", job])  # what --signal=B:USR2@N delivers

    slurm_cluster.wait_completed(job, 240, out)
    assert slurm_cluster.result_digest(run_dir) == reference_digest(STEPS), "not bit-identical"
    ledger = slurm_cluster.read_ledger(run_dir / "ckpt")
    assert next(e for e in ledger if e["event"] == "signal")["signame"] == "SIGUSR2"
    [requeue] = [e for e in ledger if e["event"] == "requeue"]
    assert requeue["requeued"] is True and requeue["method"] == "scontrol" and requeue["evidence"], requeue
    assert "forwarding it to the training command" in out.read_text()
    rows = slurm_cluster.history(run_dir / "ckpt")["rows"]
    assert [(r["cause"], r["lost_steps"], r["requeued"]) for r in rows] == [("signal", 0, True)]
