"""A stop that reaches a job after its training loop, while the script evaluates the trained
model (no step boundary there): the job is requeued, the next allocation resumes at the final
checkpoint, trains nothing, runs the evaluation to its end and exits 0; the ledger and
`hpcckpt history` say so. Before, the TERM killed the evaluation (status 143, FAILED) with
the ledger saying the run had finished."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from conftest import SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

STEPS = 20
SCRIPT = Path(__file__).with_name("after_run_train.py")


def test_term_during_the_evaluation_after_training_requeues_and_the_next_run_ends_it(
        slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    command = f'{sys.executable} {SCRIPT} --dir "$HPCCKPT_RUN_DIR" --steps {STEPS} --eval-sleep 600'
    script = slurm_cluster.render("single", run_dir / "after.sbatch", TIME="15:00", LEAD_S="50",
                                  RUN_DIR=str(run_dir), OUTPUT=f"{run_dir}/slurm-%j.out", COMMAND=command,
                                  JOB_NAME="hpcckpt-after-run")
    job = slurm_cluster.sbatch(script)
    out = run_dir / f"slurm-{job}.out"
    slurm_cluster.wait_until(lambda: (run_dir / "eval-started-0").exists(), 180, "the first evaluation")
    slurm_cluster.run(["scancel", "--signal=TERM", "--batch", job])  # forwarded to the script

    slurm_cluster.wait_completed(job, 300, out)
    assert json.loads((run_dir / "eval.json").read_text())["restart"] == 1  # the next allocation ended it
    ledger = slurm_cluster.read_ledger(run_dir / "ckpt")
    starts = [e for e in ledger if e["event"] == "start"]
    assert [(s["restart_count"], s["resumed_from"]) for s in starts] == [(0, None), (1, STEPS)], ledger
    stops = [(e["reason"], e.get("signame")) for e in ledger if e["event"] == "stop"]
    assert stops == [("done", None), ("after_run", "SIGTERM"), ("done", None)], ledger
    [requeue] = [e for e in ledger if e["event"] == "requeue"]
    assert requeue["requeued"] is True and requeue["method"] == "scontrol" and requeue["evidence"], requeue
    assert [e["event"] for e in ledger].count("nothing_left") == 1
    history = slurm_cluster.history(run_dir / "ckpt")
    assert history["finished"] and history["lost_steps_total"] == 0, history
    # TERM from scancel is what a GraceTime preemption sends: history charges it there, as in a loop
    assert [(r["cause"], r["requeued"]) for r in history["rows"]] == [("preemption", True)], history["rows"]
