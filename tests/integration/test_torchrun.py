"""2-node x 2-worker DDP jobs launched by torchrun under sbatch (template ``torchrun``):
Lightning with HpcckptCallback, and the @preemptible demo; preempted by a `high` job,
requeued once by the batch script, resumed bit-identical to an uninterrupted 4-worker run."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from conftest import SlurmCluster


# Checked without importing the trainer into the test process.
_MISSING = importlib.util.find_spec("lightning") is None
pytestmark = [pytest.mark.skipif(_MISSING, reason="the lightning extra is not installed (scripts/bootstrap installs it)"),
              pytest.mark.slurm, pytest.mark.slow]

JOB = Path(__file__).with_name("lightning_train.py")
STEPS = 24  # 4 ranks x 2 batches of 8 per epoch: 12 epochs
HOLD = 9    # mid-epoch: the first run waits in this step until the preemption reaches it


def _reference(out: Path) -> Path:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
                           str(JOB), "--dir", str(out), "--steps", str(STEPS), "--mode", "plain", "--devices", "4"],
                          env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.long(130)
def test_torchrun_two_nodes_preempted_resumes_identically(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    reference = _reference(tmp_path / "reference")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    command = (f'{JOB} --dir "$HPCCKPT_RUN_DIR" --steps {STEPS} --hold-at {HOLD} '
               "--devices 2 --num-nodes 2")
    script = slurm_cluster.render("torchrun", run_dir / "torchrun.sbatch", TIME="10:00", LEAD_S="50",
                                  RUN_DIR=str(run_dir), OUTPUT=f"{run_dir}/slurm-%j.out", COMMAND=command,
                                  JOB_NAME="hpcckpt-torchrun", NODES="2", PROCS_PER_NODE="2")
    job = slurm_cluster.sbatch(script, "-p", "low", "--exclusive",
                               "--export=ALL,OMP_NUM_THREADS=1,PYTHONWARNINGS=ignore")
    out = run_dir / f"slurm-{job}.out"
    slurm_cluster.wait_until(lambda: out.exists() and out.read_text().count(f"holding at step {HOLD}") >= 4,
                             400, f"all four workers to reach step {HOLD}")
    slurm_cluster.preempt()
    slurm_cluster.wait_completed(job, 600, out)

    assert (run_dir / "trace.jsonl").read_text() == (reference / "trace.jsonl").read_text(), \
        "loss trace differs from the uninterrupted run"
    result = json.loads((run_dir / "result.json").read_text())
    assert result == json.loads((reference / "result.json").read_text()), "final parameters differ"
    assert result["world_size"] == 4

    ledger = slurm_cluster.read_ledger(run_dir / "ckpt")
    starts = [e for e in ledger if e["event"] == "start"]
    assert [s["restart_count"] for s in starts] == [0, 1] and all(s["world_size"] == 4 for s in starts)
    stops = [e for e in ledger if e["event"] == "stop" and e["reason"] != "done"]
    assert len(stops) == 1 and stops[0]["step"] == stops[0]["committed_step"] == HOLD + 1, stops
    shard_dir = run_dir / "ckpt" / f"step-{HOLD + 1}"
    assert sorted(p.stem for p in shard_dir.glob("rank-*")) == [f"rank-{r}" for r in range(4)]
    # Global rank 0 requeued the job, confirmed by Slurm's record; the batch script's
    # `hpcckpt requeue` (if it ran before the job ended) found it done and recorded nothing.
    requeues = [e for e in ledger if e["event"] == "requeue"]
    assert len(requeues) == 1 and requeues[0]["requeued"] is True and requeues[0]["evidence"], requeues
    assert slurm_cluster.job(job)["Restarts"] == "1", "exactly one requeue for one preemption"


@pytest.mark.long(95)
def test_torchrun_preemptible_demo_two_nodes_preempted_resumes_identically(
        slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """The @preemptible path (hpcckpt.demo.train) with ranks from torchrun's environment."""
    from tests.integration.test_slurm_ddp import STEPS as DEMO_STEPS
    from tests.integration.test_slurm_ddp import local_ddp_reference

    reference = local_ddp_reference(tmp_path / "reference")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    command = (f'-m hpcckpt.demo.train --dir "$HPCCKPT_RUN_DIR" --steps {DEMO_STEPS} '
               "--every 100000 --step-sleep 0.3")
    script = slurm_cluster.render("torchrun", run_dir / "torchrun.sbatch", TIME="10:00", LEAD_S="50",
                                  RUN_DIR=str(run_dir), OUTPUT=f"{run_dir}/slurm-%j.out", COMMAND=command,
                                  JOB_NAME="hpcckpt-torchrun-demo", NODES="2", PROCS_PER_NODE="2")
    job = slurm_cluster.sbatch(script, "-p", "low", "--exclusive", "--export=ALL,OMP_NUM_THREADS=1")
    out = run_dir / f"slurm-{job}.out"
    slurm_cluster.wait_for(job, {"RUNNING"}, 240, out)
    # The demo sleeps 0.3 s a step: it is still training when the preemption reaches it.
    slurm_cluster.wait_until(lambda: slurm_cluster.trace_steps(run_dir) >= 6, 300, "6 DDP steps")
    slurm_cluster.preempt()
    slurm_cluster.wait_completed(job, 600, out)
    for proc in reference:  # type: ignore[attr-defined]
        assert proc.wait(timeout=600) == 0
    expected = json.loads((tmp_path / "reference" / "result.json").read_text())["param_digest"]
    result = json.loads((run_dir / "result.json").read_text())
    assert result["world_size"] == 4 and result["param_digest"] == expected, "torchrun demo not bit-identical"
    ledger = slurm_cluster.read_ledger(run_dir / "ckpt")
    assert [s["restart_count"] for s in ledger if s["event"] == "start"] == [0, 1]
    stops = [e for e in ledger if e["event"] == "stop" and e["reason"] != "done"]
    assert len(stops) == 1 and stops[0]["committed_step"] == stops[0]["step"], stops
    assert slurm_cluster.job(job)["Restarts"] == "1", "exactly one requeue for one preemption"
