"""Under Slurm, a timm-style script with persistent DataLoader workers ends its job COMPLETED
(issue 51, item 7). Before, hpcckpt's quieted workers ignored multiprocessing's exit-time
terminate() and the interpreter joined them for ever: the job committed its last step, then
sat until its time limit and ended TIMEOUT while ``history`` said "finished"."""
from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.unit.test_workers_exit import SCRIPT

if TYPE_CHECKING:
    from conftest import SlurmCluster

pytestmark = [pytest.mark.slurm]

REPO = Path(__file__).resolve().parents[2]
TIME_LIMIT_S = 180  # the hung job ran to it; a run takes ~10 s


def test_persistent_workers_job_ends_completed_not_at_its_time_limit(slurm_cluster: SlurmCluster,
                                                                     tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "train.py").write_text(SCRIPT)
    script = run_dir / "timm.sbatch"
    script.write_text(f"""#!/bin/bash
#SBATCH --job-name=hpcckpt-workers-exit
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=2
#SBATCH --time=0:{TIME_LIMIT_S}
#SBATCH --output={run_dir}/slurm-%j.out
export OMP_NUM_THREADS=1 PYTHONPATH={shlex.quote(str(REPO))} HPCCKPT_DIR={shlex.quote(str(run_dir / "ckpt"))}
exec {shlex.quote(sys.executable)} {shlex.quote(str(run_dir / "train.py"))} 0 0 -
""")
    job = slurm_cluster.sbatch(script, "-p", "low", "--export=ALL,HPCCKPT_CLUSTER=slurm-cli", cwd=run_dir)
    out = run_dir / f"slurm-{job}.out"
    slurm_cluster.wait_completed(job, TIME_LIMIT_S + 60, out)  # a hang ends TIMEOUT at the limit: fails here
    text = out.read_text(errors="replace")
    assert "workers at the end: 2" in text and "LAST LINE" in text, text[-3000:]
    ledger = slurm_cluster.read_ledger(run_dir / "ckpt")
    assert [(e["reason"], e["committed_step"]) for e in ledger if e["event"] == "stop"] == [("done", 64)], ledger
