"""hpcckpt: keep PyTorch training jobs alive on Slurm.

Importing the package has no side effects (no signal handlers, no threads);
those start with a ``Checkpointer``.
"""
from __future__ import annotations

from .errors import (
    CheckpointCorrupt,
    CheckpointFailed,
    ClusterError,
    ConfigError,
    CriuError,
    CudaCheckpointError,
    HpcckptError,
    NativeMissing,
    NoCheckpoint,
)

__version__ = "0.1.0"

__all__ = ["Checkpointer", "preemptible", "ResumableSampler", "EXIT_REQUEUE", "HpcckptError", "ConfigError",
           "CheckpointCorrupt", "CheckpointFailed", "NoCheckpoint", "NativeMissing", "ClusterError",
           "CriuError", "CudaCheckpointError"]


def __getattr__(name: str) -> object:
    # torch is heavy: import the API lazily so `hpcckpt --help` and the CLI stay quick.
    if name in ("Checkpointer", "preemptible", "EXIT_REQUEUE", "RequeueExit"):
        from . import api
        return getattr(api, name)
    if name == "ResumableSampler":
        from .data import ResumableSampler
        return ResumableSampler
    raise AttributeError(f"module 'hpcckpt' has no attribute {name!r}")
