"""``hpcckpt inspect DIR [--step S]``: what a checkpoint holds (manifest, tensors, metadata).

For a distributed checkpoint (format ``hpcckpt/2``) the global view comes first: each
shared tensor (dtype, global shape, replicated or sharded, size) with its pieces
(writer rank -> file, byte range of the tensor, crc32c), then each rank's local
tensors. The last line sums the bytes written per rank and in all against the
state's own bytes (each shared tensor once): 1.0 when nothing is written twice.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from .common import add_json, directory, emit, human_bytes

if TYPE_CHECKING:
    from ..store.catalog import CheckpointInfo


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="show a checkpoint's manifest and tensors", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
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


def _shape(shape: Any) -> str:
    return str(tuple(int(d) for d in shape))


def global_view(m: Mapping[str, Any]) -> dict[str, Any]:
    """The manifest's distributed layout as JSON: shared tensors with their pieces, local tensors, byte sums."""
    from ..store.shared import global_nbytes, state_bytes, written_bytes
    shared_tab = m.get("shared") or {}
    shared = []
    for name, spec in shared_tab.items():
        pieces = []
        for p in spec["pieces"]:
            rec = m["ranks"][str(p["rank"])]
            held = rec["tensors"].get(name, {})
            pieces.append({"rank": int(p["rank"]), "file": rec["file"], "start": int(p["start"]),
                           "nbytes": int(p["nbytes"]), "offset": held.get("offset"),
                           "crc32c": held.get("crc32c")})
        shared.append({"name": name, "dtype": spec["dtype"], "shape": list(spec["shape"]), "kind": spec["kind"],
                       "nbytes": global_nbytes(spec), "pieces": pieces})
    local = {str(r): [n for n in rec["tensors"] if n not in shared_tab]
             for r, rec in sorted(m["ranks"].items(), key=lambda kv: int(kv[0]))}
    written = written_bytes(m)
    total, state = sum(written.values()), state_bytes(m)
    return {"format": m.get("format", "hpcckpt/1"), "shared": shared, "local": local,
            "written_bytes": {str(r): n for r, n in sorted(written.items())}, "written_total": total,
            "state_bytes": state, "written_over_state": round(total / state, 4) if state else None}


def _tensor_line(name: str, dtype: str, shape: Any, nbytes: int, tail: str) -> str:
    return f"    {name:<60} {dtype:<9} {_shape(shape):<16} {human_bytes(nbytes):>10}  {tail}"


def run(args: argparse.Namespace) -> int:
    from ..store.manifest import as_records
    info = _info(directory(args.dir, option="DIR"), args.step)
    m = info.manifest
    if m is None or info.status != "committed":
        problems = info.problems or [info.status]
        emit(args, {"step": info.step, "path": str(info.path), "error": "; ".join(problems), "problems": problems},
             f"step {info.step}: {info.status.upper()} ({info.path})\n" + "\n".join(f"  - {p}" for p in problems))
        return 1
    raw_job = m.get("job")
    job: dict[str, Any] = raw_job if isinstance(raw_job, dict) else {}
    view = global_view(m)
    lines = [f"checkpoint step {m['step']} at {info.path}",
             f"  format {view['format']}, engine {m.get('engine')}, world size {m['world_size']}, "
             f"job {job.get('job_id')}, restart {job.get('restart_count')}"]
    shared = view["shared"]
    if shared:
        kinds = [s["kind"] for s in shared]
        lines.append(f"  shared tensors: {len(shared)} ({kinds.count('replicated')} replicated, "
                     f"{kinds.count('sharded')} sharded), {human_bytes(sum(s['nbytes'] for s in shared))}")
        for s in shared:
            lines.append(_tensor_line(s["name"], s["dtype"], s["shape"], s["nbytes"], s["kind"]))
            for p in s["pieces"]:
                crc = p["crc32c"] if isinstance(p["crc32c"], int) else 0
                lines.append(f"        rank {p['rank']:<4} -> {p['file']:<20} bytes {p['start']}..{p['start'] + p['nbytes']}"
                             f" ({human_bytes(p['nbytes'])})  crc32c {crc:#010x}")
    local_word = "local tensors" if shared else "tensors"
    for r, rec in sorted(m["ranks"].items(), key=lambda kv: int(kv[0])):
        names = view["local"][str(r)]
        lines.append(f"  rank {r}: {rec['file']} ({rec['format']}), {len(names)} {local_word}"
                     + (f" + {len(rec['tensors']) - len(names)} pieces of shared tensors" if shared else ""))
        for name in names:
            t = rec["tensors"][name]
            lines.append(_tensor_line(name, t["dtype"], t["shape"], t["nbytes"],
                                      f"crc32c {t.get('crc32c', 0):#010x}"))
    per_rank = ", ".join(f"rank {r} {human_bytes(n)}" for r, n in view["written_bytes"].items())
    ratio = view["written_over_state"]
    lines.append(f"  written: {per_rank}; in all {human_bytes(view['written_total'])}; state "
                 f"{human_bytes(view['state_bytes'])}; written/state "
                 + (f"{ratio:.2f}" if ratio is not None else "n/a"))
    emit(args, {"step": m["step"], "path": str(info.path), "manifest": as_records(m), **view}, "\n".join(lines))
    return 0
