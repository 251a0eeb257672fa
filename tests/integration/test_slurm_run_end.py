"""The end of a run under real Slurm (issue 55, item 3): a loop that breaks at max_steps mid-epoch
commits step-<max_steps>; a TERM during the 20-s export after the loop requeues the job, and the next
allocation runs the last epoch's evaluation again (the export uses its `perplexity`) and the export:
the job ends COMPLETED with the export byte-identical to an uninterrupted run's. Before, the final
checkpoint was step-(max_steps - 1) and the re-run failed with UnboundLocalError: perplexity."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from conftest import SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

MAX_STEPS = 12
SCRIPT = Path(__file__).with_name("run_end_train.py")
REPO = Path(__file__).resolve().parents[2]


def test_term_during_the_export_after_a_break_at_max_steps_completes_with_the_same_export(
        slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    ref = tmp_path / "ref"
    ref.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HPCCKPT_", "SLURM_"))}
    env["PYTHONPATH"] = str(REPO)
    subprocess.run([sys.executable, str(SCRIPT), "--dir", str(ref), "--max-steps", str(MAX_STEPS)], env=env,
                   check=True, timeout=300)

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    command = f'{sys.executable} {SCRIPT} --dir "$HPCCKPT_RUN_DIR" --max-steps {MAX_STEPS} --export-sleep 20'
    script = slurm_cluster.render("single", run_dir / "run_end.sbatch", TIME="15:00", LEAD_S="50",
                                  RUN_DIR=str(run_dir), OUTPUT=f"{run_dir}/slurm-%j.out", COMMAND=command,
                                  JOB_NAME="hpcckpt-run-end")
    job = slurm_cluster.sbatch(script)
    out = run_dir / f"slurm-{job}.out"
    slurm_cluster.wait_until(lambda: (run_dir / "export-started-0").exists(), 180, "the first export")
    slurm_cluster.run(["scancel", "--signal=TERM", "--batch", job])  # forwarded to the script

    slurm_cluster.wait_completed(job, 300, out)
    results = json.loads((run_dir / "results.json").read_text())
    assert results["restart"] == 1 and results["step"] == MAX_STEPS, results  # the next allocation exported
    assert results["perplexity"] == json.loads((ref / "results.json").read_text())["perplexity"]
    assert (run_dir / "model.pt").read_bytes() == (ref / "model.pt").read_bytes()
    ledger = slurm_cluster.read_ledger(run_dir / "ckpt")
    commits = sorted({e["step"] for e in ledger if e["event"] == "commit"})
    assert commits[-1] == MAX_STEPS, commits
    stops = [(e["reason"], e.get("step")) for e in ledger if e["event"] == "stop"]
    assert stops == [("done", MAX_STEPS), ("after_run", MAX_STEPS), ("done", MAX_STEPS)], ledger
    history = slurm_cluster.history(run_dir / "ckpt")
    assert history["finished"] and history["lost_steps_total"] == 0, history
