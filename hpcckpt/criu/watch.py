"""What the CRIU supervisor watches besides signals: the job's end time, its output.

``EndTimeWatch``: under Slurm a preemption with GraceTime sends nothing at its start
(Slurm 22.05; later ones send the job's ``--signal`` only with
``PreemptParameters=send_user_signal``): it pulls the job's end time in to now + GraceTime,
and only at the end of the grace does TERM reach every process, KillWait seconds before
KILL. Reading the end time every ``poll_s`` seconds turns the moved end time into a
dump while the grace period still runs.

``Tee``: the job writes to its per-run files under DIR/criu/stdio (criu must find them
unchanged at restore; nothing else may write to them); a thread copies what it appends
to the supervisor's own stdout/stderr, which under Slurm is the job's output file.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from ..fsio import write_all

# An end time pulled in by at least this much is a preemption (or an operator's shorter
# limit); less is rounding of the scheduler's clock.
MOVED_S = 2.0


class EndTimeWatch:
    """Polls the job's end time; ``moved()`` says once that it was pulled in."""

    def __init__(self, read: Callable[[], float | None], *, poll_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._read, self.poll_s, self._clock = read, poll_s, clock
        self._next = 0.0
        self.first: float | None = None
        self.last: float | None = None

    def _poll(self) -> float | None:
        try:
            return self._read()
        except Exception:  # noqa: BLE001 - a scheduler that does not answer now is no notice
            return None

    def moved(self) -> bool:
        """True (once per move) when the end time is now earlier than at start."""
        now = self._clock()
        if self.poll_s <= 0 or now < self._next:
            return False
        self._next = now + self.poll_s
        end = self._poll()
        if end is None:
            return False
        if self.first is None:
            self.first = self.last = end
            return False
        moved = end < (self.last or end) - MOVED_S
        self.last = end
        return moved

    def refresh(self) -> bool:
        """Read the end time now (at a signal): True when it was pulled in since the last poll."""
        self._next = 0.0
        return self.moved()

    @property
    def pulled_in(self) -> bool:
        return self.first is not None and self.last is not None and self.last < self.first - MOVED_S

    def remaining_s(self) -> float | None:
        return None if self.last is None else self.last - time.time()


class Tee(threading.Thread):
    """Copies what the job appends to its files to our fds (1 and 2), until ``close()``."""

    def __init__(self, pairs: list[tuple[Path, int]], *, interval_s: float = 0.5) -> None:
        super().__init__(name="hpcckpt-tee", daemon=True)
        self._pairs = pairs
        self._offsets = [0] * len(pairs)
        self._done = threading.Event()
        self._interval_s = interval_s

    def _copy(self) -> None:
        for i, (path, fd) in enumerate(self._pairs):
            try:
                with open(path, "rb") as f:
                    f.seek(self._offsets[i])
                    data = f.read()
            except OSError:
                continue
            self._offsets[i] += len(data)
            try:
                write_all(fd, data)
            except OSError:
                return  # our output is gone (closed, full disk): the job's own files still hold it

    def run(self) -> None:
        while not self._done.wait(self._interval_s):
            self._copy()

    def close(self) -> None:
        """Stop and copy what is left (call before exiting or being requeued)."""
        self._done.set()
        if self.is_alive():
            self.join(timeout=5)
        self._copy()


class Progress:
    """How far the job has got, in seconds of running: its image's at a restore, plus this run's."""

    def __init__(self) -> None:
        self.base_s = 0.0
        self._t0 = time.monotonic()

    def begin(self, base_s: float) -> None:
        self.base_s, self._t0 = base_s, time.monotonic()

    def run_s(self) -> float:
        return time.monotonic() - self._t0

    def now(self) -> float:
        return self.base_s + self.run_s()

    @staticmethod
    def lost_since(events: Iterable[dict[str, Any]], resumed_s: float) -> dict[str, Any]:
        """What resuming at ``resumed_s`` loses of the previous run (from its ledger events,
        streamed: ``Ledger.events()``; memory does not grow with the ledger).

        Exact when that run wrote its ``stop``; when it vanished (KILL, node failure) the
        furthest point it recorded (a periodic image) makes ``lost_s`` a lower bound."""
        opened = stopped = False
        every: Any = None
        furthest: float | None = None
        for e in events:
            if e.get("event") in RUN_OPENERS:  # a later run: what counts starts again here
                opened, stopped, every, furthest = True, False, e.get("dump_every_s"), None
                continue
            if not opened:
                continue
            stopped = stopped or e.get("event") == "stop"
            p = e.get("progress_s")
            if isinstance(p, (int, float)):
                furthest = float(p) if furthest is None else max(furthest, float(p))
        if not opened:
            return {}
        bound = {} if stopped or not every else {"lost_at_most_s": every}  # a kill: at most one interval
        if furthest is None:
            return {"lost_s": None, "lost_exact": False, **bound}
        return {"lost_s": round(max(0.0, furthest - resumed_s), 3), "lost_exact": stopped, **bound}


RUN_OPENERS = ("start", "criu_restore")
