"""The commit-time half of ``placement``: the manifest's ``shared`` table from every rank's
commit record, and what a reader asks of it. Imports no torch: the coordinator's commit
(``manifest.build``) and manifest readers (``ls``, ``verify``, ``scavenge``) use it, and
importing torch costs a fresh process ~1.5-2 CPU-seconds.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from ..errors import CheckpointFailed
from . import regions
from .entry import dtype_itemsize

REPLICATED, SHARDED = "replicated", "sharded"
KINDS = (REPLICATED, SHARDED)


def digest(shared: Mapping[str, Any]) -> str:
    """A short fingerprint of a shared table, to check that every rank planned the same tensors."""
    return hashlib.sha256(json.dumps(shared, sort_keys=True).encode()).hexdigest()[:16]


def merge_shared(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The manifest's ``shared`` table from every rank's record; strips the planning fields.

    CheckpointFailed when the ranks planned different tensors or the pieces do not
    tile every shared tensor exactly (nothing is committed then).
    """
    table = records[0].get("shared") or {}
    if len(records) > 1:  # one rank has no other to differ from
        want = digest(table)
        odd = [r for r, rec in enumerate(records) if rec.get("shared_digest", want) != want]
        if odd:
            raise CheckpointFailed(f"ranks {odd} captured other distributed tensors than rank 0 (names, shapes or "
                                   "dtypes of replicated/sharded state differ); every rank must register the same "
                                   "model and optimizer")
        _check_fingerprints(records)
    out = {name: {**spec, "pieces": []} for name, spec in table.items()}
    for r, rec in enumerate(records):
        for name, where in (rec.pop("pieces", None) or {}).items():
            nbytes = int(rec["tensors"][name]["nbytes"])
            if isinstance(where, dict):  # a DTensor's shard: its region of the global tensor
                out[name]["pieces"].append({"rank": r, "start": int(where["start"]), "nbytes": nbytes,
                                            **{k: v for k, v in where.items() if k != "start"}})
            else:
                out[name]["pieces"].append({"rank": r, "start": int(where), "nbytes": nbytes})
        rec.pop("shared", None)
        rec.pop("shared_digest", None)
        rec.pop("fingerprints", None)
    for name, spec in out.items():
        spec["pieces"].sort(key=lambda p: p["start"])
        problem = tiling_problem(spec)
        if problem:
            raise CheckpointFailed(f"shared tensor {name!r}: {problem}; nothing was committed")
    return out


def _check_fingerprints(records: list[dict[str, Any]]) -> None:
    """CheckpointFailed naming the first tensor declared replicated whose bytes differ between ranks."""
    want = records[0].get("fingerprints") or {}
    for r, rec in enumerate(records[1:], start=1):
        got = rec.get("fingerprints") or {}
        odd = sorted(n for n in want if n in got and got[n] != want[n])
        if odd:
            raise CheckpointFailed(
                f"tensor {odd[0]!r} is declared replicated but its bytes differ between rank 0 and rank {r} "
                f"({len(odd)} such tensors); it is not a replica: register the DDP module itself, or set "
                "replicated='none' (HPCCKPT_REPLICATED=none) so that every rank writes its own copy")


def global_nbytes(spec: Mapping[str, Any]) -> int:
    n = dtype_itemsize(spec["dtype"])
    if n is None:
        raise ValueError(f"shared tensor dtype {spec['dtype']!r} is not a plain torch dtype")
    for d in spec["shape"]:
        n *= int(d)
    return n


def tiling_problem(spec: Mapping[str, Any]) -> str | None:
    """Why ``spec``'s pieces do not cover its bytes exactly once (None when they do).

    Pieces are byte ranges of the row-major tensor, or (a DTensor's shards on any mesh)
    regions: global ``offsets``/``lengths`` in every dimension, or ``runs`` of indices
    (``regions``); a region's ``nbytes`` is its volume's and its ``start`` the byte of its
    first element.
    """
    if any(regions.has_region(p) for p in spec["pieces"]):
        return _region_tiling_problem(spec)
    cursor = 0
    for p in spec["pieces"]:
        if p["start"] != cursor:
            return (f"pieces leave bytes {cursor}..{p['start']} uncovered" if p["start"] > cursor
                    else f"pieces overlap at byte {p['start']}")
        cursor += p["nbytes"]
    total = global_nbytes(spec)
    if cursor != total:
        return f"pieces cover {cursor} of its {total} bytes"
    return None


def _region_tiling_problem(spec: Mapping[str, Any]) -> str | None:
    shape = [int(d) for d in spec["shape"]]
    itemsize = dtype_itemsize(spec["dtype"]) or 1
    found: list[regions.Region] = []
    for p in spec["pieces"]:
        try:
            if regions.has_region(p):
                region = [regions.piece_region(p, shape)]
            else:
                region = regions.range_boxes(shape, int(p["start"]) // itemsize,
                                             (int(p["start"]) + int(p["nbytes"])) // itemsize)
        except (ValueError, TypeError, KeyError) as exc:
            return f"piece of rank {p.get('rank')!r} has no readable region ({exc})"
        n = sum(regions.volume(r) for r in region) * itemsize
        if n != int(p["nbytes"]):
            return f"piece of rank {p.get('rank')!r} holds {p['nbytes']} bytes, its region {n}"
        if region and int(p["start"]) != regions.first_index(shape, region[0]) * itemsize:
            return f"piece of rank {p.get('rank')!r} starts at byte {p['start']}, not at its region's first element"
        found.extend(region)
    return regions.tiling_problem(shape, found)


def written_bytes(manifest: Mapping[str, Any]) -> dict[int, int]:
    """Tensor bytes each rank wrote into a checkpoint (pieces and local tensors)."""
    return {int(r): sum(int(e["nbytes"]) for e in rec.get("tensors", {}).values())
            for r, rec in manifest["ranks"].items()}


def state_bytes(manifest: Mapping[str, Any]) -> int:
    """Bytes of the state itself: each shared tensor once, plus rank 0's local tensors."""
    shared = manifest.get("shared") or {}
    local = sum(int(e["nbytes"]) for n, e in manifest["ranks"]["0"].get("tensors", {}).items() if n not in shared)
    return local + sum(global_nbytes(s) for s in shared.values())


def source_rank(rank: int, saved_world: int) -> int:
    """The saved rank whose local state (RNG, buffers, sampler, metadata) rank ``rank`` restores."""
    return rank % saved_world
