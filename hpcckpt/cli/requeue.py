"""``hpcckpt requeue``: requeue this Slurm job (or submit a successor if Slurm refuses).

Meant for batch scripts after ``srun`` exits 75 (EXIT_REQUEUE): every rank has
stopped, the final checkpoint is committed, and now the job goes back to the queue.
When the run already put itself back (its coordinator's requeue was confirmed, e.g. a
successor submitted), nothing more is done: one requeue per interruption.
Outside Slurm it exits 75 so that a local supervisor restarts the command.
The cause (for the per-cause budgets) defaults to the last ``stop`` in the ledger.

Exit codes: 0 requeued, successor submitted, or already done by the run; 1 not requeued
(refused by a budget / crash-loop guard, or Slurm refused and no successor could be
submitted: the reason is printed); 2 bad usage; 75 local (no Slurm).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from hpcckpt.cli.common import add_json, directory, emit
from hpcckpt.cluster import detect
from hpcckpt.cluster.base import Cause
from hpcckpt.errors import ConfigError
from hpcckpt.exitcodes import EXIT_REQUEUE
from hpcckpt.lifecycle import requeue
from hpcckpt.lifecycle.ledger import Ledger

_STOP_REASON_CAUSE = {"deadline": Cause.TIME_LIMIT, "maintenance": Cause.MAINTENANCE,
                      "drain": Cause.MAINTENANCE, "signal": Cause.SIGNAL, "error": Cause.FAILURE,
                      "rank_failure": Cause.RANK_FAILURE}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("requeue", help="requeue this Slurm job (successor job if refused)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cause", default=None,
                   help="time_limit | preemption | maintenance | signal | failure "
                        "(default: from the ledger's last stop)")
    p.add_argument("--dir", type=Path, default=None,
                   help="checkpoint directory: budgets and ledger live there (default $HPCCKPT_DIR)")
    add_json(p)
    p.set_defaults(func=run)


def _state_dir(arg: Path | None) -> Path:
    raw = arg or (Path(os.environ["HPCCKPT_DIR"]) if os.environ.get("HPCCKPT_DIR") else None)
    if raw is None:
        raise ConfigError("hpcckpt requeue needs the checkpoint directory: pass --dir DIR or set HPCCKPT_DIR")
    return directory(raw, option="--dir" if arg else "HPCCKPT_DIR", must_exist=False)


def _cause(text: str) -> Cause:
    cause = Cause.parse(text)
    if cause is Cause.UNKNOWN and text.strip().lower() != Cause.UNKNOWN.value:
        valid = ", ".join(c.value for c in Cause if c not in (Cause.UNKNOWN, Cause.DONE))
        raise ConfigError(f"--cause={text!r} is not a cause hpcckpt knows; use one of {valid}, "
                          "e.g. --cause time_limit")
    return cause


def _newest_run(ledger: Ledger) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The newest run's last ``stop`` and the ``requeue`` recorded after it (streamed)."""
    stop: dict[str, Any] | None = None
    req: dict[str, Any] | None = None
    for ev in ledger.events():
        name = ev.get("event")
        if name in {"start", "criu_restore"}:
            req = None
        elif name == "stop":
            stop, req = ev, None
        elif name == "requeue":
            req = ev
    return stop, req


def run(args: argparse.Namespace) -> int:
    state_dir = _state_dir(args.dir)
    ledger = Ledger(state_dir)
    stop, done = _newest_run(ledger)
    if done is not None and done.get("requeued") is True and done.get("method") != "exit":
        info = {k: done.get(k) for k in ("requeued", "method", "detail", "successor_job_id", "evidence")}
        emit(args, {**info, "already": True},
             f"hpcckpt requeue: already done by the run itself ({done.get('method')}): {done.get('detail')}")
        return 0
    cause = (_cause(args.cause) if args.cause
             else _STOP_REASON_CAUSE.get(str(stop.get("reason")) if stop else "", Cause.SIGNAL))
    committed = stop.get("committed_step") if stop else None
    outcome = requeue(cluster=detect(), state_dir=state_dir, cause=cause.value, source="cli",
                      committed_step=committed if isinstance(committed, int) else None, ledger=ledger)
    emit(args, outcome.as_dict(),
         f"hpcckpt requeue: {'requeued' if outcome.requeued else 'NOT requeued'} "
         f"({outcome.method}): {outcome.detail}")
    if outcome.method == "exit":
        return EXIT_REQUEUE
    return 0 if outcome.requeued else 1
