"""Where bytes go: step directories, the commit protocol, verification, retention."""
from __future__ import annotations

from .catalog import CheckpointInfo, check, committed_newest_first, find, prune, scan, step_name
from .commit import Transaction, atomic_write, read_manifest, verify_files
from .lock import writer_lock

__all__ = ["CheckpointInfo", "Transaction", "atomic_write", "check", "committed_newest_first", "find",
           "prune", "read_manifest", "scan", "step_name", "verify_files", "writer_lock"]
