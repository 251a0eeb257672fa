"""The Checkpointer's deadline from measurements, with a fast-forward clock and a real signal.

A USR2 long before the end time does not stop the run; the deadline (end time minus the
measured save, a step and the margin) does. An allocation too short for a step and a save
is refused with the figures and the setting to change, and two deadline stops in a row
without progress stop the job instead of requeueing it forever.
"""
from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from hpcckpt.api import Checkpointer, RefusedExit, RequeueExit
from hpcckpt.errors import ConfigError
from hpcckpt.exitcodes import EXIT_PROBLEM, EXIT_REQUEUE
from hpcckpt.lifecycle.budget import BUDGET_FILE, no_progress
from hpcckpt.lifecycle.ledger import Ledger
from hpcckpt.policy import Figures
from hpcckpt.store import catalog
from tests.helpers import tiny_state, train_step

pytestmark = pytest.mark.native


class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


def checkpointer(ckdir: Path, clock: Clock) -> Checkpointer:
    ck = Checkpointer(ckdir, every_steps=None, deadline_margin_s=5)
    ck.policy.clock = clock
    return ck


def stopped(ckdir: Path, monkeypatch: pytest.MonkeyPatch, events: dict[int, Callable[[Clock], None]]) -> RequeueExit:
    """A run with 200 s left; ``events[step](clock)`` runs after that step. Returns its stop."""
    clock = Clock()
    monkeypatch.setenv("HPCCKPT_END_TIME", str(clock.t + 200))
    objs = tiny_state(0)
    with pytest.raises(RequeueExit) as exc:
        with checkpointer(ckdir, clock) as ck:
            ck.register(**objs)
            for step in ck.steps(50):
                train_step(objs)
                if step in events:
                    events[step](clock)
    return exc.value


def usr2(_clock: Clock) -> None:
    os.kill(os.getpid(), signal.SIGUSR2)  # the scheduler's warning, 200 s early



def _deadlines_without_progress(ckdir: Path) -> int:
    """The no-progress guard's count of deadline stops in a row (the requeue budget's file)."""
    return int(json.loads((ckdir / BUDGET_FILE).read_text())["without_progress"]["deadline"])

def test_a_warning_long_before_the_deadline_stops_there_not_at_once(ckdir: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    def near_the_end(clock: Clock) -> None:
        clock.t += 190  # 10 s left: within 1.5 x save + a step + the 5 s margin

    stop = stopped(ckdir, monkeypatch, {2: usr2, 20: near_the_end})
    assert stop.step == 21 and stop.reason == "deadline"
    led = Ledger(ckdir).read()
    deferred = [e for e in led if e["event"] == "signal_deferred"]
    assert len(deferred) == 1 and deferred[0]["step"] == 3 and "margin 5s" in deferred[0]["detail"]
    assert [e["reason"] for e in led if e["event"] == "stop"] == ["deadline"]
    assert not [e for e in led if e["event"] == "signal"]  # history: a time-limit stop, not a signal's
    figures = Figures.read(ckdir)  # the measured save is there for the next allocation
    assert figures.save_s is not None and figures.save_s < 10 and figures.step_s is not None


def test_a_term_still_stops_at_the_next_step(ckdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stop = stopped(ckdir, monkeypatch, {2: usr2, 5: lambda _c: os.kill(os.getpid(), signal.SIGTERM)})
    assert stop.step == 6 and stop.reason == "signal"


@pytest.mark.parametrize(("poll_s", "stop_step"), [(None, 15), ("2", 6)])
def test_poll_s_is_how_soon_an_end_time_pulled_in_is_seen(ckdir: Path, monkeypatch: pytest.MonkeyPatch,
                                                          poll_s: str | None, stop_step: int) -> None:
    """Every step takes 1 s of the clock; after step 5 the end time is pulled in (a preemption's
    GraceTime, still further away than the stop's lead). The job reads its end time as it
    starts (t=0) and then every HPCCKPT_POLL_S: 15 s by default (the stop comes at step 15,
    t=15), 2 s when set (step 6, t=6)."""
    if poll_s is not None:
        monkeypatch.setenv("HPCCKPT_POLL_S", poll_s)

    def tick(clock: Clock) -> None:
        clock.t += 1

    def preempted(clock: Clock) -> None:
        clock.t += 1
        monkeypatch.setenv("HPCCKPT_END_TIME", str(clock.t + 150))

    stop = stopped(ckdir, monkeypatch, {s: preempted if s == 5 else tick for s in range(50)})
    assert (stop.step, stop.reason) == (stop_step, "deadline")


def test_a_bad_poll_s_is_refused_naming_it(ckdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HPCCKPT_POLL_S", "0")
    with pytest.raises(ConfigError, match="HPCCKPT_POLL_S='0' is invalid: expected seconds from 0.5 to 600"):
        Checkpointer(ckdir)


def test_an_allocation_too_short_for_a_step_and_a_save_is_refused_with_figures(
        ckdir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    clock = Clock()
    ckdir.mkdir(parents=True)
    Figures(save_s=40.0, step_s=2.0).write(ckdir)  # an earlier allocation measured a slow save
    monkeypatch.setenv("HPCCKPT_END_TIME", str(clock.t + 50))
    monkeypatch.setattr("hpcckpt.api.process_start_time", time.time)  # started just now: the whole allocation
    with pytest.raises(RefusedExit) as exc:
        with checkpointer(ckdir, clock) as ck:
            ck.register(**tiny_state(0))
            for _ in ck.steps(10):
                raise AssertionError("no step may run")
    assert exc.value.code == EXIT_PROBLEM
    assert "50s left" in exc.value.reason and "save 40.00s" in exc.value.reason
    assert "--time" in exc.value.reason and "HPCCKPT_DEADLINE_MARGIN_S" in exc.value.reason
    assert [e["event"] for e in Ledger(ckdir).read()][-1] == "refused"


def test_an_allocation_whose_start_up_took_its_time_requeues_once_then_refuses(
        ckdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Less time left than the stop needs, but this process started 70 s ago (a loaded
    node, a slow file system): an allocation as long would have trained. It stops without
    training and requeues (nothing lost: its checkpoint is of the step it started at); a
    second such allocation in a row is refused with the start-up in the figures. Nothing is
    saved at such a stop: there is nothing trained to keep."""
    clock = Clock()
    ckdir.mkdir(parents=True)
    Figures(save_s=20.0, step_s=2.0).write(ckdir)  # lead 1.5 x 20 + 2 + 5 + 5 = 42 s
    monkeypatch.setattr("hpcckpt.api.process_start_time", lambda: time.time() - 70)
    for attempt, left in ((1, 40), (2, 10)):
        monkeypatch.setenv("HPCCKPT_END_TIME", str(clock.t + left))
        with pytest.raises((RequeueExit, RefusedExit)) as exc:
            with checkpointer(ckdir, clock) as ck:
                ck.register(**tiny_state(0))
                for _ in ck.steps(10):
                    raise AssertionError("no step may run")
        events = Ledger(ckdir).read()
        if attempt == 1:
            assert isinstance(exc.value, RequeueExit) and exc.value.code == EXIT_REQUEUE
            stop = [e for e in events if e["event"] == "stop"][-1]
            assert (stop["reason"], stop["step"], stop["committed_step"], stop["requeue"]) == ("deadline", 0, None, True)
            assert stop["final_saved"] is False and not catalog.scan(ckdir)  # nothing trained, nothing to keep
            assert _deadlines_without_progress(ckdir) == 1
        else:
            assert isinstance(exc.value, RefusedExit) and exc.value.code == EXIT_PROBLEM
            assert "two allocations in a row" in exc.value.reason
            assert "start-up took 70s" in exc.value.reason, exc.value.reason
            assert events[-1]["event"] == "refused" and _deadlines_without_progress(ckdir) == 2


def test_two_deadline_stops_in_a_row_without_progress_stop_the_job(ckdir: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    ckdir.mkdir(parents=True)
    Figures(save_s=0.05, step_s=0.01).write(ckdir)
    assert no_progress(ckdir, "deadline", progressed=False) == 1  # the previous allocation made none
    monkeypatch.setenv("HPCCKPT_END_TIME", str(clock.t + 60))
    objs = tiny_state(0)
    with pytest.raises(RefusedExit) as exc:
        with checkpointer(ckdir, clock) as ck:
            ck.register(**objs)

            def failing_save(*a: object, **k: object) -> None:
                raise OSError(28, "No space left on device")  # the final save cannot commit

            monkeypatch.setattr(ck.engine, "save", failing_save)
            for _ in ck.steps(10):
                train_step(objs)
                clock.t += 30
    assert "two allocations in a row" in exc.value.reason and "--time" in exc.value.reason
    assert _deadlines_without_progress(ckdir) == 2
    assert not [e for e in Ledger(ckdir).read() if e["event"] == "requeue"]


def test_a_stop_writes_the_figures_before_its_requeue(ckdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A change of the measured costs too small to rewrite the figures at its commit is on
    disk before the requeue (after which Slurm may end the job): the measured costs are held
    at one seam (what the policy observes), so what the file holds is exact."""
    from hpcckpt.policy import Policy
    cost = {"save": 0.004}
    monkeypatch.setattr(Policy, "observe_save", lambda self, save_s, stall_s=None, *, capture_s=0.0: (
        setattr(self, "save_cost_s", cost["save"]), setattr(self, "_measured", True)))
    monkeypatch.setattr(Policy, "observe_step", lambda self, dt: setattr(self, "step_s", 0.002))
    from hpcckpt.lifecycle.stop import Stop
    at_requeue: list[float | None] = []
    real_requeue = Stop.requeue

    def requeue(self: Stop, reason: object, committed_step: int | None) -> dict:
        at_requeue.append(Figures.read(ckdir).save_s)
        return real_requeue(self, reason, committed_step)  # type: ignore[arg-type]

    monkeypatch.setattr(Stop, "requeue", requeue)
    objs = tiny_state(0)
    with pytest.raises(RequeueExit):
        with Checkpointer(ckdir, every_steps=1) as ck:
            ck.register(**objs)
            for step in ck.steps(50):
                train_step(objs)
                if step == 5:
                    cost["save"] = 0.0044  # +10%: left for later by the commits that follow
                if step == 8:
                    os.kill(os.getpid(), signal.SIGTERM)
    assert at_requeue == [0.0044]
