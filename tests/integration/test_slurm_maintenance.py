"""A MAINT reservation is created on the node the demo runs on: with no signal at all,
hpcckpt sees it coming (reservations overlapping the job), checkpoints, requeues onto
the other node and finishes bit-identical."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from conftest import SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


@pytest.mark.long(170)
def test_maintenance_reservation_triggers_checkpoint_and_requeue(
        slurm_cluster: SlurmCluster, tmp_path: Path, reference_digest: Callable[[int], str]) -> None:
    # 150 steps of 0.6 s outlast the stop's lead before the window (100 s away) by half a minute
    # or more, however small the measured save makes that lead (the first allocation's reserve
    # is measured now: ~35 s, where the assumed 10 s save made it ~50 s and 0.3 s steps ended
    # the run first).
    steps = 150
    run_dir = tmp_path / "run"
    job = slurm_cluster.submit_demo("single", run_dir, steps=steps, sleep_s=0.6)
    slurm_cluster.wait_for(job, {"RUNNING"}, 120)
    node = slurm_cluster.job(job)["NodeList"]
    name = f"hpcckpt-maint-{job}"
    try:
        slurm_cluster.run(["scontrol", "create", "reservation", f"ReservationName={name}",
                           "StartTime=now+100", "Duration=20", f"Nodes={node}", "Users=root",
                           "Flags=MAINT,IGNORE_JOBS"])
        slurm_cluster.wait_completed(job, 400, run_dir / f"slurm-{job}.out")
    finally:
        slurm_cluster.run(["scontrol", "delete", f"ReservationName={name}"], check=False)
    assert slurm_cluster.result_digest(run_dir) == reference_digest(steps), "not bit-identical"
    ledger = slurm_cluster.read_ledger(run_dir / "ckpt")
    stops = [e for e in ledger if e["event"] == "stop" and e["reason"] != "done"]
    assert [s["reason"] for s in stops] == ["maintenance"]
    assert stops[0]["committed_step"] == stops[0]["step"]
    history = slurm_cluster.history(run_dir / "ckpt")
    assert [r["cause"] for r in history["rows"]] == ["maintenance"] and history["lost_steps_total"] == 0
