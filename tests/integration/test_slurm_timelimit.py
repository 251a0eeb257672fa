"""Time limit: `--time=2 --signal=B:USR2@50` warns the demo before Slurm would kill it;
each run checkpoints at the stop step, requeues, and the last run finishes
bit-identical to an uninterrupted one.

The job outlasts its limit by construction: its per-step sleeps alone add up to more
than the limit, so however fast the machine trains, one allocation cannot finish it.
Two minutes, not one: on a loaded 2-core machine a training process's start-up (torch's
imports) has taken 50 s of a 1-minute allocation."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from conftest import SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

TIME_LIMIT_S = 120  # --time=2
STEP_SLEEP_S = 1.0
STEPS = 150
assert STEPS * STEP_SLEEP_S > TIME_LIMIT_S, "the job must not fit in one allocation"


@pytest.mark.long(240)
def test_time_limit_warning_checkpoints_requeues_and_resumes_identically(
        slurm_cluster: SlurmCluster, tmp_path: Path, reference_digest: Callable[[int], str]) -> None:
    steps = STEPS
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    script = slurm_cluster.render_demo("single", run_dir, steps=steps, sleep_s=STEP_SLEEP_S,
                                       time_limit=str(TIME_LIMIT_S // 60), lead_s=50)
    # The default deadline margin (30 s) plus poll interval would leave a 2-minute job
    # little; a margin of 0 leaves each run ~80-100 s of training.
    job = slurm_cluster.sbatch(script, "--export=ALL,HPCCKPT_DEADLINE_MARGIN_S=0")
    slurm_cluster.wait_completed(job, 600, run_dir / f"slurm-{job}.out")

    assert slurm_cluster.result_digest(run_dir) == reference_digest(steps), "not bit-identical"
    ledger = slurm_cluster.read_ledger(run_dir / "ckpt")
    starts = [e for e in ledger if e["event"] == "start"]
    assert len(starts) >= 2, f"a {STEPS * STEP_SLEEP_S:.0f} s job was not interrupted by a 2-minute limit"
    assert [s["restart_count"] for s in starts] == list(range(len(starts)))
    assert int(slurm_cluster.job(job)["Restarts"]) == len(starts) - 1
    stops = [e for e in ledger if e["event"] == "stop" and e["reason"] != "done"]
    # Every allocation but the last ended in a warned stop, not in Slurm's kill.
    assert len(stops) == len(starts) - 1, ledger
    for stop in stops:
        # Warned by USR2 (B: delivery) or by the end time the policy reads from Slurm.
        assert stop["reason"] in {"signal", "deadline"}, stop
        assert stop["committed_step"] == stop["step"]
    history = slurm_cluster.history(run_dir / "ckpt")
    assert {r["cause"] for r in history["rows"]} == {"time_limit"}, history["rows"]
    assert history["lost_steps_total"] == 0
    assert all(r["step_at_signal"] is None or r["step_at_signal"] == r["committed_step"]
               for r in history["rows"])
