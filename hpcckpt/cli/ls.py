"""``hpcckpt ls DIR``: every checkpoint with its status (committed, incomplete, corrupt)."""
from __future__ import annotations

import argparse
from pathlib import Path

from .common import add_json, directory, emit, human_bytes


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("ls", help="list checkpoints and their status", description=__doc__)
    p.add_argument("dir", type=Path)
    add_json(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..store import catalog
    from ..store.commit import read_latest
    infos = catalog.snapshot(directory(args.dir, option="DIR", must_exist=False))
    latest = read_latest(args.dir)
    rows = [i.to_json() for i in infos]
    lines = [f"{'step':>8}  {'status':<10} {'size':>10}  path"]
    for i in infos:
        mark = "  <- LATEST" if i.path.name == latest else ""
        lines.append(f"{i.step:>8}  {i.status:<10} {human_bytes(i.bytes):>10}  {i.path}{mark}")
    if not infos:
        lines = [f"no checkpoints under {args.dir}"]
    emit(args, rows, "\n".join(lines))
    return 0
