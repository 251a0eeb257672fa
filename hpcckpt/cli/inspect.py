"""``hpcckpt inspect DIR [--step S]``: what a checkpoint holds (manifest, tensors, metadata)."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from .common import add_json, directory, emit, human_bytes

if TYPE_CHECKING:
    from ..store.catalog import CheckpointInfo


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("inspect", help="show a checkpoint's manifest and tensors", description=__doc__)
    p.add_argument("dir", type=Path)
    p.add_argument("--step", type=int, default=None)
    add_json(p)
    p.set_defaults(func=run)


def _info(root: Path, step: int | None) -> CheckpointInfo:
    """The checkpoint to show, cheaply checked; the next newest if retention removes it meanwhile."""
    from ..errors import NoCheckpoint
    from ..store import catalog
    for _attempt in range(50):
        found = catalog.find(root, step)
        info = catalog.inspect_step(root, found.step)
        if info is not None:
            return info
    raise NoCheckpoint(f"checkpoints under {root} kept being removed while read (another job is pruning it)")


def run(args: argparse.Namespace) -> int:
    info = _info(directory(args.dir, option="DIR"), args.step)
    m = info.manifest
    if m is None or info.status != "committed":
        problems = info.problems or [info.status]
        emit(args, {"step": info.step, "path": str(info.path), "error": "; ".join(problems), "problems": problems},
             f"step {info.step}: {info.status.upper()} ({info.path})\n" + "\n".join(f"  - {p}" for p in problems))
        return 1
    job = m.get("job") if isinstance(m.get("job"), dict) else {}
    lines = [f"checkpoint step {m['step']} at {info.path}",
             f"  engine {m.get('engine')}, world size {m['world_size']}, job {job.get('job_id')}, "
             f"restart {job.get('restart_count')}"]
    for r, rec in sorted(m["ranks"].items(), key=lambda kv: int(kv[0])):
        lines.append(f"  rank {r}: {rec['file']} ({rec['format']}), {len(rec['tensors'])} tensors")
        for name, t in rec["tensors"].items():
            lines.append(f"    {name:<60} {t['dtype']:<9} {str(tuple(t['shape'])):<16} "
                         f"{human_bytes(t['nbytes']):>10}  crc32c {t.get('crc32c', 0):#010x}")
    emit(args, {"step": m["step"], "path": str(info.path), "manifest": m}, "\n".join(lines))
    return 0
