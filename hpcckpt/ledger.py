"""The interruption ledger: one JSON line per event, appended durably.

Events written by the training side: ``start`` {resumed_from, restore_s},
``signal`` {signum, signame, step}, ``commit`` {step, save_s, final, engine},
``stop`` {reason, step, committed_step, requeue}, ``requeue`` {method, detail}.
Other parts add their own (``criu_dump``, ``criu_restore``). ``hpcckpt history``
turns them into one row per interruption.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import stat
import time
from pathlib import Path
from typing import Any

from filelock import FileLock

from .supervisor import RESTART_ENV

LEDGER = "ledger.jsonl"

log = logging.getLogger("hpcckpt")


class Ledger:
    """Appends never raise: a full disk or a read-only directory costs an event, never training."""

    def __init__(self, ckpt_dir: Path | str) -> None:
        self.dir = Path(ckpt_dir)
        self.path = self.dir / LEDGER

    def append(self, event: str, **fields: Any) -> dict[str, Any]:
        """Append one event durably; on failure log it and go on (the event is returned either way)."""
        rec: dict[str, Any] = {
            "event": event,
            "time": time.time(),
            "job_id": os.environ.get("SLURM_JOB_ID"),
            "restart_count": _env_int("SLURM_RESTART_COUNT"),
            "local_restart": _env_int(RESTART_ENV),
            "host": socket.gethostname(),
            "pid": os.getpid(),
        }
        rec.update(fields)
        try:
            line = (json.dumps(rec, sort_keys=True, default=str) + "\n").encode("utf-8", "backslashreplace")
            self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            with FileLock(str(self.dir / ".ledger.lock"), mode=0o600):
                self._write(line)
        except Exception as exc:  # never let bookkeeping stop training
            log.error("hpcckpt: could not record %r in %s (%s); training goes on", event, self.path, exc)
        return rec

    def _write(self, line: bytes) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            size = os.fstat(fd).st_size
            if size and os.pread(fd, 1, size - 1) != b"\n":
                line = b"\n" + line  # an earlier append was torn (crash, full disk): keep this one whole
            view = memoryview(line)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)

    def read(self) -> list[dict[str, Any]]:
        """Every well-formed event; torn, non-UTF-8 or non-object lines are skipped."""
        try:
            raw = _read_plain(self.path)
        except OSError:  # absent, or not a plain file (a FIFO must not hang `hpcckpt history`)
            return []
        out = []
        for line in raw.splitlines():
            try:
                rec = json.loads(line.decode("utf-8"))
            except (ValueError, RecursionError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
                continue
            if isinstance(rec, dict) and isinstance(rec.get("event"), str):
                out.append(rec)
        return out


def _read_plain(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file")
        return f.read()


def _env_int(name: str) -> int:
    try:
        return int(os.environ.get(name, "0") or 0)
    except ValueError:
        return 0
