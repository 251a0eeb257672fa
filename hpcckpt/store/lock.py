"""A lock file that serialises writers of one checkpoint root.

Two job instances after a requeue race (the old one still flushing, the new one
starting) must not interleave commits or retention.
"""
from __future__ import annotations

from pathlib import Path

from filelock import FileLock

LOCK_NAME = ".hpcckpt.lock"


def writer_lock(root: Path, timeout_s: float = -1) -> FileLock:
    """A ``filelock.FileLock`` on ``root/.hpcckpt.lock`` (use as a context manager)."""
    root = Path(root)
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    return FileLock(str(root / LOCK_NAME), timeout=timeout_s)
