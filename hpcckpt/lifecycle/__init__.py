"""The job's lifecycle, one for every mode (in-process Checkpointer, CRIU, JIT guard).

``identity`` (who this run is, made once from the environment), ``ledger`` (the record
of what happened), ``budget`` (how often each cause may requeue), ``requeue`` (the one
routine that puts the job back and records it) and ``history`` (the record read back,
one row per interruption). The Slurm adapter (``hpcckpt.cluster``) sits below: it reads
the environment and runs scheduler verbs, and never records.
"""
from __future__ import annotations

from .history import record_superseded
from .identity import Identity, current
from .requeue import requeue

__all__ = ["Identity", "current", "record_superseded", "requeue"]
