"""CRIU mode in a real Slurm job (slurm/localcluster), with the shipped template.

``scancel --signal=USR2 --batch`` stands in for the time-limit warning: the
supervisor dumps the unmodified training job, ``scontrol requeue``s it, Slurm
restarts the same batch script (SLURM_RESTART_COUNT=1), which restores the image;
the job must end with parameters bit-identical to an uninterrupted run.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from .test_criu_local import STEPS, TRAIN, criu_ok, job_output, reference  # noqa: F401  (fixtures)

if TYPE_CHECKING:
    from conftest import SlurmCluster

pytestmark = [pytest.mark.criu, pytest.mark.slurm, pytest.mark.slow]

TEMPLATE = Path(__file__).resolve().parents[2] / "jobscripts" / "criu.sbatch"


def submit(cluster: SlurmCluster, run_dir: Path, out: Path) -> tuple[str, Path]:
    run_dir.mkdir(parents=True, exist_ok=True)
    # The command goes after the script as its arguments (Slurm passes them again on
    # every restart), which the fixture's sbatch helper has no room for.
    args = ["sbatch", "--parsable", "--time=10:00", f"--output={run_dir}/slurm-%j.out",
            f"--export=ALL,HPCCKPT_RUN_DIR={run_dir}", str(TEMPLATE),
            sys.executable, str(TRAIN), "--steps", str(STEPS), "--out", str(out),
            # slow enough that the signal (scancel -> slurmd -> batch shell) lands within a
            # few steps of the one aimed at, whatever the machine's speed; numerics unchanged
            "--step-sleep-s", "0.3"]
    job = cluster.run(args).strip().split(";")[0]
    return job, run_dir / f"slurm-{job}.out"


def signal_at_step(cluster: SlurmCluster, job: str, run_dir: Path, step: int, incarnation: int) -> None:
    def reached() -> bool:
        outs = sorted((run_dir / "criu" / "stdio").glob(f"{job}-r{incarnation}-*.out"))
        return any(f"step {step} " in p.read_text() for p in outs)

    cluster.wait_until(reached, 300, f"job {job} run {incarnation} at step {step}")
    cluster.run(["scancel", "--signal=USR2", "--batch", job])


def events(cluster: SlurmCluster, run_dir: Path, name: str) -> list[dict]:
    return [e for e in cluster.read_ledger(run_dir) if e["event"] == name]


@pytest.mark.parametrize("dump_steps", [[12], [8, 24]], ids=["one-dump", "two-dumps"])
def test_slurm_job_dumped_requeued_restored_identically(
        slurm_cluster: SlurmCluster, criu_ok: None, reference: dict, tmp_path: Path,  # noqa: F811
        dump_steps: list[int]) -> None:
    run_dir, out = tmp_path / "run", tmp_path / "result.json"
    job, slurm_out = submit(slurm_cluster, run_dir, out)
    try:
        for incarnation, step in enumerate(dump_steps):
            signal_at_step(slurm_cluster, job, run_dir, step, incarnation)
            slurm_cluster.wait_until(lambda n=incarnation: len(events(slurm_cluster, run_dir, "criu_dump")) > n,
                                     120, f"dump {incarnation + 1} of job {job}")
        assert slurm_cluster.wait_done(job, 600, slurm_out) == "COMPLETED"
    finally:
        slurm_cluster.cancel(job)
    result = json.loads(out.read_text())
    assert result["digest"] == reference["digest"], slurm_out.read_text()[-3000:]
    assert result["losses"] == reference["losses"]
    assert slurm_cluster.job(job)["Restarts"] == str(len(dump_steps))

    dumps = events(slurm_cluster, run_dir, "criu_dump")
    restores = events(slurm_cluster, run_dir, "criu_restore")
    assert [d["restart_count"] for d in dumps] == list(range(len(dump_steps)))
    assert [r["restart_count"] for r in restores] == list(range(1, len(dump_steps) + 1))
    assert [r["image"] for r in restores] == [d["image"] for d in dumps]
    assert all(d["bytes"] > 0 and d["job_id"] == job for d in dumps)
    # Each Slurm run wrote the job's stdout to its own file.
    outs = sorted((run_dir / "criu" / "stdio").glob(f"{job}-r*.out"))
    assert len(outs) == len(dump_steps) + 1
    assert f"done {STEPS}" in job_output(run_dir)
