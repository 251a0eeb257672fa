"""App mode (``hpcckpt run --mode app``): the application checkpoints itself (hpcckpt's
``Checkpointer``, or its own saves); the supervisor only carries the signals to it and, where
there is no scheduler, brings it back after each exit 75 ("requeue me").

It lives here, in one place: under Slurm every signal the batch shell receives is passed on
(``lifecycle.supervise.run_forwarding``) and the application requeues itself through the
lifecycle; outside Slurm the local restart loop (``hpcckpt.lifecycle.restart.LocalSupervisor``) plays
the scheduler. It shares the lifecycle with the other modes and imports none of them.
"""
from __future__ import annotations

from .supervise import AppOptions, run_app

__all__ = ["AppOptions", "run_app"]
