"""The demo under real Slurm, stopped by `scancel --signal=USR2 --batch`: it checkpoints,
requeues itself, restarts with SLURM_RESTART_COUNT=1 and ends bit-identical."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from conftest import SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

STEPS = 60


def render_single(cluster: SlurmCluster, run_dir: Path, *, time_limit: str = "10:00",
                  lead_s: int = 50, steps: int = STEPS, sleep_s: float = 0.25) -> Path:
    command = (f'{sys.executable} -m hpcckpt.demo.train --dir "$HPCCKPT_RUN_DIR" --steps {steps} '
               f"--every 1000 --step-sleep {sleep_s}")
    return cluster.render("single", run_dir / "job.sbatch", TIME=time_limit, LEAD_S=str(lead_s),
                          RUN_DIR=str(run_dir), OUTPUT=f"{run_dir}/slurm-%j.out", COMMAND=command,
                          JOB_NAME="hpcckpt-test")


def assert_finished_identical(cluster: SlurmCluster, run_dir: Path, reference: str) -> list[dict[str, Any]]:
    result = json.loads((run_dir / "result.json").read_text())
    assert result["param_digest"] == reference, "resumed run is not bit-identical to the reference"
    return cluster.read_ledger(run_dir / "ckpt")


def test_scancel_signal_checkpoints_requeues_and_resumes_identically(
        slurm_cluster: SlurmCluster, tmp_path: Path, reference_digest: Callable[[int], str]) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    job = slurm_cluster.sbatch(render_single(slurm_cluster, run_dir))
    out = run_dir / f"slurm-{job}.out"
    slurm_cluster.wait_until(lambda: slurm_cluster.trace_steps(run_dir) >= 10, 120, "10 training steps")
    slurm_cluster.run(["scancel", "--signal=USR2", "--batch", job])

    assert slurm_cluster.wait_done(job, 240, out) == "COMPLETED"
    ledger = assert_finished_identical(slurm_cluster, run_dir, reference_digest(STEPS))
    starts = [e for e in ledger if e["event"] == "start"]
    assert [s["restart_count"] for s in starts] == [0, 1]
    stop = next(e for e in ledger if e["event"] == "stop" and e["reason"] != "done")
    assert stop["committed_step"] == stop["step"], "final checkpoint must be at the stop step"
    assert starts[1]["resumed_from"] == stop["step"]
    signal = next(e for e in ledger if e["event"] == "signal")
    assert signal["signame"] == "SIGUSR2"
    assert slurm_cluster.job(job)["Restarts"] == "1"

    history = slurm_cluster.hpcckpt("history", str(run_dir / "ckpt"), "--json")
    assert history.returncode == 0, history.stderr
    rows = json.loads(history.stdout)["rows"]
    assert len(rows) == 1
    assert rows[0]["lost_steps"] == 0
    assert rows[0]["cause"] == "signal"
    assert rows[0]["requeue_method"] == "scontrol"
