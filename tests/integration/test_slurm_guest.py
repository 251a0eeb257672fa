"""hpcckpt is a guest of the user and the scheduler (real Slurm on loopback):

- ``scancel`` means cancel: the job ends CANCELLED, is not requeued, gets no successor, and
  ``history`` says ``user_cancel``: in-process (requeue allowed or ``--no-requeue``, whose
  refused requeue once submitted a successor at every cancel) and in CRIU mode;
- a job's name cannot forge Slurm's fields: jobs named like Slurm's own keys are preempted
  and come back with their real state, restart count, end time and partition.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from hpcckpt.cluster.scontrol import show_job

from .test_criu_local import TRAIN, criu_ok  # noqa: F401  (fixture)

if TYPE_CHECKING:
    from conftest import SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def _jobs_named(name: str) -> list[str]:
    """Every job Slurm knows (any state) with this exact name."""
    out = subprocess.run(["squeue", "-h", "--states=all", "-n", name, "-O", "JobID:|"], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    return [line.strip("|") for line in out.split() if line.strip("|")]


@pytest.mark.parametrize("requeue_option", ["--requeue", "--no-requeue"])
def test_scancel_of_a_running_job_ends_it(slurm_cluster: SlurmCluster, tmp_path: Path, requeue_option: str) -> None:
    run_dir = tmp_path / "run"
    name = f"hpcckpt-cancel-{uuid.uuid4().hex[:12]}"
    job = slurm_cluster.submit_demo("single", run_dir, "-p", "low", requeue_option, "-J", name, steps=400)
    out = run_dir / f"slurm-{job}.out"
    slurm_cluster.wait_for(job, {"RUNNING"}, 240, out)
    slurm_cluster.wait_until(lambda: slurm_cluster.trace_steps(run_dir) >= 5, 120, "5 training steps")
    slurm_cluster.cancel(job)
    state = slurm_cluster.wait_done(job, 240, out)
    text = out.read_text(errors="replace")
    assert state == "CANCELLED", text[-3000:]
    record = show_job(job)
    assert record["Restarts"] == "0", record
    assert _jobs_named(name) == [job], "a successor or another job was submitted for a cancel"
    ledger = slurm_cluster.read_ledger(run_dir / "ckpt")
    requeues = [e for e in ledger if e["event"] == "requeue"]
    assert requeues and all(not e["requeued"] for e in requeues), requeues
    assert requeues[0]["method"] == "cancelled" and requeues[0]["cause"] == "user_cancel", requeues
    stops = [e for e in ledger if e["event"] == "stop"]
    assert stops and stops[-1]["committed_step"] == stops[-1]["step"], "the stop's checkpoint was taken"
    history = slurm_cluster.history(run_dir / "ckpt")
    assert [r["cause"] for r in history["rows"]] == ["user_cancel"], history["rows"]
    assert history["finished"] is False


# Each puts a key Slurm prints into the name, where a first-occurrence parse of `scontrol show
# job -o` took it for Slurm's (pending -> "requeued by Slurm itself", never run again; a
# restart count; an end time in the past, refused at start; another partition).
FORGED_NAMES = ["x JobState=PENDING Restarts=3 EndTime=2001-01-01T00:00:00 Partition=high",
                "r4 Restarts=3\nJobState=PENDING"]


@pytest.mark.long(120)
def test_jobs_named_like_slurm_fields_come_back_with_their_own(
        slurm_cluster: SlurmCluster, tmp_path: Path, reference_digest: Callable[[int], str]) -> None:
    steps = 60
    jobs: list[tuple[str, Path]] = []
    for i, name in enumerate(FORGED_NAMES):
        run_dir = tmp_path / f"run{i}"
        jobs.append((slurm_cluster.submit_demo("single", run_dir, "-p", "low", "-J", name, steps=steps), run_dir))
    for job, run_dir in jobs:
        assert show_job(job, free_text=True)["JobName"] == FORGED_NAMES[jobs.index((job, run_dir))]
        slurm_cluster.wait_for(job, {"RUNNING"}, 240, run_dir / f"slurm-{job}.out")
        slurm_cluster.wait_until(lambda r=run_dir: slurm_cluster.trace_steps(r) >= 5, 120, "5 training steps")
    high = slurm_cluster.preempt()
    slurm_cluster.wait_for(high, {"RUNNING", "COMPLETING", "COMPLETED"}, 240)
    for job, run_dir in jobs:
        slurm_cluster.wait_completed(job, 400, run_dir / f"slurm-{job}.out")
        assert slurm_cluster.result_digest(run_dir) == reference_digest(steps), "not bit-identical"
        record = show_job(job)
        assert record["Restarts"] == "1" and record["Partition"] == "low", record
        ledger = slurm_cluster.read_ledger(run_dir / "ckpt")
        assert [s["restart_count"] for s in ledger if s["event"] == "start"] == [0, 1]
        requeues = [e for e in ledger if e["event"] == "requeue"]
        assert len(requeues) == 1 and requeues[0]["requeued"] is True, requeues
        history = slurm_cluster.history(run_dir / "ckpt")
        assert history["finished"] is True and [r["cause"] for r in history["rows"]] == ["preemption"], history


@pytest.mark.criu
def test_scancel_of_a_criu_job_ends_it(slurm_cluster: SlurmCluster, criu_ok: None,  # noqa: F811
                                       tmp_path: Path) -> None:
    run_dir, result = tmp_path / "run", tmp_path / "result.json"
    run_dir.mkdir()
    template = Path(__file__).resolve().parents[2] / "jobscripts" / "criu.sbatch"
    name = f"hpcckpt-criu-cancel-{uuid.uuid4().hex[:12]}"
    job = slurm_cluster.run(["sbatch", "--parsable", "--time=10:00", "-p", "criu", "-J", name,
                             f"--output={run_dir}/slurm-%j.out", f"--export=ALL,HPCCKPT_RUN_DIR={run_dir}",
                             str(template), sys.executable, str(TRAIN), "--steps", "400", "--out", str(result),
                             "--step-sleep-s", "0.3"]).strip().split(";")[0]
    out = run_dir / f"slurm-{job}.out"

    def stepping() -> bool:
        return any("step 3 " in p.read_text() for p in (run_dir / "criu" / "stdio").glob(f"{job}-r0-*.out"))

    slurm_cluster.wait_until(stepping, 300, f"job {job} at step 3")
    slurm_cluster.cancel(job)
    state = slurm_cluster.wait_done(job, 240, out)
    assert state == "CANCELLED", out.read_text(errors="replace")[-3000:]
    assert show_job(job)["Restarts"] == "0"
    assert _jobs_named(name) == [job]
    ledger = slurm_cluster.read_ledger(run_dir)
    requeues = [e for e in ledger if e["event"] == "requeue"]
    assert requeues and all(not e["requeued"] and e["cause"] == "user_cancel" for e in requeues), requeues
    assert not result.exists()


@pytest.mark.long(90)
def test_a_stopped_slurmctld_never_holds_the_training_nor_the_stop(
        slurm_cluster: SlurmCluster, tmp_path: Path, reference_digest: Callable[[int], str]) -> None:
    """slurmctld stopped (SIGSTOP) mid-run. The steps go on at their pace, the end-time polls
    (every 2 s here) waiting off the training thread: each poll in the step path once held the
    step up to 30 s (about 8 steps in the 40 asked for here within two minutes, where the
    training needs ~10 s for them). Then a stop while it still cannot answer: the final
    checkpoint, every call into Slurm within the stop's bound (30 s in all here), an honest
    record, exit 75 (unbounded, the stop path spent 30 s on each of its calls); once slurmctld
    is back the batch script's `hpcckpt requeue` puts the job back and it finishes
    bit-identical."""
    import os
    import signal

    from tests.stacks import job_pids

    steps = 60
    run_dir = tmp_path / "run"
    job = slurm_cluster.submit_demo("single", run_dir, "-p", "low", steps=steps, sleep_s=0.25)
    slurm_cluster.wait_for(job, {"RUNNING"}, 240, run_dir / f"slurm-{job}.out")
    slurm_cluster.wait_until(lambda: slurm_cluster.trace_steps(run_dir) >= 5, 120, "5 training steps")
    [trainer] = [p for p in job_pids(job) if b"hpcckpt.demo.train" in Path(f"/proc/{p}/cmdline").read_bytes()]
    ctld = int((slurm_cluster.state_dir / "run" / "slurmctld.pid").read_text().strip())
    base = slurm_cluster.trace_steps(run_dir)
    os.kill(ctld, signal.SIGSTOP)
    try:
        slurm_cluster.wait_until(lambda: slurm_cluster.trace_steps(run_dir) >= base + 40, 120,
                                 "40 training steps while slurmctld is stopped")
        os.kill(trainer, signal.SIGTERM)
        slurm_cluster.wait_until(lambda: not Path(f"/proc/{trainer}").exists(), 120,
                                 "the training process to end while slurmctld is stopped")
        requeues = [e for e in slurm_cluster.read_ledger(run_dir / "ckpt") if e["event"] == "requeue"]
    finally:
        os.kill(ctld, signal.SIGCONT)
    assert len(requeues) == 1 and requeues[0]["requeued"] is False, requeues
    assert "slurmctld" in str(requeues[0]["detail"]), requeues
    stops = [e for e in slurm_cluster.read_ledger(run_dir / "ckpt") if e["event"] == "stop"]
    assert stops[0]["committed_step"] == stops[0]["step"] >= base + 40, "the final checkpoint was taken"
    slurm_cluster.wait_completed(job, 400, run_dir / f"slurm-{job}.out")
    assert slurm_cluster.result_digest(run_dir) == reference_digest(steps)
    assert [e["requeued"] for e in slurm_cluster.read_ledger(run_dir / "ckpt") if e["event"] == "requeue"] == \
        [False, True], "the batch script's requeue, once slurmctld answered"
