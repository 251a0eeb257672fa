"""``hpcckpt scavenge LOCAL_ROOT``: commit to the shared level the newest checkpoint of a
node-local level that the shared level lacks (slurm/epilog runs it on every node of a job,
as the job's user, after the job ends: ``python -I -m hpcckpt.cli scavenge`` from ``/``, so
nothing in the user's directories is on its import path, in a PID namespace and a session of
its own that end whole at its limit, HPCCKPT_SCAVENGE_TIMEOUT).

LOCAL_ROOT is a node-local root of a checkpoint directory, e.g. ``<staging>/levels/<key>/``
or ``/dev/shm/hpcckpt-$UID/<key>/``: it holds ``.hpcckpt-level.json`` naming the shared
directory. Run it on each node that held the job's node-local checkpoints: the files of the
step are gathered from every node in a staging directory beside the shared level's
checkpoints, and the node that completes it verifies every byte and commits it.

Exit 0: committed, already current, nothing held, or this node's files added and the other
nodes' still to come; 1: refused or damaged (the message says why; nothing committed).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from ..exitcodes import EXIT_OK, EXIT_PROBLEM
from .common import add_json, emit


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("scavenge", help="commit a node-local checkpoint the shared level lacks (epilog)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("local", type=Path, metavar="LOCAL_ROOT", help="a node-local root (holding .hpcckpt-level.json)")
    add_json(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..store.scavenge import scavenge
    result = scavenge(args.local)
    emit(args, result.to_json(), f"{result.status}: {result.message}")
    return EXIT_OK if result.ok else EXIT_PROBLEM
