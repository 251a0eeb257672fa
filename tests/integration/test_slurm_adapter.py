"""The Slurm adapter's verbs against the real cluster: end time (re-read after it moves),
MAINT reservations overlapping the job, drain detection; and the prolog/epilog as
slurmd runs them, with a hostile job name and working directory."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from hpcckpt.cluster.env import JobEnv
from hpcckpt.cluster.scontrol import SlurmCli, parse_slurm_time

if TYPE_CHECKING:
    from conftest import SlurmCluster

pytestmark = [pytest.mark.slurm]


@pytest.fixture
def sleeper(slurm_cluster: SlurmCluster, tmp_path: Path) -> Iterator[str]:
    script = tmp_path / "sleep.sbatch"
    script.write_text("#!/bin/bash\nsleep 300\n")
    job = slurm_cluster.sbatch(script, "-w", "n1", "--time=5", "-o", "/dev/null")
    slurm_cluster.wait_for(job, {"RUNNING"}, 60)
    yield job
    slurm_cluster.cancel(job)


def _cli(job: str) -> SlurmCli:
    return SlurmCli(JobEnv(environ={"SLURM_JOB_ID": job, "SLURMD_NODENAME": "n1", "SLURM_JOB_NODELIST": "n1"}))


def test_end_time_is_reread_when_slurm_moves_it(slurm_cluster: SlurmCluster, sleeper: str) -> None:
    cli = _cli(sleeper)
    start = parse_slurm_time(slurm_cluster.job(sleeper)["StartTime"])
    assert start is not None and cli.end_time() == start + 300
    slurm_cluster.run(["scontrol", "update", f"JobId={sleeper}", "TimeLimit=3"])
    assert cli.end_time() == start + 180


def test_maintenance_reservation_overlapping_the_job(slurm_cluster: SlurmCluster, sleeper: str) -> None:
    names = ["hpcckpt test maint n1", "hpcckpt-test-maint-n2"]
    try:
        for name, node in zip(names, ("n1", "n2")):
            slurm_cluster.run(["scontrol", "create", "reservation", f"ReservationName={name}",
                               "StartTime=now+120", "Duration=10", f"Nodes={node}", "Users=root",
                               "Flags=MAINT,IGNORE_JOBS"])
        found = _cli(sleeper).reservations()
        assert [r.name for r in found] == [names[0]]
        assert found[0].start_s == pytest.approx(time.time() + 120, abs=15)
    finally:
        for name in names:
            slurm_cluster.run(["scontrol", "delete", f"ReservationName={name}"], check=False)


def test_drained_node_is_noticed(slurm_cluster: SlurmCluster, sleeper: str) -> None:
    cli = _cli(sleeper)
    assert not cli.node_draining()
    try:
        slurm_cluster.run(["scontrol", "update", "NodeName=n1", "State=DRAIN", "Reason=hpcckpt test"])
        assert cli.node_draining() and "DRAIN" in cli.node_state()
    finally:
        slurm_cluster.run(["scontrol", "update", "NodeName=n1", "State=RESUME"], check=False)


def test_prolog_and_epilog_under_slurmd_with_hostile_names(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    name = 'evil "name"; rm -rf / $(touch pwned)'
    workdir = tmp_path / "we ird;\"dir'"
    workdir.mkdir()
    script = workdir / "job.sbatch"
    script.write_text('#!/bin/bash\nls -d "$HPCCKPT_STAGE"/job-"$SLURM_JOB_ID" > staged.txt\n')
    stage_root = slurm_cluster.state_dir / "staging" / "n2"
    job = slurm_cluster.sbatch(script, "-w", "n2", "-J", name, "-o", str(workdir / "out"),
                               f"--export=ALL,HPCCKPT_STAGE={stage_root}", cwd=workdir)
    slurm_cluster.wait_completed(job, 60)
    assert (workdir / "staged.txt").read_text().strip() == str(stage_root / f"job-{job}")
    slurm_cluster.wait_until(lambda: not (stage_root / f"job-{job}").exists(), 30, "epilog cleanup")
    records = [json.loads(line) for line in (stage_root / "hooks.jsonl").read_text().splitlines()]
    mine = [r for r in records if r["job_id"] == job]
    assert [r["event"] for r in mine] == ["prolog", "epilog"]
    assert all(r["job_name"] == name and r["work_dir"] == str(workdir) for r in mine)
    assert not list(tmp_path.rglob("pwned"))
