"""What a failed dump means for the job, said loudly, and who is told by signal.

A failed dump leaves the job running (criu resumes the frozen tree; CUDA state is
restored and unlocked). The trigger signal is then forwarded only to processes that
catch it (SigCgt in /proc/PID/status): the job's root (PID 2 inside) when it does,
else those of its descendants that do. A process without a handler would be killed
by it (USR2's default action) and lose all its work: exactly what hpcckpt is there
to prevent. Such a job simply runs on to its natural end or the scheduler's kill,
as if hpcckpt were not there.

No requeue from an older image: the running job is ahead of it (restoring would
throw that progress away), and that image stays the one a later run would restore.
"""
from __future__ import annotations

import signal
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CriuError, CudaCheckpointError, NoCheckpoint
from ..proc import tree as proctree
from . import images, ops


@dataclass(frozen=True, kw_only=True)
class FailureReport:
    error: str
    signame: str
    forwarded_to: list[int] = field(default_factory=list)
    catchers_inner: list[int] = field(default_factory=list)
    older_image: str | None = None
    fix: str = ""
    stuck: bool = False  # a CUDA process may be left locked: the job does not really run on

    def as_dict(self) -> dict[str, Any]:
        return {"error": self.error, "signame": self.signame, "forwarded_to": self.catchers_inner,
                "older_image": self.older_image, "requeue_from_older": False, "fix": self.fix,
                "stuck": self.stuck}

    def lines(self) -> list[str]:
        told = (f"forwarded {self.signame} to the job's processes that catch it (PIDs {self.catchers_inner} "
                "inside its namespace), so it can save itself" if self.catchers_inner else
                f"NOT forwarding {self.signame}: no process of the job catches it, and it would kill the job"
                + ("" if self.stuck else "; the job keeps running to its natural end or the scheduler's kill"))
        older = (f"an older image {self.older_image} exists; not requeueing from it: the running job is ahead "
                 "of it (it stays the image a later run restores)" if self.older_image else
                 "no older image exists")
        head = ("CRIU DUMP FAILED; THE JOB MAY BE STUCK (a CUDA process may be left locked: its CUDA calls "
                "block until it is unlocked)" if self.stuck else "CRIU DUMP FAILED; the job keeps running")
        return ["!" * 72, f"{head}. Why: {self.error}", told, older,
                f"What to change: {self.fix}", "!" * 72]


def catchers(job: ops.Job, sig: signal.Signals) -> list[int]:
    """Host PIDs to tell: the job's root if it catches ``sig``, else its descendants that do."""
    if proctree.catches(job.app_pid, sig):
        return [job.app_pid]
    return [p for p in proctree.tree(job.app_pid)[1:] if proctree.catches(p, sig)]


def _fix(exc: BaseException, sig: signal.Signals, root: Path) -> str:
    from ..cuda.driver import CudaQueryTimedOut

    if _caused_by(exc, CudaQueryTimedOut):
        cause = ("the CUDA driver did not answer a state query (nothing was locked or changed); check the "
                 "node's driver (nvidia-smi, dmesg) and signal again, or use --mode app")
    elif isinstance(exc, CudaCheckpointError):
        cause = ("the CUDA checkpoint failed (see the message: NCCL, CUDA IPC, UVM, MIG/MPS are not supported); "
                 "use --mode app with hpcckpt's in-process checkpoints for such a job")
    elif isinstance(exc, CriuError):
        cause = (f"read criu's log under {root / 'logs'}; common causes: too little space for the image in "
                 f"{root}, established TCP connections (--tcp-established), unix sockets to outside the job "
                 "(--ext-unix-sk), devices the job holds open")
    else:
        cause = f"check that {root} is writable and has room for an image about the job's memory size"
    return (f"{cause}. To survive a failed dump, let the job save itself on {sig.name} "
            "(install a handler; hpcckpt then forwards the signal to it)")


def _chain(exc: BaseException | None) -> Iterator[BaseException]:
    """``exc`` and the exceptions it came from (``raise ... from``, or raised while handling),
    20 at most (a cycle ends there)."""
    for _ in range(20):
        if exc is None:
            return
        yield exc
        exc = exc.__cause__ or exc.__context__


def _caused_by(exc: BaseException | None, kind: type) -> bool:
    return any(isinstance(e, kind) for e in _chain(exc))


def _older_image(root: Path, consumed: str | None) -> str | None:
    try:
        image = images.newest(root)
    except NoCheckpoint:
        return None
    # A consumed image belongs to a finished run; a stale one is behind the job: neither
    # is "the image a later run restores".
    return None if image.name == consumed or images.stale(root, image) else image.name


def is_stuck(exc: BaseException | None) -> bool:
    """Whether a failure (or one it came from) may have left CUDA state locked: a stuck
    lock/checkpoint/restore/unlock, or an undo that failed (their messages say STUCK). A
    state query that timed out changed nothing: the job keeps running."""
    from ..cuda.driver import _NEEDS_TARGET_RUNNING, CudaCallStuck, CudaQueryTimedOut

    return any((isinstance(e, CudaCallStuck) and e.what in _NEEDS_TARGET_RUNNING)
               or (not isinstance(e, CudaQueryTimedOut) and "STUCK" in str(e)) for e in _chain(exc))


def report(job: ops.Job, sig: signal.Signals, exc: BaseException, *, root: Path,
           consumed: str | None) -> FailureReport:
    told = catchers(job, sig)
    return FailureReport(error=str(exc), signame=sig.name, forwarded_to=told,
                         catchers_inner=[proctree.inner_pid(p) or p for p in told],
                         older_image=_older_image(root, consumed), fix=_fix(exc, sig, root), stuck=is_stuck(exc))
