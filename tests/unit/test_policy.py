"""When-to-save logic with a fast-forward clock (the scheduler side is tested on real Slurm)."""
from __future__ import annotations

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
    a.observe_save(stall_s=0.001, persist_s=3.0)  # cheap stall, slow disk: persist bound wins
    assert a.interval == 30


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
