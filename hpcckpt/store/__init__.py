"""Where bytes go: step directories, the commit protocol, verification, retention."""
from __future__ import annotations

from .catalog import (
    CheckpointInfo,
    check,
    committed_newest_first,
    find,
    inspect_step,
    prune,
    scan,
    snapshot,
    step_name,
    vanished,
)
from .commit import Transaction, atomic_write, discard, read_manifest, verify_files
from .lock import WriterBusy, WriterLease, reader_lock, writer_lock
from .manifest import validate as validate_manifest

__all__ = ["CheckpointInfo", "Transaction", "WriterBusy", "WriterLease", "atomic_write", "check",
           "committed_newest_first", "discard", "find", "inspect_step", "prune", "read_manifest", "reader_lock",
           "scan", "snapshot", "step_name", "validate_manifest", "vanished", "verify_files", "writer_lock"]
