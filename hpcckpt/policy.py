"""When to checkpoint: every N steps, on a recorded signal, before the job's end
time (minus the measured save cost), before a maintenance reservation, or when
the node is being drained.

Scheduler queries are rate-limited (they cost a call into slurmctld) and run on
the coordinator only; ranks then agree on the outcome. In a training process they run
off the training thread (``Policy(background=True)``): a slow or frozen controller never
makes a step wait; the step reads the last answer.
"""
from __future__ import annotations

import functools
import json
import logging
import math
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .cluster.base import Cause
from .fsio import atomic_write, write_all
from .lifecycle.causes import stop_cause
from .lifecycle.supervise import EndTimeWatch
from .lifecycle.timing import pulled_in_is_preemption, warning_wait_s
from .store.commit import read_regular

if TYPE_CHECKING:
    from .cluster.base import Cluster

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
        return stop_cause(self.name.lower(), default=Cause.DONE)  # NONE: no interruption


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


# Signals a scheduler sends as an early warning (``--signal=USR2@N``): they may come long
# before the deadline. TERM, INT, HUP, QUIT and XCPU mean the end is now.
WARNING_SIGNALS = frozenset({signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM})
FIGURES = ".hpcckpt.figures.json"  # the measured costs, kept across requeues


@dataclass
class Figures:
    """What earlier allocations measured, read by the next one (``<dir>/.hpcckpt.figures.json``).

    ``save_s``: the worst recent save; ``step_s``: a step. (Allocations that ended without
    progress are counted by the one no-progress guard, ``lifecycle.budget``.)
    """

    save_s: float | None = None
    step_s: float | None = None
    # What this process last wrote, and when (``write_if_moved``).
    _written: tuple[float | None, float | None] | None = field(default=None, repr=False, compare=False)
    _written_at: float = field(default=0.0, repr=False, compare=False)

    @classmethod
    def read(cls, root: Path) -> Figures:
        try:
            raw = json.loads(read_regular(root / FIGURES, 4096))  # never a FIFO or a link
            return cls(save_s=_pos(raw.get("save_s")), step_s=_pos(raw.get("step_s")))
        except (OSError, ValueError, TypeError, AttributeError):
            return cls()  # none yet, or unreadable: measured again

    def _values(self) -> tuple[float | None, float | None]:
        return self.save_s, self.step_s

    def write(self, root: Path, *, now: float | None = None) -> None:
        """Atomically (a reader never sees half a file), private (0600), without an fsync on the
        step path: a crash only loses figures that the next allocation measures again.
        ``now``: the monotonic time recorded as this write's (``write_if_moved``)."""
        data = json.dumps({"save_s": self.save_s, "step_s": self.step_s})
        try:
            atomic_write(root / FIGURES, data, mode=0o600, durable=False)
            self._written, self._written_at = self._values(), time.monotonic() if now is None else now
        except OSError as exc:
            log.warning("hpcckpt: could not keep the measured costs in %s (%s)", root / FIGURES, exc)

    def write_if_moved(self, root: Path, *, now: float | None = None, any_change: bool = False) -> bool:
        """``write`` unless the file already says about the same: a figure rose by more than
        ``MOVED`` or fell to under half since this process last wrote it, or any change is
        ``REWRITE_S`` old. A commit at every step then rewrites the
        file now and then, not at each commit (an open, a write and a rename on the training
        thread: 0.2 ms a commit on a local disk, more on a shared file system). What is not written yet is at most a small
        drift that the next allocation measures again. ``any_change``: write whatever changed
        (the last commit before a stop). True when it wrote."""
        cur = self._values()
        last = self._written
        if cur == last:
            return False
        now = time.monotonic() if now is None else now
        if (any_change or last is None or _moved(cur[0], last[0]) or _moved(cur[1], last[1])
                or now - self._written_at >= REWRITE_S):
            self.write(root, now=now)
            return True
        return False

    @property
    def unwritten(self) -> bool:
        """Whether the figures changed since this process last wrote them (False if it never did)."""
        return self._written is not None and self._values() != self._written


MOVED = 0.25  # Figures.write_if_moved: a relative rise that is written at once
REWRITE_S = 30.0  # ... and how old any other change may get before it is written


def _moved(new: float | None, old: float | None) -> bool:
    """A rise by more than ``MOVED`` (an underestimated save would make the next allocation
    stop too late), or a fall to under half (a saving that large is worth keeping at once)."""
    if new is None or old is None:
        return new is not old
    return new > old * (1 + MOVED) or new < old * 0.5


def _pos(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) and x > 0 else None


@dataclass
class Policy:
    every_steps: int | None
    auto: AutoInterval | None = None
    margin_s: float = 30.0
    poll_s: float = 15.0
    clock: Callable[[], float] = time.time
    save_cost_s: float = 10.0  # replaced by measured save times (kept across requeues: Figures)
    step_s: float | None = None  # measured
    warning_window_s: float = 300.0  # a warning with at most this much time left is the time-limit one
    exit_s: float = 5.0  # after the final save: the requeue call and the exit of every rank
    _measured: bool = field(default=False, init=False)  # save_cost_s is a measurement, not the default
    _moved_earlier: bool = field(default=False, init=False)
    _last_save_step: int = field(default=0, init=False)
    # The scheduler is read by the one end-time watcher (lifecycle.supervise.EndTimeWatch); with
    # ``background`` on a thread of its own: a step reads the last answer, never waits for one.
    background: bool = False
    watch: EndTimeWatch | None = field(default=None, init=False, repr=False)
    _watched: Any = field(default=None, init=False, repr=False)  # the cluster ``watch`` reads

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
        self.step_s = dt if self.step_s is None else max(dt, 0.9 * self.step_s + 0.1 * dt)
        if self.auto is not None:
            self.auto.observe_step(dt)

    def observe_save(self, save_s: float, stall_s: float | None = None, *, capture_s: float = 0.0) -> None:
        # Keep the worst recent cost: the final save must fit before the deadline. The first
        # measurement replaces the assumed default instead of decaying from it. The final save
        # captures the state (state_dict()) before the engine writes it: both must fit.
        cost = save_s + capture_s
        self.save_cost_s = max(cost, 0.8 * self.save_cost_s) if self._measured else cost
        self._measured = True
        if self.auto is not None:
            self.auto.observe_save(save_s if stall_s is None else stall_s, save_s)

    @property
    def measured(self) -> bool:
        """Whether ``save_cost_s`` is a measured save (this allocation's or an earlier one's)."""
        return self._measured

    def assume_save(self, save_s: float) -> None:
        """The save's cost as estimated before any save was measured (``estimate_save_s``, the
        first allocation): used instead of the assumed default until the first measurement,
        which replaces it whatever it says (``observe_save``)."""
        if not self._measured and math.isfinite(save_s) and save_s > 0:
            self.save_cost_s = save_s

    def seed(self, figures: Figures) -> None:
        """Start from what earlier allocations measured instead of the defaults."""
        if figures.save_s is not None:
            self.save_cost_s = figures.save_s
            self._measured = True
        if figures.step_s is not None and self.step_s is None:
            self.step_s = figures.step_s

    def lead_s(self) -> float:
        """How long before the end time the stop must come: the final save (x1.5), the step
        that may run before the stop is noticed, the requeue and exit, and the margin."""
        return self.save_cost_s * 1.5 + (self.step_s or 0.0) + self.exit_s + self.margin_s

    def lead_figures(self) -> str:
        return (f"{self.lead_s():.1f}s = 1.5 x save {self.save_cost_s:.2f}s + step {self.step_s or 0.0:.2f}s + "
                f"requeue and exit {self.exit_s:.0f}s + margin {self.margin_s:.0f}s")

    def report(self) -> dict[str, Any]:
        """``{"auto": AutoInterval.report()}`` with ``every_steps="auto"``, else ``{}`` (for the ledger)."""
        return {"auto": self.auto.report()} if self.auto is not None else {}

    def poll(self, cluster: Cluster, *, force: bool = False) -> None:
        """Refresh end time, maintenance and drain state (rate limited unless ``force``).

        Through the end-time watcher: with ``background`` its reads run on a thread of their own,
        one at a time, and this call takes the answer the last one brought: a step never waits on
        the scheduler. A forced poll (a decision that needs the end time now: a warning signal,
        the start) waits for a fresh answer at most ``FORCED_WAIT_S``, then goes on with the last one."""
        watch = self._watch_of(cluster)
        watch.poll_s = self.poll_s
        moved = watch.refresh(wait_s=FORCED_WAIT_S) if force else watch.moved()
        if force and not watch.answered():
            log.warning("hpcckpt: the scheduler did not answer within %.0fs; going on with its last answers",
                        FORCED_WAIT_S)
        if not moved:
            return
        left = self.time_left()
        if pulled_in_is_preemption(left):
            log.warning("hpcckpt: the job's end time moved %.0fs earlier, to %s from now: a preemption; "
                        "stopping at the next step", watch.moved_s, "?" if left is None else f"{left:.0f}s")
            self._moved_earlier = True
        else:
            log.warning("hpcckpt: the job's end time moved %.0fs earlier, to %.0fs from now: a shortened time "
                        "limit, not a preemption; the stop comes %.0fs before the new end", watch.moved_s, left,
                        self.lead_s())

    def _watch_of(self, cluster: Cluster) -> EndTimeWatch:
        if self.watch is None or self._watched is not cluster:
            self.watch = EndTimeWatch(cluster.end_time, poll_s=self.poll_s, clock=self.clock,
                                      background=self.background, also=functools.partial(_maint_and_drain, cluster),
                                      on_error=_query_failed)
            self._watched = cluster
        return self.watch

    @property
    def _end_time(self) -> float | None:
        return None if self.watch is None else self.watch.end

    @property
    def _maint_start(self) -> float | None:
        return None if self.watch is None or self.watch.extra is None else self.watch.extra[0]

    @property
    def _draining(self) -> bool:
        return self.watch is not None and self.watch.extra is not None and self.watch.extra[1]

    @property
    def end_moved_earlier(self) -> bool:
        """The job's end time was pulled in to near now while it ran (a GraceTime preemption;
        ``lifecycle.timing.pulled_in_is_preemption``), not a shortened limit."""
        return self._moved_earlier

    def time_left(self) -> float | None:
        return None if self._end_time is None else self._end_time - self.clock()

    def stop_reason(self) -> StopReason:
        now = self.clock()
        lead = self.lead_s()
        if self._end_time is not None and (self._moved_earlier or self._end_time - now <= lead):
            return StopReason.DEADLINE
        if self._maint_start is not None and self._maint_start - now <= lead + self.poll_s:
            return StopReason.MAINTENANCE
        if self._draining:
            return StopReason.DRAIN
        return StopReason.NONE

    def defer_warning(self, cluster: Cluster) -> str | None:
        """A warning signal arrived: why it may wait for the deadline, or None to stop now.

        It waits when the end time is known, still further away than the stop's lead, and
        no further than ``warning_window_s`` (a scheduler's time-limit warning; a warning
        with more time left is taken for an operator's request). The deadline then stops
        the job in time; a preemption (the end time moves earlier) or a TERM stops it at
        the next step.
        """
        self.poll(cluster, force=True)
        left = self.time_left()
        if warning_wait_s(left, self.lead_s(), window_s=self.warning_window_s,
                          moved_earlier=self._moved_earlier) is None:
            return None
        return (f"{left:.0f}s before the end time: the stop is scheduled {self.lead_figures()} before it; "
                "a preemption or TERM still stops at the next step")


FORCED_WAIT_S = 10.0  # Policy.poll(force=True) in the background: how long a decision waits for Slurm

# The first allocation's estimate of its save (``estimate_save_s``): a probe file of the state's size,
# at least PROBE_MIN_BYTES (a write's fixed costs show) and at most PROBE_MAX_BYTES (the rate is
# measured; a bigger state is scaled from it).
PROBE_MIN_BYTES = 1 << 20
PROBE_MAX_BYTES = 64 << 20
PROBE_NAME = ".hpcckpt.probe"


def estimate_save_s(root: Path, state_bytes: int, *,
                    clock: Callable[[], float] = time.monotonic) -> tuple[float, float]:
    """(seconds, bytes per second): what a save of ``state_bytes`` should take in ``root``,
    measured: a probe file of the state's size (within ``PROBE_MIN_BYTES`` and ``PROBE_MAX_BYTES``)
    written, fsynced and removed in ``root`` (opened as a directory, the file created in it with
    ``O_EXCL|O_NOFOLLOW``, private), and the directory fsynced twice, as a commit does (its
    manifest and renames). The write's time scales with the state beyond the probe's size; the
    directory's fsyncs are added once more for the manifest's and the commit's own writes.
    For the first allocation, which has no save measured yet (``Policy.assume_save``); an
    OSError if the directory cannot be written."""
    size = max(PROBE_MIN_BYTES, min(PROBE_MAX_BYTES, int(state_bytes)))
    block = os.urandom(min(size, 1 << 20))  # not zeros: a compressing file system would not write them
    name = f"{PROBE_NAME}-{os.getpid()}-{os.urandom(4).hex()}"
    dfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        t0 = clock()
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
        try:
            left = size
            while left > 0:
                chunk = block if left >= len(block) else block[:left]
                write_all(fd, chunk)
                left -= len(chunk)
            os.fsync(fd)
        finally:
            os.close(fd)
        write_s = clock() - t0
        t1 = clock()
        try:
            os.unlink(name, dir_fd=dfd)
        finally:
            os.fsync(dfd)
        dir_s = clock() - t1
    finally:
        os.close(dfd)
    write_s = max(write_s, 1e-6)
    rate = size / write_s
    return write_s * max(1.0, state_bytes / size) + 2 * dir_s, rate


def _maint_and_drain(cluster: Cluster) -> tuple[float | None, bool]:
    """What the policy asks the scheduler besides the end time, at each of the watcher's reads:
    the start of the first maintenance reservation overlapping the job, and whether the node drains."""
    starts = [r.start_s for r in cluster.reservations() if r.is_maintenance]
    return (min(starts) if starts else None), "DRAIN" in (cluster.node_state() or "").upper()


def _query_failed(exc: Exception) -> None:
    log.warning("hpcckpt: could not query the scheduler (%s); keeping the previous answers", exc)
