"""One exception hierarchy for everything hpcckpt raises on purpose.

Every message names the thing (path, job id, tensor) and how to fix it.
"""
from __future__ import annotations


class HpcckptError(Exception):
    """Base class of every error hpcckpt raises deliberately."""


class ConfigError(HpcckptError, ValueError):
    """An option or environment variable has a value hpcckpt cannot use."""


class CheckpointCorrupt(HpcckptError):
    """A checkpoint exists on disk but fails verification."""


class StateRefused(CheckpointCorrupt):
    """A checkpoint that reads back intact holds state a registered object refuses.

    Either that state is damaged (the resume falls back to the checkpoint before it) or
    the user's code changed since it was saved; then every checkpoint is refused alike
    (the same ``key``) and ``advice`` says what to do.
    """

    def __init__(self, message: str, *, key: str, advice: str) -> None:
        super().__init__(message)
        self.key = key
        self.advice = advice


class NoCheckpoint(HpcckptError):
    """No committed checkpoint that verifies could be found."""


class NativeMissing(HpcckptError, ImportError):
    """The compiled core `hpcckpt._native` could not be imported."""


class ClusterError(HpcckptError):
    """A scheduler command failed or returned something unexpected."""


class CriuError(HpcckptError):
    """CRIU is missing, too old, or a dump/restore failed."""


class CudaCheckpointError(HpcckptError):
    """The CUDA driver's checkpoint API is unavailable or failed."""


class CheckpointFailed(HpcckptError):
    """A save did not become durable; the previous checkpoint is untouched.

    On several ranks, ``rank_errors`` maps each failing rank to its message.
    """

    def __init__(self, message: str, rank_errors: dict[int, str] | None = None) -> None:
        self.rank_errors = dict(rank_errors or {})
        if self.rank_errors:
            detail = "; ".join(f"rank {r}: {e}" for r, e in sorted(self.rank_errors.items()))
            message = f"{message} ({detail})"
        super().__init__(message)
