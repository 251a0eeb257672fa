"""Elastic resume on the real local Slurm cluster: a 2 nodes x 2 ranks DDP job (gloo) is
preempted; its final checkpoint (format hpcckpt/2, the replicated state written once)
is resumed by a new submission on 1 node x 2 ranks. The restored parameters and
optimizer state equal the saved ones exactly, every item of the interrupted epoch is
trained on exactly once across the two jobs, and training goes on.

The ranks run tests/unit/dist_worker.py under the ``ddp`` template (srun, the batch
script requeues after the ranks exit 75). The requeued run of the first job ends at
once (``--only-first-run``): the second world is the new submission.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch

from hpcckpt.store import catalog

if TYPE_CHECKING:
    from conftest import SlurmCluster

from tests.integration.conftest import PYTHON, REPO

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

ITEMS, BATCH = 960, 4  # 60 steps per epoch on 4 ranks, 120 on 2
WORKER = REPO / "tests" / "unit" / "dist_worker.py"


def _command(*args: str) -> str:
    return (f'{PYTHON} {WORKER} --out "$HPCCKPT_RUN_DIR" --ckpt "$HPCCKPT_DIR" --mode ddp --engine sync '
            f"--items {ITEMS} --batch {BATCH} " + " ".join(args))


def _render(cluster: SlurmCluster, run_dir: Path, name: str, nodes: int, command: str) -> Path:
    return cluster.render("ddp", run_dir / f"{name}.sbatch", TIME="10:00", LEAD_S="50", RUN_DIR=str(run_dir),
                          OUTPUT=f"{run_dir}/slurm-%j.out", COMMAND=command, JOB_NAME=f"hpcckpt-elastic-{name}",
                          NODES=str(nodes), TASKS_PER_NODE="2", CPUS_PER_TASK="1")


def _rows(run_dir: Path, phase: str, world: int) -> list[dict[str, Any]]:
    return [json.loads(line) for r in range(world)
            for line in (run_dir / f"items-{phase}-r{r}.jsonl").read_text().splitlines()]


def _steps_done(run_dir: Path) -> int:
    path = run_dir / "items-save-r0.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_ddp_preempted_on_two_nodes_resumes_on_one_node(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    first = _render(slurm_cluster, run_dir, "wide", 2,
                    _command("--phase", "save", "--stop-at", "100000", "--step-sleep", "0.3", "--only-first-run"))
    job = slurm_cluster.sbatch(first, "-p", "low", "--exclusive", "--export=ALL,OMP_NUM_THREADS=1")
    out = run_dir / f"slurm-{job}.out"
    slurm_cluster.wait_for(job, {"RUNNING"}, 240, out)
    slurm_cluster.wait_until(lambda: _steps_done(run_dir) >= 8, 240, "8 DDP steps on 4 ranks")
    slurm_cluster.preempt()
    assert slurm_cluster.wait_done(job, 600, out) == "COMPLETED", out.read_text()[-3000:]

    saved = [json.loads((run_dir / f"result-save-r{r}.json").read_text()) for r in range(4)]
    k = saved[0]["requeue_step"]
    assert {s["requeue_step"] for s in saved} == {k} and {s["committed_step"] for s in saved} == {k}, saved
    assert k >= 8, f"the job stopped at step {k}, before the preemption"
    info = catalog.find(run_dir / "ckpt", None)
    assert info.step == k and info.manifest is not None
    m = info.manifest
    assert m["format"] == "hpcckpt/2" and m["world_size"] == 4, (m["format"], m["world_size"])
    written = sum(int(e["nbytes"]) for rec in m["ranks"].values() for e in rec["tensors"].values())
    shared = sum(int(p["nbytes"]) for t in m["shared"].values() for p in t["pieces"])
    local0 = sum(int(e["nbytes"]) for n, e in m["ranks"]["0"]["tensors"].items() if n not in m["shared"])
    assert abs(written / (shared + local0) - 1.0) <= 0.01, (written, shared, local0)

    # The interrupted epoch: its items trained on by the first job (steps < k), the rest by the second.
    before = [row for row in _rows(run_dir, "save", 4) if row["step"] < k]
    epoch = max(row["epoch"] for row in before)
    consumed = sum(len(row["items"]) for row in before if row["epoch"] == epoch)
    # It ends on 2 ranks after (ITEMS - consumed) / (2 * BATCH) more steps; go 5 steps past it.
    total = k + (ITEMS - consumed) // (2 * BATCH) + 5
    second = _render(slurm_cluster, run_dir, "narrow", 1, _command("--phase", "resume", "--total", str(total)))
    job2 = slurm_cluster.sbatch(second, "-p", "low", "--exclusive", "--export=ALL,OMP_NUM_THREADS=1")
    out2 = run_dir / f"slurm-{job2}.out"
    assert slurm_cluster.wait_done(job2, 600, out2) == "COMPLETED", out2.read_text()[-3000:]

    resumed = [json.loads((run_dir / f"result-resume-r{r}.json").read_text()) for r in range(2)]
    assert [r["restored"] for r in resumed] == [k, k], resumed
    want = torch.load(run_dir / "state-saved-r0.pt")
    for r in range(2):
        got = torch.load(run_dir / f"state-restored-r{r}.pt")
        assert sorted(got) == sorted(want)
        differ = [n for n in want if not torch.equal(got[n], want[n])]
        assert not differ, f"rank {r} of the 1-node job restored {differ} unlike the 2-node job saved them"

    seen: Counter[int] = Counter()
    for row in before:
        if row["epoch"] == epoch:
            seen.update(row["items"])
    after = _rows(run_dir, "resume", 2)
    for row in after:
        if row["epoch"] == epoch:
            seen.update(row["items"])
    assert sorted(seen) == list(range(ITEMS)), f"{ITEMS - len(seen)} items of epoch {epoch} never seen"
    assert set(seen.values()) == {1}, {i: c for i, c in seen.items() if c > 1}
    assert any(row["epoch"] == epoch + 1 for row in after), f"training did not go on into epoch {epoch + 1}"
    assert all(r["eval_end"] < r["eval_restored"] for r in resumed), resumed

    ledger = slurm_cluster.read_ledger(run_dir / "ckpt")
    starts = [e for e in ledger if e["event"] == "start"]
    assert [(s["resumed_from"], s["world_size"]) for s in starts] == [(None, 4), (k, 2)], starts
