"""CRIU mode under real Slurm preemption and time limits, with the rendered template.

An unmodified training script (criu_train.py knows nothing of hpcckpt) runs through
``hpcckpt template criu`` in the local cluster's ``criu`` partition (PreemptMode=REQUEUE,
GraceTime). A ``high`` job preempts it twice, then it meets its one-minute time limit,
and it must finish bit-identical to an uninterrupted run, each restart restoring the
image taken at that very stop, with three interruptions and nothing lost in the ledger.
At a preemption Slurm first pulls the end time in (the supervisor reads it and dumps),
then sends TERM to every process of the job: the job's own processes ignore it, so
whichever comes first, the supervisor decides.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from .test_criu_local import criu_ok  # noqa: F401  (fixture)

if TYPE_CHECKING:
    from conftest import SlurmCluster

pytestmark = [pytest.mark.criu, pytest.mark.slurm, pytest.mark.slow]

STEPS = 400  # more than runs 0-2 can train (~60 s of 5 steps/s at most, plus the preempted runs)
SLEEP_S = "0.2"  # sleep-bound, so Slurm's clocks, not this machine's load, set the pace

PLAIN_TRAIN = '''"""A plain PyTorch training script that knows nothing of hpcckpt (a small MLP, dropout,
AdamW, shuffled batches); one line per step, a JSON summary (losses + digest) at the end."""
import hashlib, json, sys, time
import torch

steps, out, sleep_s = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
torch.manual_seed(0)
x, y = torch.randn(512, 16), torch.randn(512, 1)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
losses = []
for step in range(1, steps + 1):
    idx = torch.randint(0, 512, (32,))
    loss = torch.nn.functional.mse_loss(model(x[idx]), y[idx])
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
    print(f"step {step} loss {loss.item():.6f}", flush=True)
    time.sleep(sleep_s)
digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
json.dump({"losses": losses, "digest": digest}, open(out, "w"))
print(f"done {steps}", flush=True)
'''


@pytest.fixture(scope="module")
def train(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("script") / "plain_train.py"
    path.write_text(PLAIN_TRAIN)
    return path


def ensure_partition(cluster: SlurmCluster, name: str, grace_s: int) -> None:
    """slurm/localcluster defines it; a cluster started by an older checkout gets it now."""
    if "PartitionName=" in cluster.run(["scontrol", "show", "partition", name], check=False):
        return
    cluster.run(["scontrol", "create", f"PartitionName={name}", "Nodes=ALL", "PriorityTier=1",
                 "PreemptMode=REQUEUE", f"GraceTime={grace_s}", "State=UP"])


@pytest.fixture(scope="module")
def reference(train: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("ref") / "ref.json"
    subprocess.run([sys.executable, str(train), str(STEPS), str(out), "0"], check=True,
                   stdout=subprocess.DEVNULL, timeout=600)
    return json.loads(out.read_text())


def submit(cluster: SlurmCluster, train: Path, run_dir: Path, out: Path, partition: str,
           **params: str) -> tuple[str, Path]:
    run_dir.mkdir(parents=True, exist_ok=True)
    params = {"TIME": "1", "LEAD_S": "10", **params}
    script = cluster.render("criu", run_dir / "criu.sbatch", RUN_DIR=str(run_dir), OUTPUT=f"{run_dir}/slurm-%j.out",
                            **params)
    job = cluster.run(["sbatch", "--parsable", "-p", partition, str(script), sys.executable, str(train),
                       str(STEPS), str(out), SLEEP_S]).strip().split(";")[0]
    return job, run_dir / f"slurm-{job}.out"


def last_step(run_dir: Path, job: str, run: int) -> int:
    steps = [int(m) for p in (run_dir / "criu" / "stdio").glob(f"{job}-r{run}-*.out")
             for m in re.findall(r"^step (\d+) ", p.read_text(), re.M)]
    return max(steps, default=0)


def events(cluster: SlurmCluster, run_dir: Path, name: str) -> list[dict]:
    return [e for e in cluster.read_ledger(run_dir) if e["event"] == name]


def preempt_at(cluster: SlurmCluster, job: str, run_dir: Path, run: int, *, steps_in_run: int) -> None:
    """Once run ``run`` has trained ``steps_in_run`` steps of its own, a `high` job takes both nodes."""
    first: list[int] = []

    def going() -> bool:
        now = last_step(run_dir, job, run)
        if now and not first:
            first.append(now)
        return bool(first) and now >= first[0] + steps_in_run

    cluster.wait_until(going, 240, f"job {job} run {run} training")
    cluster.preempt(seconds=2)
    cluster.wait_until(lambda: len(events(cluster, run_dir, "criu_dump")) > run, 120, f"dump of run {run}")


@pytest.mark.long(150)
def test_preempted_twice_and_timed_out_resumes_each_time_from_that_stop(
        slurm_cluster: SlurmCluster, criu_ok: None, train: Path, reference: dict,  # noqa: F811
        tmp_path: Path) -> None:
    ensure_partition(slurm_cluster, "criu", 10)
    run_dir, out = tmp_path / "run", tmp_path / "result.json"
    job, slurm_out = submit(slurm_cluster, train, run_dir, out, "criu")
    try:
        preempt_at(slurm_cluster, job, run_dir, 0, steps_in_run=5)
        preempt_at(slurm_cluster, job, run_dir, 1, steps_in_run=5)
        # Run 2 meets its one-minute limit (USR2 ten seconds before, or TERM at it); the last
        # run then gets the time it needs to finish.
        slurm_cluster.wait_until(lambda: len(events(slurm_cluster, run_dir, "criu_dump")) > 2, 200,
                                 f"the time-limit dump of job {job}")
        slurm_cluster.run(["scontrol", "update", f"JobId={job}", "TimeLimit=5"])
        slurm_cluster.wait_completed(job, 300, slurm_out)
    finally:
        slurm_cluster.cancel(job)
    text = slurm_out.read_text()
    result = json.loads(out.read_text())
    assert result["digest"] == reference["digest"], text[-3000:]
    assert result["losses"] == reference["losses"]
    assert slurm_cluster.job(job)["Restarts"] == "3"

    dumps, restores = events(slurm_cluster, run_dir, "criu_dump"), events(slurm_cluster, run_dir, "criu_restore")
    assert [d["restart_count"] for d in dumps] == [0, 1, 2]
    assert [r["image"] for r in restores] == [d["image"] for d in dumps]  # each restart: that stop's image
    stops = events(slurm_cluster, run_dir, "stop")
    assert [s["reason"] for s in stops] == ["preemption", "preemption", "time_limit", "done"], stops
    assert [r["lost_s"] for r in restores] == [0.0, 0.0, 0.0] and all(r["lost_exact"] for r in restores)
    history = slurm_cluster.history(run_dir)
    assert history["interruptions"] == 3 and history["finished"] is True, history
    assert history["lost_s_total"] == 0.0 and history["lost_steps_unknown"] == 0, history
    assert [r["cause"] for r in history["rows"]] == ["preemption", "preemption", "time_limit"], history["rows"]
    # The job's own output reached the Slurm output file too, not only criu/stdio.
    assert f"done {STEPS}" in text and "step 1 " in text


@pytest.mark.long(120)
def test_preemption_without_grace_loses_at_most_one_dump_interval(
        slurm_cluster: SlurmCluster, criu_ok: None, train: Path, reference: dict,  # noqa: F811
        tmp_path: Path) -> None:
    """GraceTime=0: Slurm requeues at once, TERM then KILL KillWait (5 s here) later. The job
    also takes an image every 5 s; whether the dump at TERM fits KillWait or not, the next
    run resumes from an image at most one interval old, and the ledger says how much."""
    ensure_partition(slurm_cluster, "criu0", 0)
    run_dir, out = tmp_path / "run", tmp_path / "result.json"
    job, slurm_out = submit(slurm_cluster, train, run_dir, out, "criu0", TIME="5", DUMP_EVERY_S="5")
    try:
        slurm_cluster.wait_until(lambda: len(events(slurm_cluster, run_dir, "criu_dump")) >= 1, 120,
                                 f"a periodic image of job {job}")
        slurm_cluster.preempt(seconds=2)
        slurm_cluster.wait_until(lambda: len(events(slurm_cluster, run_dir, "criu_restore")) >= 1, 120,
                                 f"the restore of job {job}")
        slurm_cluster.wait_completed(job, 300, slurm_out)
    finally:
        slurm_cluster.cancel(job)
    result = json.loads(out.read_text())
    assert result["digest"] == reference["digest"] and result["losses"] == reference["losses"]
    [restore] = events(slurm_cluster, run_dir, "criu_restore")
    # Dumped at TERM (nothing lost, exactly), or killed first: at most one interval, said so.
    assert (restore["lost_exact"] and restore["lost_s"] == 0.0) or restore.get("lost_at_most_s") == 5.0, restore
    history = slurm_cluster.history(run_dir)
    assert history["interruptions"] == 1
    # history says how much that interruption lost, as the restore measured it
    [row] = history["rows"]
    assert (row["lost_s"], row["lost_exact"], row["lost_at_most_s"]) == (
        restore.get("lost_s"), restore.get("lost_exact"), restore.get("lost_at_most_s")), row
