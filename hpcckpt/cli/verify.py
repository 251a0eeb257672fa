"""``hpcckpt verify DIR [--step S]``: re-read every byte and check every checksum.

Exit 0 when the checkpoint verifies, 1 naming each damaged file/tensor otherwise,
3 when there is no such checkpoint.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .common import add_json, directory, emit

if TYPE_CHECKING:
    from ..store.catalog import CheckpointInfo

VANISH_RETRIES = 50


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("verify", help="fully verify a checkpoint (default: the newest)", description=__doc__)
    p.add_argument("dir", type=Path)
    p.add_argument("--step", type=int, default=None)
    p.add_argument("--all", action="store_true", help="verify every checkpoint, not only one")
    add_json(p)
    p.set_defaults(func=run)


def _newest(root: Path) -> CheckpointInfo:
    """The newest step directory, fully verified; a newer one replaces it if it is pruned meanwhile."""
    from ..errors import NoCheckpoint
    from ..store import catalog
    for _attempt in range(VANISH_RETRIES):
        infos = [i for i in catalog.snapshot(root) if catalog.STEP_RE.match(i.path.name)]
        if not infos:
            raise NoCheckpoint(f"no checkpoints under {root}")
        newest = max(infos, key=lambda i: i.step)  # whatever its status: that is what resume tries first
        full = catalog.inspect_step(root, newest.step, full=True)
        if full is not None:
            return full
    raise NoCheckpoint(f"checkpoints under {root} kept being removed while verified (another job is pruning it)")


def _one(root: Path, step: int) -> CheckpointInfo:
    from ..errors import NoCheckpoint
    from ..store import catalog
    catalog.find(root, step)  # NoCheckpoint naming the steps present
    full = catalog.inspect_step(root, step, full=True)
    if full is None:
        raise NoCheckpoint(f"checkpoint step {step} under {root} was removed (retention) while being verified")
    return full


def _targets(args: argparse.Namespace) -> list[CheckpointInfo]:
    from ..store import catalog
    root = directory(args.dir, option="DIR")
    if args.all:
        names = [i for i in catalog.snapshot(root) if catalog.STEP_RE.match(i.path.name)]
        if names:  # each fully verified; one pruned meanwhile is left out, not reported as damaged
            return [f for i in names if (f := catalog.inspect_step(root, i.step, full=True)) is not None]
    if args.step is not None:
        return [_one(root, args.step)]
    return [_newest(root)]


def run(args: argparse.Namespace) -> int:
    results: list[dict[str, Any]] = [{"step": i.step, "path": str(i.path), "ok": not i.problems, "problems": i.problems}
               for i in _targets(args)]
    ok = all(r["ok"] for r in results)
    text = "\n".join(
        f"step {r['step']}: OK ({r['path']})" if r["ok"] else
        f"step {r['step']}: CORRUPT ({r['path']})\n" + "\n".join(f"  - {p}" for p in r["problems"])
        for r in results)
    emit(args, {"ok": ok, "checkpoints": results}, text)
    return 0 if ok else 1
