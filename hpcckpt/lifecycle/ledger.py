"""The interruption ledger: one JSON line per event, appended durably.

Events written by the training side: ``start`` {resumed_from, restore_s},
``signal`` {signum, signame, step}, ``commit`` {step, save_s, final, engine},
``stop`` {reason, step, committed_step, requeue}, ``requeue`` (the one schema of
``hpcckpt.lifecycle.requeue``). Other parts add their own (``criu_dump``,
``criu_restore``; the CRIU supervisor's openers carry ``process_start``,
``process_start_time()``). ``hpcckpt history`` turns them into one row per interruption,
and ``--goodput`` into the wall time's productive and badput buckets.

Nothing here may block training: the lock is taken without blocking and waited for
at most ``LOCK_WAIT_S`` (then the event is skipped, and said so), and neither the
ledger nor its lock is used unless it is a regular file (a FIFO or a link to
``/dev/zero`` is refused, never opened for reading or writing by name twice).
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..fsio import write_all
from .identity import Identity, current

LEDGER = "ledger.jsonl"
LOCK = ".ledger.lock"
LOCK_WAIT_S = 2.0  # a lock held longer (a stopped or hung writer) costs the event, never the step
MAX_LINE_BYTES = 1 << 20  # a longer line is no event hpcckpt wrote: skipped while streaming

log = logging.getLogger("hpcckpt")


class LedgerBusy(OSError):
    """The ledger's lock stayed held past the bounded wait."""


class Ledger:
    """Appends never raise: a full disk, a held lock or a hostile file costs an event, never training."""

    def __init__(self, ckpt_dir: Path | str, *, identity: Identity | None = None) -> None:
        self.dir = Path(ckpt_dir)
        self.path = self.dir / LEDGER
        self._identity = identity

    def append(self, event: str, *, lock_wait_s: float = LOCK_WAIT_S, durable: bool = True,
               **fields: Any) -> dict[str, Any]:
        """Append one event durably; on failure log it and go on (the event is returned either way).

        ``durable=False``: no fsync of its own (the next durable append, or the kernel's own
        writeback, makes it durable): for the records of every periodic commit, which are
        bookkeeping beside a checkpoint that is itself durable, so that a small state saved
        at every step does not pay a ledger fsync on the training thread each time.
        """
        who = self._identity or current()
        rec: dict[str, Any] = {"event": event, "time": time.time(), **who.record()}
        rec.update(fields)
        try:
            line = (json.dumps(rec, sort_keys=True, default=str) + "\n").encode("utf-8", "backslashreplace")
            self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            lock = _open_regular(self.dir / LOCK, os.O_RDWR | os.O_CREAT)
            try:
                _flock_bounded(lock, lock_wait_s, self.dir / LOCK)
                self._write(line, durable)
            finally:
                os.close(lock)  # closing drops the flock
        except Exception as exc:  # noqa: BLE001 - never let bookkeeping stop training
            log.error("hpcckpt: could not record %r in %s (%s); skipped, training goes on", event, self.path, exc)
        return rec

    def _write(self, line: bytes, durable: bool = True) -> None:
        fd = _open_regular(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT)
        try:
            size = os.fstat(fd).st_size
            if size and os.pread(fd, 1, size - 1) != b"\n":
                line = b"\n" + line  # an earlier append was torn (crash, full disk): keep this one whole
            write_all(fd, line)
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)

    def events(self) -> Iterator[dict[str, Any]]:
        """Every well-formed event, streamed (memory bounded by one line); torn, non-UTF-8,
        over-long or non-object lines are skipped; an absent or non-regular ledger has none."""
        try:
            fd = _open_regular(self.path, os.O_RDONLY)
        except OSError:  # absent, or not a plain file (a FIFO must not hang `hpcckpt history`)
            return
        with os.fdopen(fd, "rb") as fh:
            while True:
                line = fh.readline(MAX_LINE_BYTES + 1)
                if not line:
                    return
                if len(line) > MAX_LINE_BYTES:
                    del line
                    rest = fh.readline(1 << 16)
                    while rest and not rest.endswith(b"\n"):  # skip the rest of the over-long line
                        rest = fh.readline(1 << 16)
                    continue
                rec = _parse(line)
                if rec is not None:
                    yield rec

    def read(self) -> list[dict[str, Any]]:
        """Every well-formed event as a list (small ledgers; ``events`` streams)."""
        return list(self.events())


def process_start_time(pid: int | str = "self") -> float | None:
    """When a process started, in epoch seconds (to the kernel's clock tick), from ``/proc``;
    None where it cannot be read. A run's opening record carries it as ``process_start``, so
    that ``hpcckpt history --goodput`` tells program start-up apart from the queue wait."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read(4096).rsplit(b")", 1)[1].split()  # the name before ")" may hold spaces
        since_boot = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime
        return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - since_boot)
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def _parse(line: bytes) -> dict[str, Any] | None:
    try:
        rec = json.loads(line.decode("utf-8"))
    except (ValueError, RecursionError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return None
    return rec if isinstance(rec, dict) and isinstance(rec.get("event"), str) else None


def _open_regular(path: Path, flags: int) -> int:
    """Open without following a link or blocking on a FIFO, then insist on a regular file."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, f"{path} is not a regular file; remove it (hpcckpt creates it)")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _flock_bounded(fd: int, wait_s: float, path: Path) -> None:
    """``flock(LOCK_EX)`` polled without blocking for at most ``wait_s``; LedgerBusy after."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
        if time.monotonic() >= deadline:
            raise LedgerBusy(errno.EWOULDBLOCK, f"{path} stayed locked for {wait_s:.0f}s (another writer "
                                                "stopped or hung inside an append)")
        time.sleep(0.005)
