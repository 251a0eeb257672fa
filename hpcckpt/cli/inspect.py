"""``hpcckpt inspect DIR [--step S]``: what a checkpoint holds (manifest, tensors, metadata)."""
from __future__ import annotations

import argparse
from pathlib import Path

from .common import add_json, emit, human_bytes


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("inspect", help="show a checkpoint's manifest and tensors", description=__doc__)
    p.add_argument("dir", type=Path)
    p.add_argument("--step", type=int, default=None)
    add_json(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..errors import CheckpointCorrupt
    from ..store import catalog
    from ..store.commit import read_manifest
    info = catalog.find(args.dir, args.step)
    try:
        m = read_manifest(info.path)
    except CheckpointCorrupt as exc:
        emit(args, {"step": info.step, "path": str(info.path), "error": str(exc)}, f"step {info.step}: {exc}")
        return 1
    lines = [f"checkpoint step {m['step']} at {info.path}",
             f"  engine {m['engine']}, world size {m['world_size']}, job {m.get('job', {}).get('job_id')}, "
             f"restart {m.get('job', {}).get('restart_count')}"]
    for r, rec in sorted(m["ranks"].items(), key=lambda kv: int(kv[0])):
        lines.append(f"  rank {r}: {rec['file']} ({rec['format']}), {len(rec['tensors'])} tensors")
        for name, t in rec["tensors"].items():
            lines.append(f"    {name:<60} {t['dtype']:<9} {str(tuple(t['shape'])):<16} "
                         f"{human_bytes(t['nbytes']):>10}  crc32c {t['crc32c']:#010x}")
    emit(args, {"step": m["step"], "path": str(info.path), "manifest": m}, "\n".join(lines))
    return 0
