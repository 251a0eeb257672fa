"""The interruption ledger: one JSON line per event, appended durably.

Events written by the training side: ``start`` {resumed_from, restore_s},
``signal`` {signum, signame, step}, ``commit`` {step, save_s, final, engine},
``stop`` {reason, step, committed_step, requeue}, ``requeue`` {method, detail}.
Other parts add their own (``criu_dump``, ``criu_restore``). ``hpcckpt history``
turns them into one row per interruption.
"""
from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from filelock import FileLock

LEDGER = "ledger.jsonl"


class Ledger:
    def __init__(self, ckpt_dir: Path | str) -> None:
        self.dir = Path(ckpt_dir)
        self.path = self.dir / LEDGER

    def append(self, event: str, **fields: Any) -> dict[str, Any]:
        rec: dict[str, Any] = {
            "event": event,
            "time": time.time(),
            "job_id": os.environ.get("SLURM_JOB_ID"),
            "restart_count": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
            "local_restart": int(os.environ.get("HPCCKPT_LOCAL_RESTART", "0") or 0),
            "host": socket.gethostname(),
            "pid": os.getpid(),
        }
        rec.update(fields)
        line = (json.dumps(rec, sort_keys=True) + "\n").encode()
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        with FileLock(str(self.dir / ".ledger.lock")):
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, line)
                os.fsync(fd)
            finally:
                os.close(fd)
        return rec

    def read(self) -> list[dict[str, Any]]:
        """Every well-formed event; a torn last line (crash mid-append) is skipped."""
        try:
            lines = self.path.read_text().splitlines()
        except FileNotFoundError:
            return []
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return out
