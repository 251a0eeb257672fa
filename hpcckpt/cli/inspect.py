"""``hpcckpt inspect DIR [--step S]``: what a checkpoint holds (manifest, tensors, metadata).

For a distributed checkpoint (format ``hpcckpt/2``) the global view comes first: each
shared tensor (dtype, global shape, replicated or sharded, size) with its pieces
(writer rank -> file, byte range of the tensor, crc32c), then each rank's local
tensors. A DTensor's shard is a region of its global tensor: its index ranges in every
dimension (``[256:511, 0:128]``; several ranges in a dimension where a strided shard
interleaves) and the byte ranges of the row-major tensor it covers (one, or how many,
how long, the first and the last). The last line sums the bytes written per rank and in all against the
state's own bytes (each shared tensor once): 1.0 when nothing is written twice.
"""
from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

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


LISTED_RANGES = 4  # byte ranges of a region listed in the JSON (first ones, and the last)


def region_view(piece: Mapping[str, Any], shape: list[int], itemsize: int) -> dict[str, Any] | None:
    """A region piece's index ranges per dimension and the byte ranges of the row-major tensor it
    covers (their count and length, the first ``LISTED_RANGES`` and the last); None for a range piece."""
    from ..store import regions
    if not regions.has_region(piece):
        return None
    region = regions.piece_region(piece, shape)
    index = [[[start, start + n] for start, n in runs] for runs in region]
    whole = regions.as_range(shape, region)
    if whole is not None:
        spans = [(whole[0] * itemsize, whole[1] * itemsize)]
        return {"index": index, "byte_ranges": 1, "range_bytes": spans[0][1] - spans[0][0],
                "first_ranges": [list(spans[0])], "last_range": list(spans[0])}
    count, last = 0, None
    first: list[list[int]] = []
    lengths: set[int] = set()
    for box in _boxes(region):
        n, length, starts, last_start = _box_ranges(shape, box, LISTED_RANGES - len(first))
        count += n
        lengths.add(length * itemsize)
        first += [[a * itemsize, (a + length) * itemsize] for a in starts]
        last = [last_start * itemsize, (last_start + length) * itemsize]
    return {"index": index, "byte_ranges": count,
            "range_bytes": lengths.pop() if len(lengths) == 1 else sorted(lengths),
            "first_ranges": first, "last_range": last}


def _boxes(region: Any) -> Any:
    from itertools import product
    for combo in product(*region):
        yield tuple(((s, n),) for s, n in combo)


def _box_ranges(shape: list[int], box: Any, listed: int) -> tuple[int, int, list[int], int]:
    """(how many contiguous ranges, their length, the first ``listed`` starts, the last start), in
    elements, of a box of a row-major tensor: the dimensions after the last partial one ``k`` are
    whole, and each index of the dimensions before ``k`` starts a range."""
    from itertools import islice, product
    ndim = len(shape)
    k = ndim - 1
    while k > 0 and box[k][0] == (0, int(shape[k])):
        k -= 1  # box[k] partial (or k == 0), every dimension after it whole
    inner = 1
    for d in shape[k + 1:]:
        inner *= int(d)
    length = box[k][0][1] * inner if ndim else 1

    def start(lead: tuple[int, ...]) -> int:
        i = 0
        for d, (j, runs) in enumerate(zip(shape, box)):
            i = i * int(j) + (lead[d] if d < k else runs[0][0])
        return i

    spans = [range(box[j][0][0], box[j][0][0] + box[j][0][1]) for j in range(k)]
    count = 1
    for r in spans:
        count *= len(r)
    first = [start(lead) for lead in islice(product(*spans), listed)]
    return count, length, first, start(tuple(r[-1] for r in spans))


def _index(index: list[list[list[int]]]) -> str:
    return "[" + ", ".join("{" + ",".join(f"{a}:{b}" for a, b in dim) + "}" if len(dim) > 1
                           else f"{dim[0][0]}:{dim[0][1]}" for dim in index) + "]"


def _region_text(r: dict[str, Any]) -> str:
    if r["byte_ranges"] == 1:
        a, b = r["first_ranges"][0]
        return f"{_index(r['index'])} = bytes {a}..{b} of the tensor"
    size = r["range_bytes"]
    each = human_bytes(size) if isinstance(size, int) else "/".join(human_bytes(x) for x in size)
    (a, b), (c, d) = r["first_ranges"][0], r["last_range"]
    return f"{_index(r['index'])} = {r['byte_ranges']} byte ranges of {each} of the tensor, {a}..{b} to {c}..{d}"


def global_view(m: Mapping[str, Any]) -> dict[str, Any]:
    """The manifest's distributed layout as JSON: shared tensors with their pieces, local tensors, byte sums."""
    from ..store.entry import dtype_itemsize
    from ..store.shared import global_nbytes, state_bytes, written_bytes
    shared_tab = m.get("shared") or {}
    shared = []
    for name, spec in shared_tab.items():
        pieces = []
        shape, itemsize = [int(d) for d in spec["shape"]], dtype_itemsize(spec["dtype"]) or 1
        for p in spec["pieces"]:
            rec = m["ranks"][str(p["rank"])]
            held = rec["tensors"].get(name, {})
            piece = {"rank": int(p["rank"]), "file": rec["file"], "start": int(p["start"]),
                     "nbytes": int(p["nbytes"]), "offset": held.get("offset"), "crc32c": held.get("crc32c")}
            region = region_view(p, shape, itemsize)
            if region is not None:
                piece["region"] = region
            pieces.append(piece)
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
                where = (_region_text(p["region"]) if "region" in p
                         else f"bytes {p['start']}..{p['start'] + p['nbytes']}")
                lines.append(f"        rank {p['rank']:<4} -> {p['file']:<20} {where}"
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
