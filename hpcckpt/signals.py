"""Noticing: signal handlers that only record.

A handler appends (signal, monotonic time, wall time) and returns. It never saves,
never requeues, never takes a lock: that work happens at the next step boundary in
``Checkpointer``. Every received signal is logged, also repeats (signal storms).
"""
from __future__ import annotations

import logging
import signal
import threading
import time
from dataclasses import dataclass
from types import FrameType
from typing import Any, Callable, Iterable

from .config import parse_signals

log = logging.getLogger("hpcckpt.signals")

Handler = Callable[[int, FrameType | None], Any] | int | None


@dataclass(frozen=True)
class Received:
    signum: int
    monotonic_s: float
    wall_s: float

    @property
    def name(self) -> str:
        try:
            return signal.Signals(self.signum).name
        except ValueError:
            return str(self.signum)


class SignalRecorder:
    """Install recording handlers for ``signals``; ``first()`` is the stop trigger."""

    def __init__(self, signals: Iterable[signal.Signals]) -> None:
        # Checked again here (not only in config): a handler for SIGSEGV or SIGCHLD would
        # turn a crash or a finished child into a "stop", and SIGKILL cannot be caught.
        self.signals = parse_signals(tuple(signals))
        self.received: list[Received] = []
        self._previous: dict[int, Handler] = {}
        self._logged = 0

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            log.warning("hpcckpt: not on the main thread; cannot install signal handlers for %s",
                        ", ".join(s.name for s in self.signals))
            return
        if _after_run is not None:  # a new run in this process takes the signals over from a finished one
            _after_run.disarm()
        for sig in self.signals:
            if sig not in self._previous:
                self._previous[sig] = signal.signal(sig, self._record)

    def uninstall(self) -> None:
        for sig, prev in self._previous.items():
            signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
        self._previous.clear()

    def _record(self, signum: int, frame: FrameType | None) -> None:
        # list.append is atomic under the GIL; no locks, no I/O, no logging here.
        self.received.append(Received(signum, time.monotonic(), time.time()))

    def first(self) -> Received | None:
        return self.received[0] if self.received else None

    def log_new(self) -> list[Received]:
        """Log signals received since the last call (called at step boundaries)."""
        new = self.received[self._logged:]
        self._logged = len(self.received)
        for r in new:
            extra = "" if r is self.received[0] else " (already stopping; recorded only)"
            log.warning("hpcckpt: received %s at %.3f%s", r.name, r.wall_s, extra)
        return new


class AfterRun:
    """The stop signals from a finished run's end to the process's exit (``Checkpointer``).

    Once the last step is committed and the run is marked finished, the script goes on
    without step boundaries (an evaluation, an export of the model): a stop signal then
    would otherwise kill it (or, ignored, leave it to Slurm's KILL) with the ledger saying
    the run finished, and the job would not come back to end that code. The first stop
    signal calls ``on_stop`` (the Checkpointer's: record, requeue, raise its exit); later
    ones (the TERM that ``scontrol requeue`` makes Slurm send) do nothing. A new
    ``SignalRecorder`` in the same process (another run) takes the signals back first.
    """

    def __init__(self, signals: Iterable[signal.Signals], on_stop: Callable[[Received], None]) -> None:
        self.signals = parse_signals(tuple(signals))
        self.on_stop = on_stop
        self.fired = False
        self._previous: dict[int, Handler] = {}

    def install(self) -> bool:
        """Handle the signals (main thread only; False elsewhere: nothing installed)."""
        global _after_run
        if threading.current_thread() is not threading.main_thread():
            return False
        if _after_run is not None:
            _after_run.disarm()
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        _after_run = self
        return True

    def disarm(self) -> None:
        """Give each signal back the handler found at ``install`` (where it is still this one's)."""
        global _after_run
        for sig, prev in self._previous.items():
            if signal.getsignal(sig) == self._handle:
                signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
        self._previous.clear()
        if _after_run is self:
            _after_run = None

    def fire(self, got: Received) -> None:
        """``on_stop`` for the first signal only (it may raise the process's exit)."""
        if self.fired:
            return
        self.fired = True
        self.on_stop(got)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.fire(Received(signum, time.monotonic(), time.time()))


_after_run: AfterRun | None = None  # the one installed in this process, if any
