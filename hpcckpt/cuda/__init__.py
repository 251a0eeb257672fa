"""CUDA process checkpointing through the driver API (see ``driver``)."""
from __future__ import annotations

from .driver import (
    CudaCallFailed,
    CudaCallStuck,
    CudaCheckpoint,
    CudaDriverMissing,
    CudaDriverTooOld,
    CudaNoContext,
    CudaProcessStopped,
    CudaQueryTimedOut,
    ProcessState,
    require_cuda_process,
)
from .group import checkpoint_all, cuda_pids, restore_all

__all__ = ["CudaCallFailed", "CudaCallStuck", "CudaCheckpoint", "CudaDriverMissing", "CudaDriverTooOld",
           "CudaNoContext", "CudaProcessStopped", "CudaQueryTimedOut", "ProcessState", "require_cuda_process",
           "checkpoint_all", "cuda_pids", "restore_all"]
