"""Just-in-time checkpoints on the real cluster: 2 nodes x 2 ranks (gloo, DDP on CPU), no
periodic checkpoints. A rank killed (kill -9) or stopped (SIGSTOP) mid-step: the survivors
commit the last completed step, the writer requeues the job through the cluster adapter
(``scontrol requeue``), the next run restores the JIT checkpoint and ends bit-identical to
an uninterrupted run of the same four ranks; the ledger and ``hpcckpt history`` show it.
"""
from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from tests.helpers import built_once
from tests.unit.test_jit import TIMEOUT_S, TOTAL, WORLD, _same, run_job

if TYPE_CHECKING:
    from conftest import SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


def _script(run_dir: Path, cfg: dict[str, object], python: str) -> Path:
    script = run_dir / "jit.sbatch"
    script.write_text(f"""#!/bin/bash
#SBATCH --job-name=hpcckpt-jit
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=2
#SBATCH --cpus-per-task=1
#SBATCH --time=10:00
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output={run_dir}/slurm-%j.out
set -uo pipefail
first_node="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
MASTER_ADDR="$(scontrol show node -o "$first_node" | tr ' ' '\\n' | sed -n 's/^NodeAddr=//p')"
export MASTER_ADDR="${{MASTER_ADDR:-$first_node}}"
export MASTER_PORT="$((20000 + (SLURM_JOB_ID * 7 + ${{SLURM_RESTART_COUNT:-0}}) % 20000))"
export OMP_NUM_THREADS=1
echo "hpcckpt: job $SLURM_JOB_ID run ${{SLURM_RESTART_COUNT:-0}} on $SLURM_JOB_NODELIST"
# --kill-on-bad-exit=0: a dead rank must not make Slurm end the survivors before they save.
srun --kill-on-bad-exit=0 {shlex.quote(python)} -m tests.unit.jit_worker slurm 0 {shlex.quote(str(run_dir))} \\
    {shlex.quote(json.dumps(cfg))}
""")
    return script


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    def build(root: Path) -> None:
        codes, outs = run_job(root)
        assert codes == [0] * WORLD, "\n".join(outs)
    return built_once(tmp_path_factory, "slurm-jit-reference", build)


@pytest.mark.long(85)
@pytest.mark.parametrize(("how", "victim", "at"), [("kill", 2, 6), ("kill", 0, 4), ("stop", 3, 5)])
def test_failed_rank_jit_requeue_and_identical_resume(slurm_cluster: SlurmCluster, tmp_path: Path, reference: Path,
                                                      how: str, victim: int, at: int) -> None:
    import sys
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = {"world": WORLD, "total": TOTAL, "timeout": TIMEOUT_S, "every": None, "how": how, "victim": victim,
           "at": at}
    job = slurm_cluster.sbatch(_script(run_dir, cfg, sys.executable), "-p", "low", "--exclusive",
                               "--export=ALL,HPCCKPT_CLUSTER=slurm-cli", cwd=REPO)
    out = run_dir / f"slurm-{job}.out"
    slurm_cluster.wait_completed(job, 600, out)
    text = out.read_text(errors="replace")
    assert int(slurm_cluster.job(job).get("Restarts", "0")) == 1, text[-4000:]
    ledger = slurm_cluster.read_ledger(run_dir / "ckpt")
    failure = [e for e in ledger if e["event"] == "rank_failure"]
    assert len(failure) == 1 and failure[0]["failed_ranks"] == [victim], text[-4000:]
    assert failure[0]["jit_step"] == at and failure[0]["lost_step"] == at + 1
    commits = [e for e in ledger if e["event"] == "commit"]
    # the survivors' JIT checkpoint, then the finished run's own checkpoint of its end state
    assert [(c["step"], c.get("jit")) for c in commits] == [(at, True), (TOTAL, None)], commits
    requeue = [e for e in ledger if e["event"] == "requeue" and e.get("requeued")]
    assert requeue and requeue[-1]["cause"] == "rank_failure", requeue
    starts = [e for e in ledger if e["event"] == "start"]
    assert [s["resumed_from"] for s in starts] == [None, at], starts
    for r in range(WORLD):
        assert json.loads((run_dir / f"result-{r}.json").read_text())["resumed"] == at
        got = torch.load(run_dir / f"final-{r}.pt", weights_only=True)
        assert _same(got, torch.load(reference / f"final-{r}.pt", weights_only=True)), f"rank {r} differs"
    history = slurm_cluster.history(run_dir / "ckpt")
    assert len(history["rows"]) == 1 and history["rows"][0]["committed_step"] == at, history
    row = history["rows"][0]
    assert row["resumed_step"] == at and row["cause"] == "rank_failure", history
    assert row["failed_ranks"] == [victim] and row["lost_steps"] == 1, history  # the step in flight
