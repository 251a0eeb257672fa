"""What the CRIU supervisor watches besides signals: its output, its progress.

(The job's end time is watched by ``lifecycle.supervise.EndTimeWatch``, as in every mode.)

``Tee``: the job writes to its per-run files under DIR/criu/stdio (criu must find them
unchanged at restore; nothing else may write to them); a thread copies what it appends
to the supervisor's own stdout/stderr, which under Slurm is the job's output file.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..fsio import write_all
from ..lifecycle.history import OPENERS


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
            if e.get("event") in OPENERS:  # a later run: what counts starts again here
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

