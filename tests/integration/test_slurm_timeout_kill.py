"""Slurm's own TIMEOUT kill comes back: a training process that does not read its end time
(the local backend) and gets no warning (the template's lead is 0; it listens to TERM only)
first hears of the time limit from Slurm's TIMEOUT: TERM to every process of the job, KILL
KillWait later. It commits at the next step and exits 75; the batch shell's `hpcckpt
requeue` requeues the job Slurm is ending (COMPLETING, Reason=TimeLimit), confirmed by its
restart count. The next run resumes and finishes bit-identical, and `hpcckpt history`
charges the stop to the time limit.

KillWait is Slurm's default 30 s for this test (the local cluster runs with 5 s): the
batch shell's requeue is a new process started after the training process has exited, and
on a loaded machine it does not reliably fit in 5 s (why 8fb7577 dropped the first version
of this test). 30 s bounds the race generously; the path taken is the same."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from conftest import SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

KILL_WAIT_S = 30  # Slurm's default KillWait
TIME_LIMIT_S = 60  # --time=1
CHECK_PERIOD_S = 30  # slurmctld looks for jobs past their limit about this often: the kill comes up to it late
STEPS = 120
# The first run sleeps 1 s a step: it cannot finish before Slurm's kill, however late that
# comes. A resumed run does not sleep: what is left usually ends inside its own minute; on
# a loaded machine (steps of over a second were seen) it meets the limit again, and comes
# back again. The sleeps do not change the training.
FIRST_SLEEP_S, RESUMED_SLEEP_S = 1.0, 0.0
FINISH_WITHIN_S = 900  # the whole chain of allocations, however many a loaded machine needs
assert STEPS * FIRST_SLEEP_S > TIME_LIMIT_S + CHECK_PERIOD_S + 20, "the first run must still train at the kill"


def _kill_wait(cluster: SlurmCluster) -> int:
    m = re.search(r"^KillWait\s*=\s*(\d+)", cluster.run(["scontrol", "show", "config"]), re.M)
    assert m, "scontrol show config shows no KillWait"
    return int(m.group(1))


@contextmanager
def kill_wait(cluster: SlurmCluster, seconds: int) -> Iterator[None]:
    """This cluster's KillWait set to ``seconds`` (slurm.conf and `scontrol reconfigure`), then back."""
    original = cluster.conf.read_text()
    assert re.search(r"^KillWait=\d+$", original, re.M), "slurm.conf has no KillWait line"

    def apply(text: str, want: int) -> None:
        cluster.conf.write_text(text)
        cluster.run(["scontrol", "reconfigure"])
        cluster.wait_until(lambda: _kill_wait(cluster) == want, 120, f"KillWait={want} after reconfigure")
        cluster.wait_until(lambda: "idle" in cluster.run(["sinfo", "-h", "-o", "%t"]), 120, "an idle node")

    before = int(re.search(r"^KillWait=(\d+)$", original, re.M).group(1))  # type: ignore[union-attr]  # asserted above
    try:
        apply(re.sub(r"^KillWait=\d+$", f"KillWait={seconds}", original, flags=re.M), seconds)
        yield
    finally:
        apply(original, before)


def _requeues(cluster: SlurmCluster, run_dir: Path) -> list[dict[str, Any]]:
    return [e for e in cluster.read_ledger(run_dir / "ckpt") if e["event"] == "requeue" and e["source"] == "cli"]


def _last_stop(cluster: SlurmCluster, run_dir: Path) -> str | None:
    return next((e["reason"] for e in reversed(cluster.read_ledger(run_dir / "ckpt")) if e["event"] == "stop"), None)


def _finished(cluster: SlurmCluster, run_dir: Path) -> bool:
    return any(e["event"] == "stop" and e["reason"] == "done" for e in cluster.read_ledger(run_dir / "ckpt"))


@pytest.mark.long(115)
def test_slurm_timeout_kill_comes_back(
        slurm_cluster: SlurmCluster, tmp_path: Path, reference_digest: Callable[[int], str]) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    command = (f'env HPCCKPT_CLUSTER=local HPCCKPT_SIGNALS=SIGTERM {sys.executable} -m hpcckpt.demo.train '
               f'--dir "$HPCCKPT_RUN_DIR" --steps {STEPS} --every 10 '
               f'--step-sleep "$( ((${{SLURM_RESTART_COUNT:-0}} == 0)) && echo {FIRST_SLEEP_S} || echo {RESUMED_SLEEP_S})"')
    script = slurm_cluster.render("single", run_dir / "single.sbatch", TIME="1", LEAD_S="0", RUN_DIR=str(run_dir),
                                  OUTPUT=f"{run_dir}/slurm-%j.out", COMMAND=command, JOB_NAME="hpcckpt-timeout")
    with kill_wait(slurm_cluster, KILL_WAIT_S):
        job = slurm_cluster.sbatch(script)
        out = run_dir / f"slurm-{job}.out"
        slurm_cluster.wait_until(lambda: bool(_requeues(slurm_cluster, run_dir)), 300,
                                 "the batch shell's requeue record")
        # The job id stays (scontrol requeue); between a later TIMEOUT kill and its requeue
        # Slurm shows TIMEOUT for a moment, so the end is the training's own "done" record.
        slurm_cluster.wait_until(lambda: _finished(slurm_cluster, run_dir), FINISH_WITHIN_S,
                                 "the training's done record, however many allocations it takes")
        requeue = _requeues(slurm_cluster, run_dir)[-1]
        last = str(requeue["successor_job_id"] or job)
        state = slurm_cluster.wait_done(last, 120, out)
        if _last_stop(slurm_cluster, run_dir) == "after_run":  # TERM after the done record: one more allocation
            slurm_cluster.wait_until(lambda: _last_stop(slurm_cluster, run_dir) == "done", 300,
                                     "the done record of the allocation after the after_run stop")
            state = slurm_cluster.wait_done(last, 120, out)
    log = out.read_text(errors="replace") if out.exists() else "(no output)"
    assert requeue["requeued"] is True and requeue["evidence"], f"{requeue}\n{log[-3000:]}"
    assert requeue["cause"] == "time_limit", requeue
    # The last allocation trains to the end on its own. One that ends right at its limit can
    # be marked TIMEOUT by slurmctld's periodic check before the batch step's completion
    # reaches it (seen in CI: no TERM, no kill message, the "done" record written): the
    # training was not stopped, and that is what this checks, not which of the two Slurm shows.
    last_run = log[log.rfind("hpcckpt: job "):]
    assert state == "COMPLETED" or (state == "TIMEOUT" and "got TERM" not in last_run
                                    and "requeue decision" not in last_run), f"{state}\n{log[-3000:]}"
    assert "TIME LIMIT" in log, log[-3000:]  # slurmstepd: *** JOB n ... CANCELLED AT ... DUE TO TIME LIMIT ***

    assert slurm_cluster.result_digest(run_dir) == reference_digest(STEPS), "not bit-identical"
    ledger = slurm_cluster.read_ledger(run_dir / "ckpt")
    # Two allocations when the resumed run (0.1 s steps) ends inside its minute; on a loaded
    # machine it may meet the limit again: every stop is then the same kind, and resumes exactly.
    starts = [e for e in ledger if e["event"] == "start"]
    assert [s["restart_count"] for s in starts] == list(range(len(starts))) and len(starts) >= 2, ledger
    # A TERM that reaches the training after its last step (the kill right at the limit, after
    # the done record) stops it as code after its loop (after_run): requeued, and one more
    # allocation resumes at the end, trains nothing and finishes again.
    after = [e for e in ledger if e["event"] == "stop" and e["reason"] == "after_run"]
    assert len(after) <= 1, ledger
    training = starts[:len(starts) - len(after)]  # the allocations that trained
    stops = [e for e in ledger if e["event"] == "stop" and e["reason"] not in ("done", "after_run")]
    assert len(stops) == len(training) - 1, ledger
    done = [i for i, e in enumerate(ledger) if e["event"] == "stop" and e["reason"] == "done"]
    assert len(done) == 1 + len(after) and done[0] > ledger.index(training[-1]), ledger  # the last that trained finished it
    if after:
        assert starts[-1]["resumed_from"] == STEPS and done[-1] > ledger.index(starts[-1]), ledger
    for stop, resumed in zip(stops, training[1:]):
        assert stop["reason"] == "signal" and stop["signame"] == "SIGTERM", stop
        assert stop["committed_step"] == stop["step"] == resumed["resumed_from"], (stop, starts)
    history = slurm_cluster.history(run_dir / "ckpt")
    assert history["finished"] and history["lost_steps_total"] == 0, history
    assert [r["cause"] for r in history["rows"]][:len(stops)] == ["time_limit"] * len(stops), history["rows"]
    assert len(history["rows"]) == len(stops) + len(after), history["rows"]


@pytest.mark.long(100)
def test_a_time_limit_during_the_start_up_comes_back(
        slurm_cluster: SlurmCluster, tmp_path: Path, reference_digest: Callable[[int], str]) -> None:
    """The first run's start-up outlasts its allocation (a stand-in for a slow file system: the
    command sleeps before Python starts), so Slurm's TIMEOUT TERM kills it before hpcckpt has
    a handler: status 143, nothing recorded. The template's `hpcckpt requeue --stopped-status
    --ran-s` requeues the job anyway (it ran its whole allocation: never refused) and
    the next run trains from the beginning to the end, bit-identical; without it the job
    would end TIMEOUT, never to come back. `--time=2`: the next run's start-up and its 120
    steps fit one allocation on an idle machine."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    command = ('bash -c \'if (( ${SLURM_RESTART_COUNT:-0} == 0 )); then sleep 600; fi; '
               f'exec {sys.executable} -m hpcckpt.demo.train --dir "$HPCCKPT_RUN_DIR" --steps {STEPS} --every 10\'')
    script = slurm_cluster.render("single", run_dir / "single.sbatch", TIME="2", LEAD_S="0", RUN_DIR=str(run_dir),
                                  OUTPUT=f"{run_dir}/slurm-%j.out", COMMAND=command, JOB_NAME="hpcckpt-startup")
    with kill_wait(slurm_cluster, KILL_WAIT_S):
        job = slurm_cluster.sbatch(script)
        out = run_dir / f"slurm-{job}.out"
        slurm_cluster.wait_completed(job, FINISH_WITHIN_S, out)
    log = out.read_text(errors="replace")
    # The command ran its whole allocation and recorded nothing: whether it was starting up or
    # training (a script with its own checkpoints records nothing either) is judged from how
    # long it ran, never from the missing record: requeued, never refused as a start-up that
    # does not fit. The status is 143 (TERM), or lost when the command died while the shell's
    # trap ran (bash: -1).
    assert re.search(r"the command ran \d+ s and was stopped \((status 143|its status lost by the shell)\)"
                     r".*: requeued", log), log[-3000:]
    assert "TIME LIMIT" in log, log[-3000:]
    ledger = slurm_cluster.read_ledger(run_dir / "ckpt")
    first = ledger[0]  # the killed run recorded nothing of its own: the requeue is the first event
    assert first["event"] == "requeue" and first["source"] == "cli" and not first.get("unstarted"), ledger
    assert first["restart_count"] == 0 and first["requeued"] is True and first["cause"] == "time_limit", first
    # The next run trains from the beginning; on a loaded machine (steps of 0.7 s were seen beside
    # the unit tests) it may reach its deadline and come back once more, resumed exactly.
    starts = [e for e in ledger if e["event"] == "start"]
    stops = [e for e in ledger if e["event"] == "stop"]
    assert [s["restart_count"] for s in starts] == list(range(1, len(starts) + 1)), ledger
    assert [s["reason"] for s in stops] == ["deadline"] * (len(starts) - 1) + ["done"], ledger
    assert [s["resumed_from"] for s in starts] == [None] + [s["committed_step"] for s in stops[:-1]], ledger
    assert slurm_cluster.result_digest(run_dir) == reference_digest(STEPS), "not bit-identical"
    history = slurm_cluster.history(run_dir / "ckpt")
    assert history["finished"] and history["lost_steps_total"] == 0, history
    assert [r["cause"] for r in history["rows"]] == ["time_limit"] * len(starts), history["rows"]
