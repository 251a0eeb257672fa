"""2 nodes x 2 ranks DDP (gloo) under srun on the real cluster, concurrent engine (the sync
engine's striped DDP checkpoint on Slurm is checked by test_slurm_elastic.py):
signalled through the batch shell, then preempted; the ranks write the replicated
parameters and optimizer state once, striped over them (bytes written per checkpoint
/ state bytes ~ 1.0, where every rank writing its own copy made it 4.0), the batch
script requeues after srun returns, and the run ends bit-identical to an
uninterrupted 4-rank run."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from hpcckpt.store import catalog
from hpcckpt.store import shared as shared_table

if TYPE_CHECKING:
    from conftest import SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

STEPS = 40
WORLD = 4


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def local_ddp_reference(out: Path) -> subprocess.Popen[bytes]:
    """The same 4-rank training without hpcckpt and without interruption, as local processes."""
    port = str(_free_port())
    procs = []
    for rank in range(WORLD):
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}
        env.update(WORLD_SIZE=str(WORLD), RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                   OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, "-m", "hpcckpt.demo.train", "--dir", str(out),
                                       "--steps", str(STEPS), "--no-checkpoint"], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return procs  # type: ignore[return-value]


def _wait_progress(cluster: SlurmCluster, job: str, run_dir: Path, steps: int) -> None:
    cluster.wait_for(job, {"RUNNING"}, 240, run_dir / f"slurm-{job}.out")
    base = cluster.trace_steps(run_dir)
    cluster.wait_until(lambda: cluster.trace_steps(run_dir) >= base + steps, 180,
                       f"{steps} more DDP steps")


@pytest.mark.long(115)
def test_two_node_ddp_signalled_and_preempted_resumes_identically(
        slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    engine = "concurrent"
    reference = local_ddp_reference(tmp_path / "reference")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    script = slurm_cluster.render_demo("ddp", run_dir, steps=STEPS, sleep_s=0.3, NODES="2",
                                       TASKS_PER_NODE="2", CPUS_PER_TASK="1")
    job = slurm_cluster.sbatch(script, "-p", "low", "--exclusive",
                               f"--export=ALL,OMP_NUM_THREADS=1,HPCCKPT_ENGINE={engine}")
    out = run_dir / f"slurm-{job}.out"

    _wait_progress(slurm_cluster, job, run_dir, 6)
    slurm_cluster.run(["scancel", "--signal=USR2", "--batch", job])  # reaches only the batch shell
    slurm_cluster.wait_until(lambda: int(slurm_cluster.job(job).get("Restarts", "0")) >= 1, 180,
                             "the first requeue")
    _wait_progress(slurm_cluster, job, run_dir, 6)
    slurm_cluster.preempt()
    slurm_cluster.wait_completed(job, 600, out)

    for proc in reference:  # type: ignore[attr-defined]
        assert proc.wait(timeout=600) == 0
    expected = json.loads((tmp_path / "reference" / "result.json").read_text())["param_digest"]
    result = json.loads((run_dir / "result.json").read_text())
    assert result["world_size"] == WORLD
    assert result["param_digest"] == expected, "DDP run resumed twice is not bit-identical"

    ledger = slurm_cluster.read_ledger(run_dir / "ckpt")
    starts = [e for e in ledger if e["event"] == "start"]
    assert [s["restart_count"] for s in starts] == [0, 1, 2]
    assert all(s["world_size"] == WORLD for s in starts)
    stops = [e for e in ledger if e["event"] == "stop" and e["reason"] != "done"]
    assert len(stops) == 2 and all(s["committed_step"] == s["step"] for s in stops)
    # Rank 0 requeues once every rank's part is committed, confirmed by Slurm's record; the batch
    # script's `hpcckpt requeue` then finds it done and records nothing more.
    requeues = [e for e in ledger if e["event"] == "requeue"]
    assert len(requeues) == 2 and all(r["requeued"] is True and r["evidence"] for r in requeues), requeues
    checked = 0
    for stop in stops:
        shard_dir = run_dir / "ckpt" / f"step-{stop['step']}"
        if shard_dir.exists():  # retention may have pruned older ones
            # Every rank persisted its part (rank-<r>.h5 or .pt, by engine).
            assert sorted(p.stem for p in shard_dir.glob("rank-*")) == [f"rank-{r}" for r in range(WORLD)]
            manifest = catalog.find(run_dir / "ckpt", stop["step"]).manifest
            assert manifest is not None and manifest["engine"] == engine and manifest["format"] == "hpcckpt/4"
            written, state = shared_table.written_bytes(manifest), shared_table.state_bytes(manifest)
            # Only the ranks' own RNG states are written more than once (under 2% of this model).
            assert 1.0 <= sum(written.values()) / state < 1.05, (written, state)
            shared = manifest["shared"]
            assert any(n.startswith("objects/optimizer/state/") for n in shared), sorted(shared)[:5]
            assert {p["rank"] for s in shared.values() for p in s["pieces"]} == set(range(WORLD))
            assert max(written.values()) < 0.4 * state  # each rank wrote about a quarter
            checked += 1
    assert checked
    history = slurm_cluster.history(run_dir / "ckpt")
    assert history["lost_steps_total"] == 0
    assert [r["cause"] for r in history["rows"]] == ["signal", "preemption"], history["rows"]
    assert "hpcckpt: batch shell got USR2" in out.read_text()
