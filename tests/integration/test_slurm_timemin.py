"""`--time-min` shorter than the template's lead: `sbatch --time=2 --time-min=2` of the
"single" template rendered with its default `--signal=B:USR2@180`: a 2-minute allocation,
shorter than that lead, so Slurm's warning is due at the very start of each allocation
(with `--time=3 --time-min=2` Slurm grants 3 minutes when nothing waits for the nodes, and
the 2-minute minimum only when something does: the limit is pinned to keep the case
the same on every run); the template bounds the lead by the allocation and the training
process stops at its measured deadline, not at the warning. Every interrupted allocation
trains on until its deadline: its stop (the ledger's stop event against Slurm's record of
the allocation) falls in the last 40% of its limit, after steps were trained in it; the
job takes two or more allocations and finishes bit-identical to an uninterrupted run.

What the test does not bound is the process's start-up before it reaches the Checkpointer:
that is the machine's (torch's imports took 43 s of a 120-s allocation on a loaded 2-core
CI machine, 4 s on an idle one), and a loaded machine just needs more allocations.

The deadline margin is 10 s (HPCCKPT_DEADLINE_MARGIN_S): with the default 30 s, the stop's
reserve alone (margin + exit + step + 1.5 x save) is ~36 s of a 120-s allocation.

The work is ~2 allocations on an idle machine: 55 steps of >= 2 s are >= 110 s of training,
more than an allocation's 120 s less its start and reserve (>= ~20 s)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from conftest import SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

TEMPLATE_LEAD_S = 180  # the single template's default LEAD_S
GRANT_S = 120  # --time-min=2
STEP_SLEEP_S = 2.0
STEPS = 55
MARGIN_S = 10
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
            "DEADLINE", "PREEMPTED"}


def _seconds(limit: str) -> int:
    """A Slurm TimeLimit ([D-]HH:MM:SS or MM:SS) in seconds."""
    days, _, rest = limit.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    while len(parts) < 3:
        parts.insert(0, 0)
    return int(days or 0) * 86400 + parts[0] * 3600 + parts[1] * 60 + parts[2]


def _epoch(stamp: str) -> float:
    return datetime.fromisoformat(stamp).timestamp()  # scontrol prints local time


def _allocations(cluster: SlurmCluster, job: str, timeout_s: float, out: Path) -> tuple[str, dict[int, dict[str, Any]]]:
    """Poll Slurm's record until the job ends: its final state and, per run (Restarts), the
    allocation's start, granted limit and end (the end of the last run: when it ended)."""
    runs: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rec = cluster.job(job)
        state = rec.get("JobState", "UNKNOWN")
        if state in {"RUNNING", "COMPLETING"} or state in TERMINAL:
            run = int(rec.get("Restarts", "0"))
            if rec.get("StartTime", "Unknown") != "Unknown":
                runs[run] = {"start": _epoch(rec["StartTime"]), "limit_s": _seconds(rec["TimeLimit"]),
                             "end": _epoch(rec["EndTime"]), "state": state}
        if state in TERMINAL:
            return state, runs
        time.sleep(0.5)
    tail = out.read_text(errors="replace")[-3000:] if out.exists() else "(no output)"
    raise AssertionError(f"job {job} did not end within {timeout_s:.0f}s; seen {runs}\n{tail}")


@pytest.mark.long(150)
def test_time_min_shorter_than_lead_trains_to_the_deadline_of_every_allocation(
        slurm_cluster: SlurmCluster, tmp_path: Path, reference_digest: Callable[[int], str]) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    # Periodic saves (every 10 steps) are the "fast saves": their measured cost sets the lead.
    command = (f'{sys.executable} -m hpcckpt.demo.train --dir "$HPCCKPT_RUN_DIR" --steps {STEPS} '
               f'--every 10 --step-sleep {STEP_SLEEP_S}')
    script = slurm_cluster.render("single", run_dir / "single.sbatch", TIME="2", LEAD_S=str(TEMPLATE_LEAD_S),
                                  RUN_DIR=str(run_dir), OUTPUT=f"{run_dir}/slurm-%j.out", COMMAND=command,
                                  JOB_NAME="hpcckpt-timemin")
    job = slurm_cluster.sbatch(script, "--time-min=2", f"--export=ALL,HPCCKPT_DEADLINE_MARGIN_S={MARGIN_S}")
    out = run_dir / f"slurm-{job}.out"
    state, runs = _allocations(slurm_cluster, job, 560, out)
    log = out.read_text(errors="replace") if out.exists() else "(no output)"
    assert state == "COMPLETED", f"{state}\n{log[-3000:]}"

    assert slurm_cluster.result_digest(run_dir) == reference_digest(STEPS), "not bit-identical"
    ledger = slurm_cluster.read_ledger(run_dir / "ckpt")
    starts = [e for e in ledger if e["event"] == "start"]
    stops = [e for e in ledger if e["event"] == "stop"]
    # Two allocations here; a loaded machine (slower steps) may need more: each one but the
    # last ends at its deadline, never at the early warning, committed and requeued.
    n = len(starts)
    assert n >= 2 and len(stops) == n, f"two or more allocations expected, ledger: {ledger}\n{log[-3000:]}"
    assert sorted(runs) == list(range(n)), runs
    assert [s["restart_count"] for s in starts] == list(range(n))
    assert [s["reason"] for s in stops] == ["deadline"] * (n - 1) + ["done"], stops  # not the early warning
    assert all(s["committed_step"] == s["step"] and s["requeue"] is True for s in stops[:-1]), stops

    for run, (start, stop) in enumerate(zip(starts, stops)):
        alloc = runs[run]
        # Slurm granted --time-min, less than the template's lead: the case under test.
        assert alloc["limit_s"] == GRANT_S < TEMPLATE_LEAD_S, f"Slurm granted {alloc}"
        # Each allocation trained: its stop is past the step it started from.
        assert stop["step"] > (start["resumed_from"] or 0), f"run {run} trained nothing: {start} {stop}\n{log[-3000:]}"
        if run == n - 1:
            continue  # the last one ended when the work did
        # An interrupted allocation trained until its deadline: the stop came in the last 40% of
        # its limit (the reserve before the end time is ~18 s here), not at the warning, which
        # Slurm would have sent at the allocation's start.
        end = alloc["start"] + alloc["limit_s"]
        before_end_s = end - stop["time"]
        assert 0 < before_end_s <= 0.4 * alloc["limit_s"], (
            f"run {run}: stopped {before_end_s:.1f}s before the end of an allocation of "
            f"{alloc['limit_s']}s (trained {stop['time'] - start['time']:.1f}s); {alloc}\n{log[-3000:]}")

    history = slurm_cluster.history(run_dir / "ckpt")
    assert history["finished"] and history["lost_steps_total"] == 0, history
    assert [r["cause"] for r in history["rows"]] == ["time_limit"] * (n - 1), history["rows"]
