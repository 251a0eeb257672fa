"""``hpcckpt verify DIR [--step S]``: re-read every byte and check every checksum.

Exit 0 when the checkpoint verifies, 1 naming each damaged file/tensor otherwise,
3 when there is no such checkpoint.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from .common import add_json, directory, emit


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("verify", help="fully verify a checkpoint (default: the newest)", description=__doc__)
    p.add_argument("dir", type=Path)
    p.add_argument("--step", type=int, default=None)
    p.add_argument("--all", action="store_true", help="verify every checkpoint, not only one")
    add_json(p)
    p.set_defaults(func=run)


def _target(args: argparse.Namespace) -> list[tuple[int, Path]]:
    from ..errors import NoCheckpoint
    from ..store import catalog
    infos = [i for i in catalog.scan(directory(args.dir, option="DIR")) if catalog.STEP_RE.match(i.path.name)]
    if args.all and infos:
        return [(i.step, i.path) for i in infos]
    if args.step is not None:
        return [(i.step, i.path) for i in [catalog.find(args.dir, args.step)]]
    if not infos:
        raise NoCheckpoint(f"no checkpoints under {args.dir}")
    newest = max(infos, key=lambda i: i.step)  # the newest, whatever its status: that is what resume tries first
    return [(newest.step, newest.path)]


def run(args: argparse.Namespace) -> int:
    from ..store import catalog
    results: list[dict[str, Any]] = []
    for step, path in _target(args):
        _, problems = catalog.check(path, full=True)
        results.append({"step": step, "path": str(path), "ok": not problems, "problems": problems})
    ok = all(r["ok"] for r in results)
    text = "\n".join(
        f"step {r['step']}: OK ({r['path']})" if r["ok"] else
        f"step {r['step']}: CORRUPT ({r['path']})\n" + "\n".join(f"  - {p}" for p in r["problems"])
        for r in results)
    emit(args, {"ok": ok, "checkpoints": results}, text)
    return 0 if ok else 1
