"""Options and lease: what a ``Checkpointer`` is made of, from its resolved options.

The options are resolved once (``config.resolve_options``); each function here takes the
values its part needs and hands back the part: the stop's policy and the figures earlier
allocations measured, the directory's writer lease (or the refusal every rank learns), the
levels and the engine.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from ..cluster.base import Cluster
from ..config import CheckpointOptions, env_value, read_internal
from ..engines import Engine, SaveContext, make_engine
from ..levels import Levels
from ..lifecycle.history import record_superseded
from ..lifecycle.identity import Identity, current
from ..lifecycle.ledger import Ledger
from ..policy import AutoInterval, Figures, Policy
from ..ranks import Ranks
from ..state import TrainState
from ..store.lock import WriterBusy, WriterLease, usable_root


def train_state(options: CheckpointOptions, ranks: Ranks) -> TrainState:
    """The registry of the objects to save, for this rank."""
    state = TrainState()
    state.rank, state.world = ranks.rank, ranks.world
    state.replicated = options.replicated
    state.check_replicas = options.check_replicas
    return state


def stop_policy(options: CheckpointOptions, cluster: Cluster, root: Path) -> tuple[Policy, Figures]:
    """When to save and when to stop, seeded with the costs earlier allocations measured."""
    # With levels, periodic saves are node-local ones; the shared level's are drained from them.
    policy = Policy(options.local_every_steps or options.every_steps, margin_s=options.deadline_margin_s,
                    auto=AutoInterval(overhead_bound=options.overhead_bound) if options.auto_interval else None,
                    background=bool(getattr(cluster, "remote", False)))
    figures = Figures.read(root)
    policy.seed(figures)
    policy.warning_window_s = env_value("warning_window_s", 300.0)
    policy.poll_s = env_value("poll_s", policy.poll_s)
    return policy, figures


def check_trace() -> Path | None:
    """``hpcckpt check``'s trace file (digests of the state at each step), when it runs this script."""
    trace = (read_internal("CHECK_TRACE") or "").strip()
    return Path(trace) if trace else None


def take_lease(root: Path, me: Identity, ranks: Ranks, ledger: Ledger) -> WriterLease:
    """The coordinator holds the directory's writer lease until ``close``; every rank learns a refusal.
    The directory is made first if needed (a ConfigError naming it and the fix, never a raw OSError)."""
    usable_root(root)
    lease = WriterLease(root, job_id=me.raw_job_id, restart=me.restart, job=me.job_id)
    refusal: dict[str, Any] | None = None
    if ranks.is_coordinator:
        try:
            lease.acquire()
        except WriterBusy as exc:
            refusal = {"message": str(exc), "job_id": exc.holder_job_id}
    refusal = ranks.broadcast_json(refusal)
    if refusal is None:
        return lease
    ranks.close()
    if not current().in_slurm:
        raise WriterBusy(refusal["message"], holder_job_id=refusal["job_id"])
    # Under Slurm a second live job on this directory is a duplicate of this run (a
    # successor and a requeued original both started): the one without the lease is
    # superseded. It says so once, records it, and leaves quietly (status 0, not FAILED).
    if ranks.is_coordinator:
        record_superseded(ledger, holder=refusal["message"], holder_job_id=refusal["job_id"])
        print(f"hpcckpt: superseded: {refusal['message']}; this run leaves without training "
              "(status 0)", file=sys.stderr, flush=True)
    raise SystemExit(0)


def open_engine(options: CheckpointOptions, ranks: Ranks, cluster: Cluster, me: Identity) -> tuple[Levels | None, Engine]:
    """The levels (with ``local_every_steps``) and the engine that writes this rank's saves."""
    levels = Levels.make(options, ranks, me.node, cluster.env.staging_dir()) \
        if options.local_every_steps is not None else None
    ctx = SaveContext(root=levels.local if levels else options.dir, keep=options.keep,
                      job=current(cluster.env.environ).as_job(cluster.name), user={}, levels=levels)
    engine = make_engine(options.engine, ctx, ranks, options.concurrent if options.engine == "concurrent" else None)
    return levels, engine
