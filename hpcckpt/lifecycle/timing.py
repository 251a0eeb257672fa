"""When a supervised command's stop comes, and why: the timing every stop shares.

The rules are said once here, for the in-process ``Policy`` and the supervisors around a
command (``hpcckpt run``):

- ``bounded_lead_s``: the lead a stop takes before the end time: the batch script's
  ``--signal`` lead, at most a quarter of the allocation (``--time-min`` may grant less time
  than the lead), never less than what the final save or dump is measured to need;
- ``warning_wait_s``: how long the stop an early time-limit warning asks for may wait
  (slurmctld's coarse tick delivers ``B:USR2@LEAD`` up to a minute before LEAD);
- ``pulled_in_is_preemption``: an end time just pulled in to near now (``near_s``) is a
  preemption (a stop at once), pulled in further a shortened limit (the stop comes at the lead
  before the new end): the one rule of the in-process ``Policy`` and the supervisors;
- ``StopTiming``: a supervisor's reading of the end time (through the one end-time watcher,
  ``supervise.EndTimeWatch``) by that rule; lengthened again the plan moves with it; an early
  warning waits for its lead.

What the stop costs comes in as a value (``need_s``): this module imports no mode.
"""
from __future__ import annotations

import signal
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from .supervise import EndTimeWatch, end_poll_s

if TYPE_CHECKING:
    from ..cluster.base import Cluster
    from .ledger import Ledger

SIGNAL_TICK_S = 60.0  # slurmctld sends --signal up to this much earlier than asked
# Without a --lead-s: an end time pulled in to at most this far from now is a preemption's grace.
PREEMPTION_WINDOW_S = 600.0


def near_s(lead_s: float | None) -> float:
    """How close to now an end time pulled in is a preemption (its GraceTime), and a warning
    the time-limit one: the ``--signal`` lead plus slurmctld's tick; ``PREEMPTION_WINDOW_S``
    without a lead (the in-process run's, whose lead is measured, not given)."""
    return (lead_s + SIGNAL_TICK_S) if lead_s is not None else PREEMPTION_WINDOW_S


def pulled_in_is_preemption(left_s: float | None, *, lead_s: float | None = None) -> bool:
    """An end time just pulled in to ``left_s`` from now: a preemption when within
    ``near_s(lead_s)`` (or unknown): stop at once, the cause is preemption. Further away it is
    a shortened time limit (an operator's ``scontrol update TimeLimit``): no stop now, the stop
    comes at the lead before the new end."""
    return left_s is None or left_s <= near_s(lead_s)


def warning_wait_s(left_s: float | None, lead_s: float, *, window_s: float,
                   moved_earlier: bool = False) -> float | None:
    """How long the stop a time-limit warning asks for may wait: ``left_s - lead_s`` when the
    end time is known, was not pulled in, and is more than ``lead_s`` but at most ``window_s``
    away (further is no time-limit warning: an operator's request); None: stop now. The one
    rule of the in-process Policy and the CRIU supervisor."""
    if left_s is None or moved_earlier or left_s <= lead_s or left_s > window_s:
        return None
    return left_s - lead_s


def bounded_lead_s(lead_s: float, *, allocation_s: float | None, need_s: float) -> float:
    """The lead a stop takes before the end time: ``lead_s`` (a template's ``--signal`` lead),
    at most a quarter of the allocation (``--time-min`` may grant less time than the lead: the
    templates' rule), never less than ``need_s`` (what the final save or dump is measured to need)."""
    if allocation_s is not None and allocation_s > 0:
        lead_s = min(lead_s, allocation_s / 4)
    return max(lead_s, need_s)


class StopTiming:
    """A supervisor's stop timing: the end time watched, the stop planned before it.

    ``lead_s``: the batch script's ``--signal`` lead (None: a warning stops at once);
    ``need_s``: what the stop is measured to need (a CRIU dump and its commit), asked when a
    lead is computed; ``what``: the stop's name in what is said ("dump"); ``source``: the
    ``signal`` records' source; ``progress``: how far the command has got (seconds), for them.
    """

    def __init__(self, *, lead_s: float | None, need_s: Callable[[], float], log: Callable[[str], None],
                 ledger: Ledger, what: str, source: str, progress: Callable[[], float]) -> None:
        self.lead_opt, self._need_s, self.log, self.ledger = lead_s, need_s, log, ledger
        self.what, self.source, self._progress = what, source, progress
        self.watch: EndTimeWatch | None = None
        self.stop_at: float | None = None  # a planned time-limit stop (monotonic)
        self.shortened = False  # the end time was pulled in too far ahead for a preemption: a shorter limit
        self.began = time.time()  # about when this allocation started (the batch shell exec's us)

    def watch_end(self, cluster: Cluster, poll_s: float) -> None:
        """Under a scheduler that can move the end time: read it every ``poll_s`` (0: never)."""
        if poll_s > 0 and cluster.name != "local":
            self.watch = EndTimeWatch(cluster.end_time,
                                      poll_s=end_poll_s(cluster, poll_s, log=self.log, ledger=self.ledger))

    # -- between signals --------------------------------------------------------------
    def preempted(self) -> bool:
        """The end time was just pulled in to near now: a preemption (GraceTime), stop now."""
        return self.watch is not None and self.watch.moved() and self.pulled_in_is_preemption()

    def planned_due(self) -> bool:
        """The planned time-limit stop is due (and the limit was not lengthened meanwhile)."""
        if self.stop_at is None or time.monotonic() < self.stop_at:
            return False
        self.stop_at = None
        return not self.end_moved_later()

    def pulled_in_is_preemption(self) -> bool:
        """The end time was just pulled in. To within the window of a preemption's grace or the
        lead (``near_s``): a preemption, stop at once. Further away it is a shortened limit (an
        operator's ``scontrol update TimeLimit``): no stop and no requeue now, the stop is
        re-planned for the lead before the new end."""
        assert self.watch is not None
        left = self.watch.remaining_s()
        self.shortened = not pulled_in_is_preemption(left, lead_s=self.lead_opt)
        if not self.shortened or left is None:
            return True
        lead = self.lead_s(left)
        at = time.monotonic() + left - lead
        self.stop_at = at if self.stop_at is None else min(self.stop_at, at)
        self.log(f"the job's end time was pulled in to {left:.0f} s from now, further than a preemption's grace "
                 f"({self.near_s():.0f} s): a shortened time limit; the {self.what} is planned {lead:.0f} s before "
                 f"the new end (in {left - lead:.0f} s), no {self.what} or requeue now")
        self.ledger.append("end_time_moved", left_s=left, dump_in_s=left - lead, progress_s=self._progress())
        return False

    def end_moved_later(self) -> bool:
        """At a planned time-limit stop: was the limit lengthened since it was planned? Then the
        stop is planned again for the lead before the new end."""
        if self.watch is None:
            return False
        self.watch.refresh()
        left = self.watch.remaining_s()
        lead = self.lead_s(left) if left is not None else 0.0
        if left is None or left - lead <= SIGNAL_TICK_S:
            return False
        self.stop_at = time.monotonic() + left - lead
        self.log(f"the job's end time is now {left:.0f} s away (its limit was lengthened): the {self.what} is "
                 f"planned {lead:.0f} s before it (in {left - lead:.0f} s)")
        return True

    # -- at a signal ---------------------------------------------------------------
    def cause(self, sig: signal.Signals) -> str:
        """Why a stop signal came: an end time pulled in to near now is a preemption (one pulled
        in further, a shortened limit, is not); one near the end, the limit."""
        if self.watch is None:
            return "signal"
        if self.watch.refresh():
            self.pulled_in_is_preemption()
        if self.watch.pulled_in and not self.shortened:
            return "preemption"
        left = self.watch.remaining_s()
        return "time_limit" if left is not None and left <= self.near_s() else "signal"

    def defer(self, sig: signal.Signals, cause: str, received: bool) -> bool:
        """A time-limit warning early (slurmctld's coarse tick delivers ``B:USR2@LEAD`` up to
        a minute before LEAD, ``--lead-s``; with ``--time-min`` Slurm may grant less time than
        LEAD and the warning comes at the start): stop at the end minus the lead
        (``bounded_lead_s``: LEAD, at most a quarter of this allocation, at least three
        times the measured cost and 15 s), not now. TERM, preemptions, a signal from
        elsewhere (``scancel --signal``: more than LEAD + a minute before the end) and runs
        without ``--lead-s`` stop at once."""
        left = self.watch.remaining_s() if self.watch is not None else None
        if not received or cause != "time_limit" or sig == signal.SIGTERM or left is None or self.lead_opt is None:
            return False
        lead = self.lead_s(left)
        wait = warning_wait_s(left, lead, window_s=self.near_s())
        if wait is None:
            return False
        self.stop_at = time.monotonic() + wait
        short = (f" (this allocation has about {self.allocation_s(left):.0f} s: a quarter of it, not "
                 f"--lead-s {self.lead_opt:.0f})" if lead < self.lead_opt else "")
        self.log(f"received {sig.name}, {left:.0f} s before the time limit: the {self.what} starts {lead:.0f} s "
                 f"before the end{short} (in {wait:.0f} s); TERM or a preemption still {self.what}s at once")
        self.ledger.append("signal", signum=int(sig), signame=sig.name, step=None, source=self.source,
                           cause=cause, deferred_s=wait, progress_s=self._progress())
        return True

    # -- the figures --------------------------------------------------------------------
    def allocation_s(self, left: float) -> float:
        """The time this allocation has in all: what has run since the supervisor started, and what is left."""
        return max(0.0, time.time() - self.began) + left

    def lead_s(self, left: float) -> float:
        """How long before the end a time-limit stop starts (``bounded_lead_s``)."""
        need = self._need_s()
        lead = self.lead_opt if self.lead_opt is not None else need
        return bounded_lead_s(lead, allocation_s=self.allocation_s(left), need_s=need)

    def near_s(self) -> float:
        """How close to the end a warning is the time-limit one: --lead-s plus slurmctld's tick
        (10 minutes without --lead-s)."""
        return near_s(self.lead_opt)

    def remaining_s(self) -> float | None:
        return self.watch.remaining_s() if self.watch is not None else None
