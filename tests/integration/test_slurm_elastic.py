"""Elastic resume on the real local Slurm cluster: a 2 nodes x 2 ranks DDP job (gloo) is
preempted; its final checkpoint (format hpcckpt/2, the replicated state written once)
is resumed by a new submission on 1 node x 2 ranks. The restored parameters and
optimizer state equal the saved ones exactly, every item of the interrupted epoch is
trained on exactly once across the two jobs, and training goes on. And an FSDP2 job on
2 nodes x 2 ranks, preempted and requeued, resumes on 4 ranks bit-identically to an
uninterrupted local run.

The ranks run tests/unit/dist_worker.py under the ``ddp`` template (srun, the batch
script requeues after the ranks exit 75). The first job waits before step HOLD until
its ranks have received the preemption's TERM, so the stop step is known (HOLD + 1)
whenever the preemption lands. The requeued run of the first job ends at
once (``--only-first-run``): the second world is the new submission.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
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
HOLD = 10  # the first job waits before this step until its ranks got the preemption's TERM


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
                    _command("--phase", "save", "--stop-at", "100000", "--hold-at", str(HOLD),
                             "--only-first-run"))
    job = slurm_cluster.sbatch(first, "-p", "low", "--exclusive", "--export=ALL,OMP_NUM_THREADS=1")
    out = run_dir / f"slurm-{job}.out"
    slurm_cluster.wait_for(job, {"RUNNING"}, 240, out)
    slurm_cluster.wait_until(lambda: _steps_done(run_dir) >= HOLD, 240, f"{HOLD} DDP steps on 4 ranks")
    slurm_cluster.preempt()
    slurm_cluster.wait_completed(job, 600, out)

    saved = [json.loads((run_dir / f"result-save-r{r}.json").read_text()) for r in range(4)]
    k = saved[0]["requeue_step"]
    assert {s["requeue_step"] for s in saved} == {k} and {s["committed_step"] for s in saved} == {k}, saved
    assert k == HOLD + 1, f"the job stopped at step {k}; held before step {HOLD}, it stops after it"
    info = catalog.find(run_dir / "ckpt", None)
    assert info.step == k and info.manifest is not None
    m = info.manifest
    assert m["format"] == "hpcckpt/4" and m["world_size"] == 4, (m["format"], m["world_size"])
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
    slurm_cluster.wait_completed(job2, 600, out2)

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


FSDP_STEPS = 40


def _local_reference(out: Path, world: int, *args: str) -> None:
    """The same training without hpcckpt and without interruption, as local processes (gloo on loopback)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "HPCCKPT_")) or k == "SLURM_CONF"}
    env["OMP_NUM_THREADS"] = "1"
    out.mkdir(parents=True, exist_ok=True)
    procs = [subprocess.Popen([PYTHON, str(WORKER), "--rank", str(r), "--world", str(world), "--port", str(port),
                               "--out", str(out), "--items", str(ITEMS), "--batch", str(BATCH), *args],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
             for r in range(world)]
    try:
        codes = [p.wait(timeout=600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert codes == [0] * world, f"the local reference failed: {codes}"


def test_fsdp2_on_two_nodes_preempted_and_requeued_resumes_bit_identically(
        slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    ref = tmp_path / "reference"
    _local_reference(ref, 4, "--phase", "reference", "--mode", "fsdp", "--total", str(FSDP_STEPS))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    command = (f'{PYTHON} {WORKER} --out "$HPCCKPT_RUN_DIR" --ckpt "$HPCCKPT_DIR" --mode fsdp --engine concurrent '
               f"--items {ITEMS} --batch {BATCH} --phase run --total {FSDP_STEPS} --hold-at {HOLD}")
    script = _render(slurm_cluster, run_dir, "fsdp", 2, command)
    job = slurm_cluster.sbatch(script, "-p", "low", "--exclusive", "--export=ALL,OMP_NUM_THREADS=1")
    out = run_dir / f"slurm-{job}.out"
    slurm_cluster.wait_for(job, {"RUNNING"}, 240, out)
    progress = run_dir / "items-run0-r0.jsonl"
    slurm_cluster.wait_until(lambda: progress.exists() and len(progress.read_text().splitlines()) >= HOLD, 240,
                             f"{HOLD} FSDP2 steps on 4 ranks")
    slurm_cluster.preempt()
    slurm_cluster.wait_completed(job, 600, out)

    first = [json.loads((run_dir / f"result-run0-r{r}.json").read_text()) for r in range(4)]
    k = first[0]["requeue_step"]
    assert {f["requeue_step"] for f in first} == {k} and {f["committed_step"] for f in first} == {k}, first
    assert k == HOLD + 1, f"the job stopped at step {k}; held before step {HOLD}, it stops after it"
    second = [json.loads((run_dir / f"result-run1-r{r}.json").read_text()) for r in range(4)]
    assert [s["restored"] for s in second] == [k] * 4, second
    m = catalog.find(run_dir / "ckpt", None).manifest
    assert m is not None and m["format"] == "hpcckpt/4", m and m.get("format")
    params = [n for n in m["shared"] if n.startswith("objects/model/")]
    assert params and {m["shared"][n]["kind"] for n in params} == {"sharded"}, m["shared"]

    for r in range(4):
        stopped = torch.load(run_dir / f"state-stopped-run0-r{r}.pt")
        restored = torch.load(run_dir / f"state-restored-run1-r{r}.pt")
        assert [n for n in stopped if not torch.equal(stopped[n], restored[n])] == [], f"rank {r}: restore"
        end, want = torch.load(run_dir / f"state-end-r{r}.pt"), torch.load(ref / f"state-end-r{r}.pt")
        differ = [n for n in want if not torch.equal(end[n], want[n])]
        assert not differ, f"rank {r}: the preempted FSDP2 run ends unlike the uninterrupted one in {differ}"
    ref_items = {(r, row["step"]): row["items"] for r in range(4) for row in
                 map(json.loads, (ref / f"items-reference-r{r}.jsonl").read_text().splitlines())}
    got: dict[tuple[int, int], list[int]] = {}
    for r in range(4):
        for label, keep in (("run0", lambda s: s < k), ("run1", lambda s: True)):
            for row in map(json.loads, (run_dir / f"items-{label}-r{r}.jsonl").read_text().splitlines()):
                if keep(row["step"]):
                    got[(r, row["step"])] = row["items"]
    assert got == ref_items, "the batches of the preempted run differ from the uninterrupted run's"
