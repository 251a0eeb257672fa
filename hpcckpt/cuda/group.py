"""Checkpointing every CUDA process of a process tree as one unit.

A CUDA process is one with CUDA state, not one that maps libcuda: a CPU-only job
with a CUDA build of torch maps the driver but never creates a context, and the
driver answers its state query with CUDA_ERROR_NOT_INITIALIZED (or INVALID_VALUE).
Such a process is skipped, unless it still holds /dev/nvidia* files or mappings (a
job still starting CUDA, a child forked from a CUDA parent without exec, an NVML
user): criu cannot dump those and the CUDA API cannot release them, which is a clear
error, never a dump. Every process of the tree is checked for such files, not only
those that map libcuda (nvidia-smi or a pynvml monitor holds /dev/nvidiactl without
it). A state query failing with any other code, for a process that holds no
/dev/nvidia* files, also means no context (there can be none without them).

Order matters: every process is LOCKED before any is CHECKPOINTED. Locking one
process while a peer still runs can leave the peer waiting on work the locked one
will never do; the two-phase order keeps the tree consistent. On failure the
processes already moved are brought back to RUNNING, so a failed CUDA checkpoint
leaves the job running.
"""
from __future__ import annotations

from collections.abc import Callable

from ..errors import CudaCheckpointError
from ..proc import tree as proctree
from .driver import (
    MAPPED_DRIVER,
    NO_CONTEXT_CODES,
    CudaCallFailed,
    CudaCallStuck,
    CudaCheckpoint,
    CudaNoContext,
    ProcessState,
)


def driver_mappers(root: int) -> list[int]:
    """PIDs in the tree under ``root`` that have the CUDA driver library mapped."""
    return [p for p in proctree.tree(root) if proctree.maps_library(p, MAPPED_DRIVER)]


def _who(pid: int) -> str:
    return f"PID {pid} ({proctree.command(pid) or '?'})"


def _no_context(pid: int, *, because: str | None = None) -> None:
    """``pid`` maps libcuda and has no CUDA context: fine, unless it holds GPU device files.

    ``because``: the driver could not be used, so the handles are the only evidence."""
    held = proctree.nvidia_handles(pid)
    if held and because is not None:
        raise CudaCheckpointError(
            f"{_who(pid)} holds {', '.join(held)} (it uses the GPU), but the CUDA checkpoint API cannot be "
            f"used here: {because}. Fix the driver (the checkpoint API needs CUDA 12.8, driver >= 570), "
            "or use --mode app")
    if held:
        raise CudaCheckpointError(
            f"{_who(pid)} has no CUDA context but holds {', '.join(held)}: criu cannot dump GPU device files "
            "and the CUDA checkpoint API cannot release them without a context. Either (1) it was still "
            "starting CUDA when the dump signal came (the GPU opened, no context yet): nothing was changed, "
            "send the signal again once the job is training (with Slurm, a --signal lead time that falls after "
            "start-up); or (2) it was forked from a CUDA process without exec: start such workers with the "
            "'spawn' method (e.g. DataLoader(multiprocessing_context='spawn')); or (3) it uses the GPU only "
            "through NVML (nvidia-smi, pynvml): run such monitors outside the job. Otherwise use --mode app")


def _gpu_without_driver(pid: int, held: list[str]) -> CudaCheckpointError:
    return CudaCheckpointError(
        f"{_who(pid)} holds {', '.join(held)} without the CUDA driver library (a process using NVML, such as "
        "nvidia-smi or a pynvml GPU monitor, or one forked from a CUDA process without exec): criu cannot dump "
        "GPU device files and the CUDA checkpoint API cannot release them. Run GPU monitors outside the job "
        "(outside `hpcckpt run`, e.g. in the batch script or another job step), start worker processes with "
        "the 'spawn' method, or use --mode app")


def cuda_pids(root: int, *, driver: Callable[[], CudaCheckpoint] = CudaCheckpoint,
              log: Callable[[str], None] = lambda _m: None) -> list[int]:
    """PIDs in the tree under ``root`` that have CUDA state (see the module docstring).

    Every process of the tree is looked at: one that holds /dev/nvidia* files without
    libcuda mapped (NVML only) can never be dumped, and is a clear error naming it."""
    everyone = proctree.tree(root)
    mappers = [p for p in everyone if proctree.maps_library(p, MAPPED_DRIVER)]
    for pid in everyone:
        if pid not in mappers:
            held = proctree.nvidia_handles(pid)
            if held:
                raise _gpu_without_driver(pid, held)
    if not mappers:
        return []
    try:
        cu = driver()
    except CudaCheckpointError as exc:
        # The driver cannot be used here (missing, too old for the checkpoint API, cuInit
        # failing): a context cannot be asked about, but it cannot exist without the GPU's
        # device files either. No /dev/nvidia* handles: a CPU process (a CPU job with a CUDA
        # build of torch must not fail every dump). Handles: a clear error from _no_context.
        for pid in mappers:
            _no_context(pid, because=str(exc))
        log(f"PIDs {mappers} map a CUDA driver library, but the driver cannot be used ({exc}); they hold no "
            "/dev/nvidia* files: treating them as CPU processes")
        return []
    found = []
    for pid in mappers:
        if _has_context(cu, pid, log):
            found.append(pid)
    return found


def _has_context(cu: CudaCheckpoint, pid: int, log: Callable[[str], None]) -> bool:
    try:
        state = cu.probe(pid)
    except CudaNoContext as exc:  # gone meanwhile (a worker that ended): nothing to checkpoint
        log(f"PID {pid} is not a CUDA process ({exc}): left to criu as it is")
        return False
    except CudaCallFailed as exc:
        # An error code other than the known "no context" ones (never seen on a node for a
        # process without a context, but not ruled out): without /dev/nvidia* files there
        # cannot be a context, so it is a CPU process; with them it is a real failure.
        held = proctree.nvidia_handles(pid)
        if held:
            raise CudaCheckpointError(f"cannot tell whether {_who(pid)} has CUDA state: {exc}; it holds "
                                      f"{', '.join(held)}") from exc
        log(f"PID {pid}: the driver's state query failed ({exc}), but it holds no /dev/nvidia* files, so it has "
            "no CUDA context: dumped as a CPU process")
        return False
    if state is None:
        _no_context(pid)
        log(f"PID {pid} maps libcuda but has no CUDA context: dumped as a CPU process")
        return False
    return True


def _not_running(cu: CudaCheckpoint, pid: int) -> str | None:
    """None when the driver says ``pid`` is RUNNING; else what is wrong with it."""
    try:
        st = cu.state(pid)
    except CudaCheckpointError as exc:
        return f"PID {pid}: its CUDA state cannot be read ({exc})"
    if st is ProcessState.RUNNING:
        return None
    if st is ProcessState.FAILED:
        return (f"PID {pid} is in CUDA state FAILED (a checkpoint or restore of it failed inside the driver; "
                "its GPU state cannot be trusted)")
    return f"PID {pid} is left {st.name}, not RUNNING"


def _undo(cu: CudaCheckpoint, pids: list[int]) -> list[str]:
    """Bring every PID back to RUNNING, best effort: one that fails does not stop the rest.
    Each PID's state is read again at the end: anything but RUNNING is a problem."""
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
            problems.append(f"PID {pid}: {exc}")
            continue
        left = _not_running(cu, pid)
        if left:
            problems.append(left)
    return problems


def resume_all(cu: CudaCheckpoint, pids: list[int]) -> None:
    """After a failed dump: give every PID its GPU back (best effort for each).

    Raises CudaCheckpointError naming every PID left locked or checkpointed: such a
    process is stuck (its CUDA calls block), and the caller must say so plainly."""
    problems = _undo(cu, pids)
    if problems:
        raise CudaCheckpointError(
            "CUDA state could not be brought back after the failed dump, so the job is STUCK (its CUDA "
            f"calls block until it is unlocked): {'; '.join(problems)}. Try `hpcckpt cuda restore PID` and "
            "`hpcckpt cuda unlock PID`; otherwise cancel the job (its last committed checkpoint is intact)")


def _lock_all(cu: CudaCheckpoint, pids: list[int], moved: list[int], *, lock_timeout_ms: int) -> list[int]:
    locked = []
    for pid in pids:
        try:
            cu.lock(pid, timeout_ms=lock_timeout_ms)
        except CudaCallFailed as exc:
            if exc.code not in NO_CONTEXT_CODES:
                raise
            _no_context(pid)  # the lock, not only the query, says: no context
            continue
        moved.append(pid)
        locked.append(pid)
    return locked


def checkpoint_all(cu: CudaCheckpoint, pids: list[int], *, lock_timeout_ms: int) -> list[int]:
    """Lock every PID, then checkpoint every PID; undo all on any failure.

    Returns the PIDs checkpointed (those that turned out to have no context are left out)."""
    moved: list[int] = []
    try:
        locked = _lock_all(cu, pids, moved, lock_timeout_ms=lock_timeout_ms)
        for pid in locked:
            cu.checkpoint(pid)
    except CudaCheckpointError as exc:
        problems = _undo(cu, moved)
        extra = (f"; and undoing it failed, so the job is STUCK (its CUDA calls block until it is unlocked): "
                 f"{'; '.join(problems)}. Try `hpcckpt cuda restore PID` and `hpcckpt cuda unlock PID`; otherwise "
                 "cancel the job (its last committed checkpoint is intact)" if problems else
                 "" if isinstance(exc, CudaCallStuck) else " (processes resumed)")
        raise CudaCheckpointError(f"CUDA checkpoint of PIDs {pids} failed: {exc}{extra}") from exc
    return locked


def restore_all(cu: CudaCheckpoint, pids: list[int], pairs: list[tuple[str, str]] | None = None) -> None:
    """Restore every PID's device state (onto other GPUs per ``pairs``), then unlock every PID.

    Raises CudaCheckpointError unless the driver then says every PID is RUNNING (a process
    in CU_PROCESS_STATE_FAILED, or any other state, is never reported as restored)."""
    for pid in pids:
        if cu.state(pid) is ProcessState.CHECKPOINTED:
            cu.restore(pid, pairs)
    for pid in pids:
        if cu.state(pid) is ProcessState.LOCKED:
            cu.unlock(pid)
    bad = [why for why in (_not_running(cu, pid) for pid in pids) if why]
    if bad:
        raise CudaCheckpointError(f"CUDA restore of PIDs {pids} did not leave them running: {'; '.join(bad)}")
