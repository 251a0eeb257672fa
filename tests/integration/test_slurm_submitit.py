"""submitit: the rendered launcher (`hpcckpt template submitit`) submits the @preemptible
demo through submitit's executor; USR2 to its step stops it at a step boundary, it
requeues, submitit runs the same pickled callable again, and it resumes bit-identical."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from conftest import SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def test_submitit_job_is_requeued_and_resumes(
        slurm_cluster: SlurmCluster, tmp_path: Path, reference_digest: Callable[[int], str]) -> None:
    steps = 60
    launcher = slurm_cluster.render("submitit", tmp_path / "launcher.py", TIME_MIN="10", LEAD_S="30")
    run_dir = tmp_path / "run"
    out = subprocess.run([sys.executable, str(launcher), "--run-dir", str(run_dir), "--steps", str(steps),
                          "--step-sleep", "0.25"], capture_output=True, text=True, timeout=120, check=True)
    job = out.stdout.strip().splitlines()[-1]
    slurm_cluster.wait_until(lambda: slurm_cluster.trace_steps(run_dir) >= 10, 180, "10 training steps")
    slurm_cluster.run(["scancel", "--signal=USR2", job])  # to the srun step, as submitit's warning is
    slurm_cluster.wait_completed(job, 300)

    assert slurm_cluster.result_digest(run_dir) == reference_digest(steps), "not bit-identical"
    ledger = slurm_cluster.read_ledger(run_dir / "ckpt")
    assert [e["restart_count"] for e in ledger if e["event"] == "start"] == [0, 1]
    stop = next(e for e in ledger if e["event"] == "stop" and e["reason"] != "done")
    assert stop["committed_step"] == stop["step"]
    result = list((run_dir / "submitit").glob(f"{job}_*_result.pkl"))
    assert result, "submitit recorded no result for the job"
