"""Checkpointing every CUDA process of a process tree as one unit.

Order matters: every process is LOCKED before any is CHECKPOINTED. Locking one
process while a peer still runs can leave the peer waiting on work the locked one
will never do; the two-phase order keeps the tree consistent. On failure the
processes already moved are brought back to RUNNING, so a failed CUDA checkpoint
leaves the job running and the caller can fall back to the application's own save.
"""
from __future__ import annotations

from ..criu import proctree
from ..errors import CudaCheckpointError
from .driver import MAPPED_DRIVER, CudaCheckpoint, ProcessState


def cuda_pids(root: int) -> list[int]:
    """PIDs in the tree under ``root`` that have the CUDA driver mapped."""
    return [p for p in proctree.tree(root) if proctree.maps_library(p, MAPPED_DRIVER)]


def _undo(cu: CudaCheckpoint, pids: list[int]) -> list[str]:
    problems: list[str] = []
    for pid in pids:
        try:
            st = cu.state(pid)
            if st is ProcessState.CHECKPOINTED:
                cu.restore(pid)
                st = ProcessState.LOCKED
            if st is ProcessState.LOCKED:
                cu.unlock(pid)
        except CudaCheckpointError as exc:
            problems.append(str(exc))
    return problems


def checkpoint_all(cu: CudaCheckpoint, pids: list[int], *, lock_timeout_ms: int) -> None:
    """Lock every PID, then checkpoint every PID; undo all on any failure."""
    moved: list[int] = []
    try:
        for pid in pids:
            cu.lock(pid, timeout_ms=lock_timeout_ms)
            moved.append(pid)
        for pid in pids:
            cu.checkpoint(pid)
    except CudaCheckpointError as exc:
        problems = _undo(cu, moved)
        extra = f" (and undoing it failed: {'; '.join(problems)})" if problems else " (processes resumed)"
        raise CudaCheckpointError(f"CUDA checkpoint of PIDs {pids} failed: {exc}{extra}") from exc


def restore_all(cu: CudaCheckpoint, pids: list[int]) -> None:
    """Restore every PID's device state, then unlock every PID."""
    for pid in pids:
        if cu.state(pid) is ProcessState.CHECKPOINTED:
            cu.restore(pid)
    for pid in pids:
        if cu.state(pid) is ProcessState.LOCKED:
            cu.unlock(pid)
