"""What every supervisor around a command shares (``hpcckpt run``: CRIU, app, own checkpoints).

A supervisor runs the user's command as a child and decides, for it, when the allocation
stops. What it needs in every mode is said once here:

- ``SignalInbox``: the signals it watches are only *recorded* by their handlers (a handler
  that acted would run in the middle of whatever the loop was doing); the loop sleeps on a
  wakeup fd and takes them in order.
- ``EndTimeWatch``: the one reader of the job's end time, here and in the training process
  (``policy.Policy``, where it reads on a thread of its own). Under Slurm a preemption with GraceTime sends nothing at its start
  (Slurm 22.05; later ones send the job's ``--signal`` only with
  ``PreemptParameters=send_user_signal``): it pulls the job's end time in to now +
  GraceTime, and only at the end of the grace does TERM reach every process, KillWait
  seconds before KILL. Reading the end time every ``poll_s`` seconds turns the moved end
  time into a stop while the grace period still runs. ``end_poll_s`` picks that period.
- ``as_recorded``: a stop's cause as the scheduler recorded it, asked within ``RECORD_S``.
- ``run_forwarding``: a command run as it is, every watched signal passed on to it (app mode,
  and a CRIU job that CRIU mode cannot take).
"""
from __future__ import annotations

import os
import select
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from types import FrameType
from typing import TYPE_CHECKING, Any

from ..cluster import detect
from ..cluster.scontrol import within
from ..signals import unblock

if TYPE_CHECKING:
    from ..cluster.base import Cluster
    from .ledger import Ledger

# Every catchable signal a supervisor passes on to a command it does not checkpoint (app mode, a
# CRIU job on several nodes run untouched): the command decides what each one means.
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2,
             signal.SIGQUIT, signal.SIGALRM, signal.SIGXCPU, signal.SIGCONT)
RECORD_S = 10.0  # how long a record waits for the scheduler's answer
# An end time pulled in by at least this much is a preemption (or an operator's shorter
# limit); less is rounding of the scheduler's clock.
MOVED_S = 2.0


def pulled_in(end: float | None, before: float | None) -> bool:
    """The job's end time was pulled in: ``end`` is earlier than the one read ``before`` by at
    least ``MOVED_S`` (a preemption's grace, or an operator's shorter limit). The one rule every
    reader of the end time applies (the supervisors' ``EndTimeWatch``, the in-process ``Policy``)."""
    return end is not None and before is not None and end < before - MOVED_S


class SignalInbox:
    """Signals recorded by their handlers, taken in order by the supervisor's loop."""

    def __init__(self) -> None:
        self.pending: list[signal.Signals] = []
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._watched: set[signal.Signals] = set()

    def _record(self, signum: int, _frame: FrameType | None) -> None:
        self.pending.append(signal.Signals(signum))

    def install(self, watched: Iterable[signal.Signals], who: str) -> None:
        """Record ``watched``; SIGCHLD only wakes the loop (a child ended)."""
        watched = set(watched)
        self._watched |= watched
        signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        for sig in watched:
            signal.signal(sig, self._record)
        signal.signal(signal.SIGCHLD, lambda _s, _f: None)
        unblock(watched | {signal.SIGCHLD}, who)

    def quiet(self) -> None:
        """The supervisor's run is over and its exit status decided: the watched signals are
        ignored from here. As the process finalizes, Python gives every signal with a Python
        handler back to SIG_DFL, so a warning that came in that last moment (slurmctld sends
        ``--signal`` up to a minute early) killed the finished job's batch shell: FAILED with
        the signal's number (``ExitCode=0:12``) after its command had exited 0."""
        for sig in self._watched:
            signal.signal(sig, signal.SIG_IGN)

    def sleep(self, timeout_s: float) -> None:
        """Until a signal comes or ``timeout_s`` passes; at once if one is pending."""
        if self.pending:
            return
        ready, _, _ = select.select([self._wake_r], [], [], timeout_s)
        if ready:
            try:
                while os.read(self._wake_r, 512):
                    pass
            except BlockingIOError:
                pass


class EndTimeWatch:
    """The one reader of the job's end time (every supervisor, the in-process ``Policy``).

    ``moved()`` reads it every ``poll_s`` (on ``clock``; 0: at every call) and says once that it
    was pulled in. With ``background`` the read runs on a thread of its own, one at a time, and
    a call takes the answer the last read brought: the caller (a training step) never waits on
    the scheduler. ``also``: what else to ask the scheduler at each read, on the same thread
    (the ``Policy``: maintenance reservations and drain); its last answer is ``extra``. A read
    that fails keeps the previous answers and goes to ``on_error`` (on the caller's thread).
    """

    def __init__(self, read: Callable[[], float | None], *, poll_s: float,
                 clock: Callable[[], float] = time.monotonic, background: bool = False,
                 also: Callable[[], Any] | None = None,
                 on_error: Callable[[Exception], None] | None = None) -> None:
        self._read, self.poll_s, self._clock = read, poll_s, clock
        self._also, self._on_error, self.background = also, on_error, background
        self._next = float("-inf")
        self.first: float | None = None  # the end time as first read
        self.last: float | None = None  # the last end time known
        self.end: float | None = None  # the last answer as read (None: unlimited or unknown)
        self.moved_s = 0.0  # how far the last move pulled it in
        self.extra: Any = None  # ``also``'s last answer
        self._query: threading.Thread | None = None
        self._answer: tuple[float | None, Any] | Exception | None = None
        self._lock = threading.Lock()

    def _ask(self) -> tuple[float | None, Any] | Exception:
        try:
            end = self._read()
            return end, (self._also() if self._also is not None else None)
        except Exception as exc:  # noqa: BLE001 - a scheduler that does not answer now is no notice
            return exc

    def _ask_in_background(self) -> None:
        answer = self._ask()
        with self._lock:
            self._answer = answer

    def _take(self) -> bool:
        """Apply the answer a background read brought, if any: True when it moved the end in."""
        with self._lock:
            answer, self._answer = self._answer, None
        return self._apply(answer)

    def _apply(self, answer: tuple[float | None, Any] | Exception | None) -> bool:
        if answer is None:
            return False
        if isinstance(answer, Exception):
            if self._on_error is not None:
                self._on_error(answer)
            return False
        end, self.extra = answer
        self.end = end
        if end is None:
            return False
        if self.first is None:
            self.first = self.last = end
            return False
        moved = pulled_in(end, self.last)
        if moved and self.last is not None:
            self.moved_s = self.last - end
        self.last = end
        return moved

    def moved(self) -> bool:
        """True (once per move) when the end time is now earlier than it was read before."""
        moved = self._take()
        now = self._clock()
        if now < self._next:
            return moved
        self._next = now + self.poll_s
        if not self.background:
            return self._apply(self._ask()) or moved
        if self._query is None or not self._query.is_alive():
            self._query = threading.Thread(target=self._ask_in_background, daemon=True,
                                           name="hpcckpt-end-time-watch")
            self._query.start()
        return moved

    def refresh(self, *, wait_s: float = 0.0) -> bool:
        """Read the end time now (at a signal, a decision): True when it was pulled in since the
        last read. In the background, wait at most ``wait_s`` for the answer (``answered()``
        says whether it came), then go on with the last one."""
        self._next = float("-inf")
        moved = self.moved()
        if self.background and self._query is not None:
            self._query.join(wait_s)
            moved = self._take() or moved
        return moved

    def answered(self) -> bool:
        """No read is in flight (a forced one came back in time)."""
        return self._query is None or not self._query.is_alive()

    def wait(self, timeout_s: float) -> None:
        """Until the read in flight (if any) has answered, at most ``timeout_s``."""
        if self._query is not None:
            self._query.join(timeout_s)

    @property
    def pulled_in(self) -> bool:
        return pulled_in(self.last, self.first)

    def remaining_s(self) -> float | None:
        return None if self.last is None else self.last - time.time()


def run_forwarding(cmd: Iterable[str], inbox: SignalInbox, *, log: Callable[[str], None]) -> int:
    """Run ``cmd`` as it is and pass every signal ``inbox`` records on to it, until it exits:
    its exit status (128 + N when signal N killed it), as a shell says it."""
    proc = subprocess.Popen(list(cmd))
    while True:
        rc = proc.poll()
        if rc is not None:
            code = 128 - rc if rc < 0 else rc
            log(f"job exited with status {code}")
            return code
        while inbox.pending:
            sig = inbox.pending.pop(0)
            log(f"forwarding {sig.name} to the job (PID {proc.pid})")
            try:
                os.kill(proc.pid, sig)
            except ProcessLookupError:
                pass
        inbox.sleep(1.0)


def end_poll_s(cluster: Cluster, poll_s: float, *, log: Callable[[str], None],
               ledger: Ledger | None = None) -> float:
    """How often the end time is read: ``poll_s``, and at most a third of the partition's
    GraceTime, so that a preemption is seen early in its grace, with time left to act
    (a 10 s poll on a 10 s grace saw it with 0 s left)."""
    try:
        with within(RECORD_S):
            grace = cluster.grace_time_s()
    except Exception as exc:  # noqa: BLE001 - the poll stays as given
        log(f"could not read the partition's GraceTime ({exc}); reading the end time every {poll_s:.0f} s")
        return poll_s
    if grace is None or grace <= 0 or grace / 3 >= poll_s:
        return poll_s
    poll = max(1.0, grace / 3)
    log(f"the partition's GraceTime is {grace:.0f} s: reading the end time every {poll:.1f} s "
        f"(--end-poll-s {poll_s:.0f} would see a preemption late in its grace)")
    if ledger is not None:
        ledger.append("end_poll", poll_s=poll, grace_s=grace)
    return poll


def as_recorded(cause: str, *, log: Callable[[str], None]) -> str:
    """The stop's cause as the scheduler recorded it (a TERM at a GraceTime=0 preemption is
    the preemption's), asked within ``RECORD_S``; the supervisor's own reading otherwise."""
    try:
        with within(RECORD_S):
            return str(detect().stop_cause(cause))
    except Exception as exc:  # noqa: BLE001 - the record keeps the supervisor's reading
        log(f"could not ask the scheduler why the job stopped ({exc}); recording {cause}")
        return cause
