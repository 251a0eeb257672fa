"""Just-in-time checkpoints after a rank fails (JITC): see ``hpcckpt.jit.guard``."""
from __future__ import annotations

from .guard import DEFAULT_TIMEOUT_S, TIMEOUT_ENV, JitGuard, requeue_cause

__all__ = ["JitGuard", "DEFAULT_TIMEOUT_S", "TIMEOUT_ENV", "requeue_cause"]
