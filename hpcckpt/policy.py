"""When to checkpoint: every N steps, on a recorded signal, before the job's end
time (minus the measured save cost), before a maintenance reservation, or when
the node is being drained.

Scheduler queries are rate-limited (they cost a call into slurmctld) and run on
the coordinator only; ranks then agree on the outcome.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Callable

from .cluster.base import Cause

log = logging.getLogger("hpcckpt.policy")


class StopReason(IntEnum):
    """Ordered by urgency: ranks agree on the maximum."""

    NONE = 0
    DRAIN = 1
    MAINTENANCE = 2
    DEADLINE = 3
    SIGNAL = 4

    @property
    def cause(self) -> Cause:
        """The ``Cause`` this stop is charged to (per-cause requeue budgets, history)."""
        return {StopReason.SIGNAL: Cause.SIGNAL, StopReason.DEADLINE: Cause.TIME_LIMIT,
                StopReason.MAINTENANCE: Cause.MAINTENANCE, StopReason.DRAIN: Cause.MAINTENANCE,
                StopReason.NONE: Cause.DONE}[self]


@dataclass
class AutoInterval:
    """CheckFreq-style interval: profile step time and checkpoint cost online and pick
    the smallest interval that keeps the visible overhead under ``overhead_bound``,
    adapting as costs change.

    Two bounds, the larger wins:

    - ``overhead``: the stall training sees per save (``save()`` + the optimizer
      pre-hook's wait) spread over the interval stays under ``overhead_bound``;
    - ``persist``: a background persist must end before the next save starts, with
      ``persist_headroom`` to spare. When the disk cannot absorb a checkpoint per
      interval (persist time > the interval's compute time), the interval grows
      instead of saves queueing behind each other (which training would see as a
      stall far above the bound).

    ``reason`` says which bound chose ``interval``; each change is logged and
    ``report()`` gives the figures for the ledger.
    """

    overhead_bound: float = 0.03
    first_after_steps: int = 10
    max_steps: int = 10_000
    persist_headroom: float = 1.1
    step_s: float | None = None
    stall_s: float | None = None
    persist_s: float = 0.0
    interval: int = 0
    reason: str = "profiling"

    def observe_step(self, dt: float) -> None:
        self.step_s = dt if self.step_s is None else 0.9 * self.step_s + 0.1 * dt

    def observe_save(self, stall_s: float, persist_s: float) -> None:
        self.stall_s = stall_s if self.stall_s is None else 0.7 * self.stall_s + 0.3 * stall_s
        # A slower persist counts at once (the next save must not queue behind it); a faster
        # one lowers the estimate gradually (one fast write does not make a fast disk).
        self.persist_s = max(persist_s, 0.7 * self.persist_s + 0.3 * persist_s)
        self._update()

    def _update(self) -> None:
        if self.step_s is None or self.stall_s is None or self.step_s <= 0:
            return
        by_overhead = max(1, math.ceil(self.stall_s / (self.overhead_bound * self.step_s)))
        by_persist = max(1, math.ceil(self.persist_s * self.persist_headroom / self.step_s))
        interval = int(min(self.max_steps, max(by_overhead, by_persist)))
        reason = "persist" if by_persist > by_overhead else "overhead"
        if interval != self.interval or reason != self.reason:
            log.info("hpcckpt: auto interval %d steps (%s bound: step %.3fs, stall %.3fs per save, "
                     "persist %.3fs; overhead bound %.1f%%)", interval, reason, self.step_s, self.stall_s,
                     self.persist_s, 100 * self.overhead_bound)
        self.interval, self.reason = interval, reason

    def due(self, steps_since_save: int) -> bool:
        return steps_since_save >= (self.interval or self.first_after_steps)

    def report(self) -> dict[str, Any]:
        """The chosen interval and the figures behind it (JSON-ready)."""
        def r(x: float | None) -> float | None:
            return None if x is None else round(x, 6)
        return {"interval": self.interval or self.first_after_steps, "reason": self.reason,
                "step_s": r(self.step_s), "stall_s": r(self.stall_s), "persist_s": r(self.persist_s)}


@dataclass
class Policy:
    every_steps: int | None
    auto: AutoInterval | None = None
    margin_s: float = 30.0
    poll_s: float = 15.0
    clock: Callable[[], float] = time.time
    save_cost_s: float = 10.0  # replaced by measured save times
    _last_poll: float = field(default=float("-inf"), init=False)
    _end_time: float | None = field(default=None, init=False)
    _maint_start: float | None = field(default=None, init=False)
    _draining: bool = field(default=False, init=False)

    _last_save_step: int = field(default=0, init=False)

    def periodic_due(self, step: int) -> bool:
        """This rank's wish to save at ``step``. With ``auto`` it rests on this rank's own timings,
        so ranks may differ: the Checkpointer saves when any rank wants to (one collective at the
        boundary, with the stop reason), and every rank then records ``saved_at``."""
        if self.auto is not None:
            return step > self._last_save_step and self.auto.due(step - self._last_save_step)
        return self.every_steps is not None and step > 0 and step % self.every_steps == 0

    def saved_at(self, step: int) -> None:
        self._last_save_step = step

    def observe_step(self, dt: float) -> None:
        if self.auto is not None:
            self.auto.observe_step(dt)

    def observe_save(self, save_s: float, stall_s: float | None = None) -> None:
        # Keep the worst recent cost: the final save must fit before the deadline.
        self.save_cost_s = max(save_s, 0.8 * self.save_cost_s)
        if self.auto is not None:
            self.auto.observe_save(save_s if stall_s is None else stall_s, save_s)

    def report(self) -> dict[str, Any]:
        """``{"auto": AutoInterval.report()}`` with ``every_steps="auto"``, else ``{}`` (for the ledger)."""
        return {"auto": self.auto.report()} if self.auto is not None else {}

    def poll(self, cluster: Any) -> None:
        """Refresh end time, maintenance and drain state (rate limited)."""
        now = self.clock()
        if now - self._last_poll < self.poll_s:
            return
        self._last_poll = now
        try:
            self._end_time = cluster.end_time()
            starts = [r.start_s for r in cluster.reservations() if r.is_maintenance]
            self._maint_start = min(starts) if starts else None
            self._draining = "DRAIN" in (cluster.node_state() or "").upper()
        except Exception as exc:  # a scheduler hiccup must not kill training
            log.warning("hpcckpt: could not query the scheduler (%s); keeping the previous answers", exc)

    def stop_reason(self) -> StopReason:
        now = self.clock()
        lead = self.save_cost_s * 1.5 + self.margin_s + self.poll_s
        if self._end_time is not None and self._end_time - now <= lead:
            return StopReason.DEADLINE
        if self._maint_start is not None and self._maint_start - now <= lead:
            return StopReason.MAINTENANCE
        if self._draining:
            return StopReason.DRAIN
        return StopReason.NONE
