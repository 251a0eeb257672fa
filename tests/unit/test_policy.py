"""When-to-save logic with a fast-forward clock (the scheduler side is tested on real Slurm)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import pytest

from hpcckpt.config import resolve_options
from hpcckpt.errors import ConfigError
from hpcckpt.policy import AutoInterval, Policy, StopReason


class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


@dataclass
class Res:
    start_s: float
    is_maintenance: bool = True


@dataclass
class Sched:
    """A scheduler answer table for the policy's three questions."""

    end: float | None = None
    reservations_: list[Res] = field(default_factory=list)
    state: str = "ALLOCATED"
    calls: int = 0

    def end_time(self) -> float | None:
        self.calls += 1
        return self.end

    def reservations(self) -> list[Res]:
        return self.reservations_

    def node_state(self) -> str:
        return self.state


def test_every_n_steps() -> None:
    p = Policy(every_steps=5)
    assert [s for s in range(1, 21) if p.periodic_due(s)] == [5, 10, 15, 20]
    assert not Policy(every_steps=None).periodic_due(5)


def test_auto_interval_keeps_overhead_under_bound() -> None:
    a = AutoInterval(overhead_bound=0.03)
    for _ in range(20):
        a.observe_step(0.1)
    assert a.due(10) and not a.due(9)  # first checkpoint after 10 steps of profiling
    a.observe_save(stall_s=0.06, persist_s=0.5)
    # 0.06 s stall every N steps of 0.1 s must be <= 3%: N >= 20; persist 0.5 s needs N >= 5
    assert a.interval == 20
    assert a.reason == "overhead"
    a.observe_save(stall_s=0.001, persist_s=3.0)  # cheap stall, slow disk: persist bound wins
    assert a.interval == 33 and a.reason == "persist"  # 3.0 s x 1.1 headroom / 0.1 s


def test_auto_from_options() -> None:
    o = resolve_options("/tmp/x", every_steps="auto")
    assert o.auto_interval and o.every_steps is None
    with pytest.raises(ConfigError, match="auto"):
        resolve_options("/tmp/x", every_steps="often")


def test_deadline_reread_and_rate_limited() -> None:
    clock = Clock()
    sched = Sched(end=clock.t + 3600)
    p = Policy(every_steps=None, margin_s=30, poll_s=15, clock=clock, save_cost_s=10)
    p.poll(sched)
    assert p.stop_reason() is StopReason.NONE
    p.poll(sched)
    assert sched.calls == 1  # rate limited
    sched.end = clock.t + 60  # a preemption moved the end time
    clock.t += 16
    p.poll(sched)
    assert p.stop_reason() is StopReason.DEADLINE  # 44 s left < 1.5*10 + 30 + 15


def test_maintenance_and_drain() -> None:
    clock = Clock()
    sched = Sched(reservations_=[Res(start_s=clock.t + 40)])
    p = Policy(every_steps=None, clock=clock, save_cost_s=5)
    p.poll(sched)
    assert p.stop_reason() is StopReason.MAINTENANCE
    sched2 = Sched(state="MIXED+DRAIN")
    p2 = Policy(every_steps=None, clock=clock)
    p2.poll(sched2)
    assert p2.stop_reason() is StopReason.DRAIN


def test_scheduler_errors_do_not_stop_training() -> None:
    class Broken(Sched):
        def end_time(self) -> float | None:
            raise RuntimeError("slurmctld unreachable")

    p = Policy(every_steps=None)
    p.poll(Broken())
    assert p.stop_reason() is StopReason.NONE


def test_auto_interval_grows_when_the_disk_cannot_absorb_a_checkpoint_per_interval() -> None:
    # The GPU-node figures of issue 10: 146 ms steps, 16 ms stall, persists of 2.1-2.7 s.
    a = AutoInterval(overhead_bound=0.03)
    for _ in range(10):
        a.observe_step(0.146)
    a.observe_save(stall_s=0.016, persist_s=2.1)
    first = a.interval
    assert first * 0.146 >= 2.1 and a.reason == "persist"
    a.observe_save(stall_s=0.016, persist_s=2.7)  # the disk got slower: the interval follows at once
    assert a.interval * 0.146 >= 2.7 * 1.1 and a.interval > first
    # ...and the overhead stays within the bound at the chosen interval.
    assert a.stall_s is not None and a.stall_s / (a.interval * 0.146) <= 0.03
    for _ in range(20):
        a.observe_save(stall_s=0.016, persist_s=0.2)  # a fast disk again: back to the overhead bound
    assert a.reason == "overhead" and a.interval == 4  # ceil(0.016 / (0.03 * 0.146))
    report = a.report()
    assert report["interval"] == 4 and report["reason"] == "overhead" and report["step_s"] == pytest.approx(0.146)


def test_policy_reports_the_auto_interval_only_when_auto() -> None:
    assert Policy(every_steps=10).report() == {}
    p = Policy(every_steps=None, auto=AutoInterval())
    assert p.report()["auto"]["interval"] == 10 and p.report()["auto"]["reason"] == "profiling"


# --- deadlines from measurements (issue 22 item 6, issue 27 item 3) ------------------------------

def test_a_warning_long_before_the_end_waits_for_the_deadline() -> None:
    clock = Clock()
    sched = Sched(end=clock.t + 200)
    p = Policy(every_steps=None, margin_s=5, clock=clock, save_cost_s=0.02)
    p.observe_step(0.5)
    why = p.defer_warning(sched)
    assert why is not None and "200s before the end time" in why and "margin 5s" in why
    assert p.stop_reason() is StopReason.NONE
    clock.t += 200 - p.lead_s() - 0.1
    assert p.stop_reason() is StopReason.NONE
    clock.t += 0.2  # within the lead: 1.5 x save + a step + the margin before the end
    assert p.stop_reason() is StopReason.DEADLINE
    assert p.lead_s() == pytest.approx(1.5 * 0.02 + 0.5 + p.exit_s + 5)


@pytest.mark.parametrize("end, window, why", [(None, 300, "no end time known"), (5000, 300, "operator's request"),
                                              (7, 300, "within the lead already")])
def test_a_warning_that_cannot_wait_stops_at_once(end: float | None, window: float, why: str) -> None:
    clock = Clock()
    sched = Sched(end=None if end is None else clock.t + end)
    p = Policy(every_steps=None, margin_s=5, clock=clock, save_cost_s=2, warning_window_s=window)
    assert p.defer_warning(sched) is None, why


def test_an_end_time_moved_earlier_stops_at_the_next_step() -> None:
    clock = Clock()
    sched = Sched(end=clock.t + 250)
    p = Policy(every_steps=None, margin_s=5, clock=clock, save_cost_s=0.02)
    assert p.defer_warning(sched) is not None
    sched.end = clock.t + 200  # a preemption with GraceTime: still more than the lead away
    clock.t += 16
    p.poll(sched)
    assert p.stop_reason() is StopReason.DEADLINE


def _shortened(clock: Clock) -> tuple[Sched, Policy]:
    """A policy whose job's limit was just shortened to 3 h (8 h before) and polled."""
    sched = Sched(end=clock.t + 8 * 3600)
    p = Policy(every_steps=None, margin_s=5, clock=clock, save_cost_s=0.02, poll_s=15)
    p.poll(sched, force=True)
    sched.end = clock.t + 3 * 3600  # scontrol update TimeLimit: 3 h left
    clock.t += 16
    p.poll(sched)
    return sched, p


def test_an_end_time_pulled_in_hours_ahead_is_a_shortened_limit_not_a_preemption() -> None:
    """The one rule of every mode (lifecycle.timing.pulled_in_is_preemption): an operator's
    shortened limit hours ahead trains on until the stop's lead before the new end (a
    time-limit stop); a preemption after it (pulled in to near now) stops at the next step."""
    clock = Clock()
    sched, p = _shortened(clock)
    assert p.stop_reason() is StopReason.NONE and not p.end_moved_earlier
    clock.t = sched.end - p.lead_s() + 1  # within the lead before the new end
    assert p.stop_reason() is StopReason.DEADLINE and not p.end_moved_earlier
    sched, p = _shortened(clock)
    clock.t += 600
    sched.end = clock.t + 120  # a preemption with a 2-minute GraceTime
    clock.t += 16
    p.poll(sched)
    assert p.stop_reason() is StopReason.DEADLINE and p.end_moved_earlier


def test_measured_costs_are_kept_across_requeues(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from hpcckpt.policy import FIGURES, Figures
    assert Figures.read(tmp_path) == Figures()
    Figures(save_s=0.02, step_s=0.4).write(tmp_path)
    p = Policy(every_steps=None, margin_s=5)
    p.seed(Figures.read(tmp_path))
    assert (p.save_cost_s, p.step_s) == (0.02, 0.4)
    (tmp_path / FIGURES).write_text("{not json")
    assert Figures.read(tmp_path) == Figures()  # damaged: measured again, never an error


def test_figures_are_rewritten_when_they_move_not_at_every_commit(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from hpcckpt.policy import REWRITE_S, Figures
    f = Figures(save_s=0.010, step_s=0.006)
    assert not f.unwritten  # nothing written by this process yet: nothing owed
    assert f.write_if_moved(tmp_path, now=100.0)  # the first one is written
    f.save_s = 0.012  # +20%: noise of the worst recent save
    assert not f.write_if_moved(tmp_path, now=101.0) and f.unwritten
    assert Figures.read(tmp_path).save_s == 0.010
    f.save_s = 0.0130  # +30% on what was written: the next allocation must stop earlier
    assert f.write_if_moved(tmp_path, now=102.0) and Figures.read(tmp_path).save_s == 0.013
    f.step_s = 0.0029  # under half: written at once
    assert f.write_if_moved(tmp_path, now=103.0) and Figures.read(tmp_path).step_s == 0.0029
    f.step_s = 0.0031  # a small change waits ...
    assert not f.write_if_moved(tmp_path, now=103.0 + REWRITE_S - 1)
    assert f.write_if_moved(tmp_path, now=103.0 + REWRITE_S)  # ... until it is REWRITE_S old
    f.save_s = 0.05  # a save that slowed down a lot: written at once
    assert f.write_if_moved(tmp_path, now=200.0) and Figures.read(tmp_path).save_s == 0.05
    assert not f.write_if_moved(tmp_path, now=10_000.0) and not f.unwritten  # nothing changed
    assert not f.write_if_moved(tmp_path, now=200.0, any_change=True)  # ... not even for a stop
    f.save_s = 0.0131
    assert f.write_if_moved(tmp_path, now=200.0, any_change=True)  # a stop writes any change


def test_a_checkpointer_saving_every_step_rewrites_its_figures_now_and_then(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """Real saves at every step; the measured costs are held steady at one seam (what the
    policy observes), so that which commits rewrite the figures is exact: the first, then
    none while nothing moves, and close() writes nothing more."""
    import torch

    from hpcckpt import Checkpointer
    from hpcckpt.policy import FIGURES, Figures, Policy
    monkeypatch.setattr(Policy, "observe_save", lambda self, save_s, stall_s=None, *, capture_s=0.0: (
        setattr(self, "save_cost_s", 0.004), setattr(self, "_measured", True)))
    monkeypatch.setattr(Policy, "observe_step", lambda self, dt: setattr(self, "step_s", 0.002))
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ck = Checkpointer(dir=tmp_path / "ck", engine="concurrent", every_steps=1, keep=2)
    ck.register(model=model, optimizer=opt)
    inodes = set()
    for _step in ck.steps(60):
        opt.zero_grad()
        model(torch.randn(4, 8)).square().mean().backward()
        opt.step()
        if (tmp_path / "ck" / FIGURES).exists():
            inodes.add(os.stat(tmp_path / "ck" / FIGURES).st_ino)  # each write is a new file renamed in
    commits = [e for e in ck.ledger.read() if e["event"] == "commit"]
    ck.close()
    assert len(commits) >= 60 and len(inodes) == 1, (len(commits), len(inodes))
    kept = Figures.read(tmp_path / "ck")
    assert (kept.save_s, kept.step_s) == (0.004, 0.002)
    assert os.stat(tmp_path / "ck" / FIGURES).st_ino in inodes  # close() had nothing left to write


def test_the_first_measured_save_replaces_the_assumed_cost() -> None:
    p = Policy(every_steps=None)  # assumes 10 s until a save is measured
    p.observe_save(0.02)
    assert p.save_cost_s == 0.02  # not 8 s, decaying from the assumption
    p.observe_save(0.5)
    p.observe_save(0.01)
    assert p.save_cost_s == pytest.approx(0.4)  # then the worst recent one, decaying


def test_the_save_cost_includes_the_state_capture() -> None:
    # A slow state_dict() (before the engine's timed write) is part of what the final save needs.
    p = Policy(every_steps=None)
    p.observe_save(0.02, 20.02, capture_s=20.0)
    assert p.save_cost_s == pytest.approx(20.02)



def test_the_shared_warning_rule_and_the_bounded_lead() -> None:
    from hpcckpt.lifecycle.timing import bounded_lead_s, warning_wait_s

    assert warning_wait_s(100.0, 30.0, window_s=300.0) == 70.0
    assert warning_wait_s(20.0, 30.0, window_s=300.0) is None  # within the lead: now
    assert warning_wait_s(400.0, 30.0, window_s=300.0) is None  # no time-limit warning: now
    assert warning_wait_s(100.0, 30.0, window_s=300.0, moved_earlier=True) is None
    assert warning_wait_s(None, 30.0, window_s=300.0) is None
    assert bounded_lead_s(180.0, allocation_s=4 * 3600.0, need_s=15.0) == 180.0
    assert bounded_lead_s(180.0, allocation_s=120.0, need_s=15.0) == 30.0  # --time-min granted less
    assert bounded_lead_s(180.0, allocation_s=40.0, need_s=15.0) == 15.0  # never below the need
    assert bounded_lead_s(180.0, allocation_s=None, need_s=200.0) == 200.0
