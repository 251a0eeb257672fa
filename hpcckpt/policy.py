"""When to checkpoint: every N steps, on a recorded signal, before the job's end
time (minus the measured save cost), before a maintenance reservation, or when
the node is being drained.

Scheduler queries are rate-limited (they cost a call into slurmctld) and run on
the coordinator only; ranks then agree on the outcome.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Callable

log = logging.getLogger("hpcckpt.policy")


class StopReason(IntEnum):
    """Ordered by urgency: ranks agree on the maximum."""

    NONE = 0
    DRAIN = 1
    MAINTENANCE = 2
    DEADLINE = 3
    SIGNAL = 4

    @property
    def cause(self) -> str:
        return {StopReason.SIGNAL: "signal", StopReason.DEADLINE: "time_limit",
                StopReason.MAINTENANCE: "maintenance", StopReason.DRAIN: "maintenance",
                StopReason.NONE: "done"}[self]


@dataclass
class Policy:
    every_steps: int | None
    margin_s: float = 30.0
    poll_s: float = 15.0
    clock: Callable[[], float] = time.time
    save_cost_s: float = 10.0  # replaced by measured save times
    _last_poll: float = field(default=float("-inf"), init=False)
    _end_time: float | None = field(default=None, init=False)
    _maint_start: float | None = field(default=None, init=False)
    _draining: bool = field(default=False, init=False)

    def periodic_due(self, step: int) -> bool:
        return self.every_steps is not None and step > 0 and step % self.every_steps == 0

    def observe_save(self, save_s: float) -> None:
        # Keep the worst recent cost: the final save must fit before the deadline.
        self.save_cost_s = max(save_s, 0.8 * self.save_cost_s)

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
