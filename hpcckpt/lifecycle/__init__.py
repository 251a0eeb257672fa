"""The job's lifecycle, one for every mode (in-process Checkpointer, CRIU, own checkpoints,
app, JIT guard).

``identity`` (who this run is, made once from the environment), ``ledger`` (the record
of what happened), ``records`` (the start and stop records' one schema), ``budget`` (how
often each cause may requeue; the one no-progress guard), ``requeue`` (the one routine that
puts the job back and records it), ``history`` (the record read back, one row per
interruption), ``stop`` (the in-process stop), ``timing`` and ``supervise`` (a supervised
command's stop: when it comes, the signal inbox, the one end-time watcher) and ``restart``
(the local restart loop outside Slurm). The Slurm adapter (``hpcckpt.cluster``) sits below:
it reads the environment and runs scheduler verbs, and never records.
"""
from __future__ import annotations

from .history import record_superseded
from .identity import Identity, current
from .requeue import requeue

__all__ = ["Identity", "current", "record_superseded", "requeue"]
