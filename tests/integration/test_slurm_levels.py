"""Multi-level checkpoints on the real local Slurm cluster: 2 nodes x 2 ranks (gloo on CPU)
under the ``torchrun`` template with MAX_RESTARTS=2 (torchrun --max-restarts, c10d
rendezvous), node-local + partner every step, the shared level every 10 steps.

One rank is killed with SIGKILL and its node's node-local directory deleted mid-run: the
workers restart in the same allocation (no requeue) and restore from the partner copy at the
last completed step; later the job is preempted, requeued, and resumes from the shared level
(the prolog-made node-local directories went with the allocation). The trained items and the
final state equal an uninterrupted run's.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from hpcckpt.store import catalog
from tests.integration.conftest import PYTHON, REPO
from tests.unit.test_distributed_state import BATCH, ITEMS, assert_equal_states, run_world

if TYPE_CHECKING:
    from conftest import SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

WORKER = REPO / "tests" / "unit" / "dist_worker.py"
TOTAL, KILL_AT, PREEMPT_AT = 60, 25, 42


def _last_step(run_dir: Path, rank: int = 0) -> int:
    path = run_dir / f"items-run0-r{rank}.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return json.loads(lines[-1])["step"] if lines else -1


def _trained(run_dir: Path, world: int) -> dict[tuple[int, int], tuple[list[int], float]]:
    """(rank, step) -> (items, loss), the last time each step was trained (a restart retrains
    the steps after the checkpoint it restored)."""
    out: dict[tuple[int, int], tuple[list[int], float]] = {}
    for phase in ("run0", "run1"):
        for r in range(world):
            path = run_dir / f"items-{phase}-r{r}.jsonl"
            for line in path.read_text().splitlines() if path.exists() else []:
                row = json.loads(line)
                out[(r, row["step"])] = (row["items"], row["loss"])
    return out


def _check_goodput(cluster: SlurmCluster, ckpt: Path, *, runs: int) -> None:
    """`hpcckpt history --goodput --json`: one row per run, buckets that add up to the wall time."""
    proc = cluster.hpcckpt("history", str(ckpt), "--goodput", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["allocations"] == runs and len(doc["rows"]) == runs, doc
    buckets = doc["buckets"]
    assert {"productive_training", "checkpoint_save", "checkpoint_restore", "wasted_progress",
            "requeue_and_queue_wait", "program_startup"} <= set(buckets), buckets
    assert all(v >= 0 for v in buckets.values()) and buckets["productive_training"] > 0, buckets
    assert abs(sum(buckets.values()) - doc["wall_s"]) < 1e-3 * max(1.0, doc["wall_s"]), doc


def _reference(out: Path) -> dict[tuple[int, int], tuple[list[int], float]]:
    rows = [(r, json.loads(line)) for r in range(4)
            for line in (out / f"items-reference-r{r}.jsonl").read_text().splitlines()]
    return {(r, row["step"]): (row["items"], row["loss"]) for r, row in rows}


def _submit(cluster: SlurmCluster, tmp_path: Path, template: str, total: int, worker_args: str, *,
            launcher: str, **params: str) -> tuple[Path, Path, str, Path]:
    """An uninterrupted 4-rank reference run, then the same training under ``template`` on 2 nodes x
    2 ranks, node-local + partner every step, shared every 10: (reference, run dir, job, output)."""
    reference = tmp_path / "reference"
    run_world(reference, 4, "--phase", "reference", "--total", str(total))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    command = (f"{launcher}{WORKER} --out \"$HPCCKPT_RUN_DIR\" --ckpt \"$HPCCKPT_DIR\" --phase run --mode ddp "
               f"--engine sync --items {ITEMS} --batch {BATCH} --total {total} --every 10 --local-every 1 "
               f"{worker_args}")
    script = cluster.render(template, run_dir / f"{template}.sbatch", TIME="10:00", LEAD_S="50", RUN_DIR=str(run_dir),
                            OUTPUT=f"{run_dir}/slurm-%j.out", COMMAND=command, NODES="2", **params)
    job = cluster.sbatch(script, "-p", "low", "--exclusive",
                         f"--export=ALL,OMP_NUM_THREADS=1,PYTHONWARNINGS=ignore,PYTHONPATH={REPO}")
    return reference, run_dir, job, run_dir / f"slurm-{job}.out"


def _assert_like_reference(run_dir: Path, reference: Path) -> None:
    assert _trained(run_dir, 4) == _reference(reference), "data order or loss trace differs from the uninterrupted run"
    for r in range(4):
        assert_equal_states(torch.load(run_dir / f"state-end-r{r}.pt"), torch.load(reference / f"state-end-r{r}.pt"),
                            f"rank {r} final state")


@pytest.mark.long(120)
def test_rank_killed_restarts_in_the_allocation_from_the_partner_copy_then_preempted_resumes_from_shared(
        slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    reference, run_dir, job, out = _submit(slurm_cluster, tmp_path, "torchrun", TOTAL, "--step-sleep 0.3",
                                           launcher="", JOB_NAME="hpcckpt-levels", PROCS_PER_NODE="2",
                                           MAX_RESTARTS="2")
    slurm_cluster.wait_until(lambda: _last_step(run_dir) >= KILL_AT, 400, f"step {KILL_AT}")

    # Rank 2 dies (SIGKILL) and its node loses its node-local storage.
    victim = json.loads((run_dir / "pid-r2.json").read_text())
    killed_at = _last_step(run_dir, 2)
    os.kill(victim["pid"], signal.SIGKILL)
    levels = slurm_cluster.state_dir / "staging" / victim["node"] / f"job-{job}" / "levels"
    assert levels.is_dir(), f"no node-local level at {levels}"
    shutil.rmtree(levels)

    slurm_cluster.wait_until(lambda: _last_step(run_dir) >= PREEMPT_AT, 400, f"step {PREEMPT_AT} after the restart")
    assert slurm_cluster.job(job).get("Restarts") == "0", "the rank's death must not requeue the job"
    slurm_cluster.preempt()
    slurm_cluster.wait_completed(job, 600, out)

    ledger = slurm_cluster.read_ledger(run_dir / "ckpt")
    starts = [(e["restart_count"], e["resumed_from"], e.get("level")) for e in ledger if e["event"] == "start"]
    assert len(starts) == 3, starts
    assert starts[0] == (0, None, None)
    restart, resumed, level = starts[1]
    assert (restart, level) == (0, "partner"), starts  # inside the allocation, from the partner copy
    assert killed_at - 1 <= resumed <= killed_at + 1, (killed_at, starts)  # at most one step lost
    stops = [e for e in ledger if e["event"] == "stop" and e["reason"] != "done"]
    assert len(stops) == 1 and stops[0]["committed_step"] == stops[0]["step"], stops
    assert starts[2] == (1, stops[0]["step"], "shared"), starts  # the next allocation: the shared level
    assert slurm_cluster.job(job)["Restarts"] == "1"
    _check_goodput(slurm_cluster, run_dir / "ckpt", runs=3)
    _assert_like_reference(run_dir, reference)


@pytest.mark.long(75)
def test_killed_without_grace_the_epilog_scavenges_the_node_local_step_and_the_next_allocation_resumes_it(
        slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """The ranks ignore TERM as a stop signal (HPCCKPT_SIGNALS=SIGUSR2), so the requeue kills
    them with no final checkpoint while the shared level (every 10 steps) is 7 steps behind
    the node-local one (every step). Both nodes' epilogs scavenge: the node-local step 27
    reaches the shared level, and the next allocation resumes there."""
    hold, total = 27, 40
    reference, run_dir, job, out = _submit(slurm_cluster, tmp_path, "ddp", total,
                                           f"--hold-at {hold} --hold-first-run-only",
                                           launcher=f"env HPCCKPT_SIGNALS=SIGUSR2 {PYTHON} ",
                                           JOB_NAME="hpcckpt-scavenge", TASKS_PER_NODE="2", CPUS_PER_TASK="1")
    # Held, not just past step hold - 1: the node-local checkpoint before the held step has
    # returned from its save on every rank (both nodes' leaders committed it) only then.
    slurm_cluster.wait_until(lambda: all((run_dir / f"holding-run0-r{r}").exists() for r in range(4)), 400,
                             f"every rank to hold at step {hold}")
    assert all(_last_step(run_dir, r) == hold - 1 for r in range(4))
    assert [i.step for i in catalog.committed_newest_first(run_dir / "ckpt")][0] == 20
    slurm_cluster.run(["scontrol", "requeue", job])  # TERM: the ranks die at once, no final checkpoint
    slurm_cluster.wait_completed(job, 600, out)

    ledger = slurm_cluster.read_ledger(run_dir / "ckpt")
    starts = [(e["restart_count"], e["resumed_from"], e.get("level")) for e in ledger if e["event"] == "start"]
    assert starts == [(0, None, None), (1, hold, "shared")], starts
    assert not [e for e in ledger if e["event"] == "stop" and e["reason"] != "done"], "a stop was not expected"
    _assert_like_reference(run_dir, reference)
