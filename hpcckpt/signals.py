"""Noticing: signal handlers that only record.

A handler appends (signal, monotonic time, wall time) and returns. It never saves,
never requeues, never takes a lock: that work happens at the next step boundary in
``Checkpointer``. Every received signal is logged, also repeats (signal storms).
"""
from __future__ import annotations

import atexit
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import FrameType
from typing import Any

from .config import parse_signals
from .proc.workers import QuietWorkers, track_loader

log = logging.getLogger("hpcckpt.signals")

Handler = Callable[[int, FrameType | None], Any] | int | None


def unblock(signals: Iterable[int], who: str = "hpcckpt") -> list[str]:
    """Unblock ``signals`` in the calling thread's mask; the names of those that were blocked.

    A blocked mask is inherited through fork and exec: a job started by a launcher that
    blocked SIGTERM (or a thread that did, around a ``fork``) would keep a preemption's
    signal pending for ever in a single-threaded process, and its handler would never run.
    Logged once per call when it happens, naming the signals."""
    wanted = {int(s) for s in signals}
    was = signal.pthread_sigmask(signal.SIG_UNBLOCK, wanted)
    blocked = sorted(signal.Signals(s).name for s in wanted & {int(b) for b in was})
    if blocked:
        log.warning("%s: %s %s blocked in this process (inherited from what started it); unblocked, "
                    "so that a stop is seen", who, ", ".join(blocked), "was" if len(blocked) == 1 else "were")
    return blocked


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
        self._children: Handler = None  # the SIGCHLD handler found by guard_children (torch's)
        self.worker_errors: list[str] = []  # DataLoader worker deaths let pass while stopping
        self._worker_errors_logged = 0

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
        unblock(self.signals)

    def uninstall(self) -> None:
        for sig, prev in self._previous.items():
            signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
        self._previous.clear()
        if self._children is not None and signal.getsignal(signal.SIGCHLD) == self._child:
            signal.signal(signal.SIGCHLD, self._children)
        self._children = None

    def _record(self, signum: int, frame: FrameType | None) -> None:
        # list.append is atomic under the GIL; no locks, no I/O, no logging here.
        self.received.append(Received(signum, time.monotonic(), time.time()))

    # -- DataLoader workers ------------------------------------------------------------------

    def guard_children(self) -> None:
        """Put ``_child`` in front of the process's SIGCHLD handler (main thread; cheap enough
        for every step boundary: torch installs its handler when the first DataLoader with
        workers starts, so it is looked for again until found).

        Slurm's stop signals reach every process of the job, DataLoader workers included:
        torch's workers die of a TERM that is not their parent's, and torch's SIGCHLD
        handler then raises RuntimeError in the main thread wherever it is (a backward,
        the final checkpoint, the requeue), so the stop that was coming ends as a crash.
        ``_child`` lets that error through unless the job is stopping: a worker killed by
        one of the stop signals (which is then recorded as received), or any worker death
        once a stop signal was received (the run stops at its next step boundary, before
        it asks the loader for another batch)."""
        if threading.current_thread() is not threading.main_thread():
            return
        current = signal.getsignal(signal.SIGCHLD)
        if current == self._child or not callable(current):
            return
        self._children = current
        signal.signal(signal.SIGCHLD, self._child)

    def _child(self, signum: int, frame: FrameType | None) -> None:
        inner = self._children
        if not callable(inner):
            return
        try:
            inner(signum, frame)
        except RuntimeError as exc:
            said = str(exc)
            killer = next((s for s in self.signals if f"killed by signal: {signal.strsignal(s)}" in said), None)
            if killer is None and not self.received:
                raise  # a worker that crashed while the job is not stopping: the user must see it
            if not self.received:
                assert killer is not None
                self._record(int(killer), frame)
            if said.strip() not in self.worker_errors:  # torch raises again at every SIGCHLD
                self.worker_errors.append(said.strip())  # logged at the step boundary (no I/O here)

    def first(self) -> Received | None:
        return self.received[0] if self.received else None

    def log_new(self) -> list[Received]:
        """Log signals received since the last call (called at step boundaries)."""
        for said in self.worker_errors[self._worker_errors_logged:]:
            log.warning("hpcckpt: a DataLoader worker died while the job stops (%s); the run stops at this step "
                        "boundary", said)
        self._worker_errors_logged = len(self.worker_errors)
        new = self.received[self._logged:]
        self._logged = len(self.received)
        for r in new:
            extra = "" if r is self.received[0] else " (already stopping; recorded only)"
            log.warning("hpcckpt: received %s at %.3f%s", r.name, r.wall_s, extra)
        return new


def quiet_workers(loader: Any, signals: Iterable[signal.Signals]) -> None:
    """Let ``loader``'s future worker processes ignore the stop signals.

    Slurm sends them to every process of the job; torch's workers die of one that is not
    their parent's, and a batch the main thread was waiting for never comes (RuntimeError:
    DataLoader worker exited unexpectedly), so the run could not reach the step boundary
    where it stops. Ignoring them, the workers serve until the main process has taken the
    final checkpoint; its exit ends them (torch's shutdown, or their watchdog of the
    parent). Workers already running keep what they had; a loader without workers, or one
    that refuses the attribute, is left as it is. The quieted workers end at the process's
    exit all the same (``proc.workers``: a loader's persistent workers would hang it)."""
    from .data import iterating_loader
    loader = iterating_loader(loader)  # an adapter's workers are those of the loader it iterates
    workers = getattr(loader, "num_workers", 0)
    if not isinstance(workers, int) or workers <= 0:  # none, or a wrapper that has no such attribute
        return
    inner = getattr(loader, "worker_init_fn", None)
    if isinstance(inner, QuietWorkers):
        return
    try:
        loader.worker_init_fn = QuietWorkers(inner, tuple(int(s) for s in signals))
    except (AttributeError, TypeError, ValueError):
        return
    track_loader(loader)


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

    def __init__(self, signals: Iterable[signal.Signals], on_stop: Callable[[Received], None],
                 may_wait: Callable[[Received], str | None] | None = None) -> None:
        self.signals = parse_signals(tuple(signals))
        self.on_stop = on_stop
        self.may_wait = may_wait  # why a signal (a time-limit warning) need not stop the script yet
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
        unblock(self.signals)
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
        """``on_stop`` for the first signal only (it may raise the process's exit), unless
        ``may_wait`` says why this one can wait (logged; a later signal is judged again)."""
        if self.fired:
            return
        why = self.may_wait(got) if self.may_wait is not None else None
        if why is not None:
            log.warning("hpcckpt: %s received after the run's last step, %s; the code after the training loop "
                        "goes on", got.name, why)
            return
        self.fired = True
        self.on_stop(got)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.fire(Received(signum, time.monotonic(), time.time()))


_after_run: AfterRun | None = None  # the one installed in this process, if any


def _quiet_at_exit() -> None:
    """atexit: the process is ending and its exit status is decided (0, or 75 after a stop).
    As it finalizes, Python gives every signal with a Python handler back to SIG_DFL, so a
    stop signal in that last moment would kill a finished job (status 140 or 143: FAILED
    under Slurm, though its run and its checkpoint are complete). A finished run's guard
    ignores its signals from here; atexit callbacks registered after this module's (the
    script's own) still run under the guard. Registered twice: a stop signal that comes as
    the first call begins fires the guard, whose exit then ends that call (atexit goes on to
    the next); the guard fires once, so the second call completes."""
    guard = _after_run
    if guard is None or threading.current_thread() is not threading.main_thread():
        return
    for sig in guard.signals:
        if signal.getsignal(sig) == guard._handle:
            signal.signal(sig, signal.SIG_IGN)


atexit.register(_quiet_at_exit)
atexit.register(_quiet_at_exit)
