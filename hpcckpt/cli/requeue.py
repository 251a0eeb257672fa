"""``hpcckpt requeue``: requeue this Slurm job (or submit a successor if Slurm refuses).

Meant for batch scripts after ``srun`` exits 75 (EXIT_REQUEUE): every rank has
stopped, the final checkpoint is committed, and now the job goes back to the queue.
Outside Slurm it exits 75 so that a local supervisor restarts the command.
The cause (for the per-cause budgets) defaults to the last ``stop`` in the ledger.

Exit codes: 0 requeued or successor submitted; 1 refused by a budget / crash-loop
guard (the reason is printed); 2 bad usage; 4 Slurm failed; 75 local (no Slurm).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from hpcckpt.cli.common import add_json, directory, emit
from hpcckpt.cluster import detect
from hpcckpt.cluster.base import Cause
from hpcckpt.errors import ConfigError
from hpcckpt.exitcodes import EXIT_REQUEUE
from hpcckpt.ledger import Ledger

_STOP_REASON_CAUSE = {"deadline": Cause.TIME_LIMIT, "maintenance": Cause.MAINTENANCE,
                      "drain": Cause.MAINTENANCE, "signal": Cause.SIGNAL, "error": Cause.FAILURE}


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
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


def _last_stop(events: list[dict[str, object]]) -> dict[str, object] | None:
    return next((e for e in reversed(events) if e.get("event") == "stop"), None)


def run(args: argparse.Namespace) -> int:
    state_dir = _state_dir(args.dir)
    events = Ledger(state_dir).read()
    stop = _last_stop(events)
    cause = (_cause(args.cause) if args.cause
             else _STOP_REASON_CAUSE.get(str(stop.get("reason")) if stop else "", Cause.SIGNAL))
    committed = stop.get("committed_step") if stop else None
    # The in-step ranks deferred to us; the batch shell itself is not a step.
    os.environ.pop("HPCCKPT_REQUEUE_FROM_BATCH", None)
    cluster = detect()
    outcome = cluster.requeue(cause.value, state_dir,
                              committed_step=committed if isinstance(committed, int) else None)
    Ledger(state_dir).append("requeue", source="cli", **outcome.as_dict())
    emit(args, outcome.as_dict(),
         f"hpcckpt requeue: {'requeued' if outcome.requeued else 'NOT requeued'} "
         f"({outcome.method}): {outcome.detail}")
    if outcome.method == "exit":
        return EXIT_REQUEUE
    return 0 if outcome.requeued else 1
