"""`--time=1` with a slow save (a registered object's state_dict() sleeps 20 s): the stop's
reserve before the end time comes from the measured save, so once a save has been measured
an allocation is refused with the figures and the setting to change (exit 1, job FAILED),
instead of being requeued again and again for a few steps each."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from conftest import SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

SAVE_SLEEP_S = 20.0  # 1.5 x 20 s + the 30 s margin + 5 s exit: more than a 1-minute allocation
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
            "DEADLINE", "PREEMPTED"}
HERE = Path(__file__).resolve().parent


@pytest.mark.long(70)
def test_time_limit_too_short_for_a_slow_save_is_refused_with_figures(
        slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    command = (f'{sys.executable} {HERE / "slow_save_train.py"} --dir "$HPCCKPT_DIR" --steps 1000 '
               f"--step-sleep 0.5 --save-sleep {SAVE_SLEEP_S}")
    script = slurm_cluster.render("single", run_dir / "single.sbatch", TIME="1", RUN_DIR=str(run_dir),
                                  OUTPUT=f"{run_dir}/slurm-%j.out", COMMAND=command, JOB_NAME="hpcckpt-slowsave")
    job = slurm_cluster.sbatch(script)
    out = run_dir / f"slurm-{job}.out"

    # Wait for the end, and fail as soon as the job has been requeued more than twice.
    deadline = time.monotonic() + 420
    state, restarts = "", 0
    while time.monotonic() < deadline:
        rec = slurm_cluster.job(job)
        state, restarts = rec.get("JobState", "UNKNOWN"), int(rec.get("Restarts", "0"))
        if state in TERMINAL or restarts > 2:
            break
        time.sleep(0.5)
    log = out.read_text(errors="replace") if out.exists() else "(no output)"
    if state not in TERMINAL:
        slurm_cluster.cancel(job)
    assert restarts <= 2, f"requeued {restarts} times, still {state}\n{log[-4000:]}"
    assert state == "FAILED", f"{state} after {restarts} requeues\n{log[-4000:]}"

    ledger = slurm_cluster.read_ledger(run_dir / "ckpt")
    refused = [e for e in ledger if e["event"] == "refused"]
    assert len(refused) == 1, ledger
    why = refused[0]["reason"]
    # The figures and the setting to change, in the record and in the job's output.
    figures = re.search(r"([\d.]+)s = 1\.5 x save ([\d.]+)s \+ step [\d.]+s \+ requeue and exit \d+s "
                        r"\+ margin \d+s", why)
    assert figures, why
    assert "--time" in why and "HPCCKPT_DEADLINE_MARGIN_S" in why, why
    assert "not requeueing" in log and "HPCCKPT_DEADLINE_MARGIN_S" in log, log[-4000:]
    commits = [e for e in ledger if e["event"] == "commit"]
    if commits:
        # A slow save was measured: the refusal rests on that measurement (state_dict's time
        # included), not on a fast write of an already captured state.
        assert float(figures.group(2)) >= SAVE_SLEEP_S, why
        assert float(figures.group(1)) > 60, why
    starts = [e for e in ledger if e["event"] == "start"]
    assert len(starts) == restarts + 1 and len(starts) <= 3, ledger
