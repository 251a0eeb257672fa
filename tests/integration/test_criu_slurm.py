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
        slurm_cluster.wait_completed(job, 600, slurm_out)
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


# An unmodified torchrun job: torchrun's agent holds an io_uring instance (its TCPStore's
# libuv loop), which criu 4 refuses to dump.
TORCHRUN_SCRIPT = """
import os, sys, time
import torch.distributed as dist
dist.init_process_group("gloo")
print("training under torchrun, rank", dist.get_rank(), flush=True)
deadline = time.time() + 600
while not os.path.exists(sys.argv[1]) and time.time() < deadline:
    time.sleep(0.2)
dist.destroy_process_group()
print("torchrun job finished", flush=True)
"""


def test_torchrun_under_the_criu_template_is_named_undumpable_and_runs_to_its_end(
        slurm_cluster: SlurmCluster, criu_ok: None, tmp_path: Path) -> None:  # noqa: F811
    """Real torchrun through the rendered criu template on the local Slurm cluster: the
    supervisor's start-up checks (5 s and 45 s into the run) name the io_uring and the
    in-process alternative, on the job's Slurm output and in the ledger; the job is never
    touched and ends with its own status."""
    run_dir, script, flag = tmp_path / "run", tmp_path / "ddp_job.py", tmp_path / "finish"
    script.write_text(TORCHRUN_SCRIPT)
    run_dir.mkdir()
    args = ["sbatch", "--parsable", "--time=10:00", f"--output={run_dir}/slurm-%j.out",
            f"--export=ALL,HPCCKPT_RUN_DIR={run_dir}", str(TEMPLATE),
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
            str(script), str(flag)]
    job = slurm_cluster.run(args).strip().split(";")[0]
    slurm_out = run_dir / f"slurm-{job}.out"
    try:
        slurm_cluster.wait_until(lambda: bool(events(slurm_cluster, run_dir, "criu_check")), 300,
                                 f"the dumpability check of job {job}")
        [check] = events(slurm_cluster, run_dir, "criu_check")
        assert check["ok"] is False, check
        assert any("io_uring" in p["what"] and "torch" in p["command"] for p in check["problems"]), check
        assert "hpcckpt template torchrun" in check["fix"]
        assert slurm_cluster.job(job)["JobState"] == "RUNNING"  # looked at, never touched
        slurm_cluster.wait_until(lambda: "THIS JOB CANNOT BE DUMPED BY CRIU" in slurm_out.read_text(), 60,
                                 "the message in the job's Slurm output")
    finally:
        flag.touch()
    try:
        slurm_cluster.wait_completed(job, 300, slurm_out)
    finally:
        slurm_cluster.cancel(job)
    text = slurm_out.read_text()
    assert "io_uring" in text and "hpcckpt template torchrun" in text, text[-3000:]
    assert "torchrun job finished" in job_output(run_dir)
    assert not events(slurm_cluster, run_dir, "criu_dump")


MULTI_NODE = """import os, sys, time
rank, restarts = os.environ.get("SLURM_PROCID", "?"), int(os.environ.get("SLURM_RESTART_COUNT", "0"))
for step in range(1, 9):
    print(f"rank {rank} step {step}", flush=True)
    while step == 3 and restarts == 0:  # the first run waits here for its preemption
        time.sleep(0.1)
print(f"rank {rank} done", flush=True)
"""


def test_a_two_node_job_is_refused_at_its_start_and_comes_back_from_a_preemption(
        slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """A user's own 2-node batch script under ``hpcckpt run --mode criu`` (the template refuses
    NODES > 1; a hand-written script is refused by the supervisor): the job runs on untouched,
    says why at its start, and a preemption is Slurm's to requeue, never a FAILED job."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (tmp_path / "two_nodes.py").write_text(MULTI_NODE)
    script = tmp_path / "two_nodes.sbatch"
    script.write_text("#!/bin/bash\n"
                      f"exec {sys.executable} -m hpcckpt.cli run --mode criu --dir {run_dir} -- "
                      f"srun --ntasks-per-node=1 {sys.executable} {tmp_path / 'two_nodes.py'}\n")
    out = run_dir / "slurm.out"
    job = slurm_cluster.run(["sbatch", "--parsable", "-N", "2", "-p", "criu0", "--time=5:00",
                             f"--output={out}", str(script)]).strip().split(";")[0]
    try:
        slurm_cluster.wait_until(lambda: out.exists() and out.read_text().count(" step 3") >= 2, 240,
                                 f"job {job}'s two ranks at step 3")
        text = out.read_text()
        assert "NOT IN CRIU MODE" in text and "hpcckpt template ddp" in text, text
        high = slurm_cluster.preempt()
        slurm_cluster.wait_for(high, {"RUNNING", "COMPLETING", "COMPLETED"}, 240)
        slurm_cluster.wait_completed(job, 300, out)
    finally:
        slurm_cluster.cancel(job)
    text = out.read_text()
    assert "rank 0 done" in text and "rank 1 done" in text, text
    assert slurm_cluster.job(job)["Restarts"] == "1"
    assert [e["nodes"] for e in events(slurm_cluster, run_dir, "criu_refused")] == [2, 2]
    assert not events(slurm_cluster, run_dir, "criu_dump")
