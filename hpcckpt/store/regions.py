"""Which elements of a global tensor a piece holds: the geometry of resharding. Imports no torch.

A piece of a distributed tensor is either

- a **range**: elements ``[a, b)`` of the tensor's row-major order (a stripe of a
  replicated tensor, the rows of a ``Shard(0)`` shard), or
- a **region**: for every dimension, a list of runs ``(start, length)`` of global indices;
  the piece holds their cartesian product, laid out row-major in the order of the runs
  (the local shard of a DTensor on any mesh: one run per dimension for ``Shard(d)`` on
  any dimension and 2-D meshes, several where a ``_StridedShard`` interleaves).

A range is cut into boxes (regions of one run per dimension) in row-major order
(``range_boxes``), so every reader meets one kind of piece; ``overlaps`` pairs the
elements of a piece with those of a destination, dimension by dimension.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import product
from typing import Any

Runs = tuple[tuple[int, int], ...]  # (start, length) runs of global indices along one dimension
Region = tuple[Runs, ...]  # one Runs per dimension


def volume(region: Region) -> int:
    n = 1
    for runs in region:
        n *= sum(length for _, length in runs)
    return n


def lengths(region: Region) -> tuple[int, ...]:
    """The shape of a piece holding ``region``."""
    return tuple(sum(length for _, length in runs) for runs in region)


def whole(shape: Sequence[int]) -> Region:
    return tuple(((0, int(d)),) for d in shape)


def box(offsets: Sequence[int], sizes: Sequence[int]) -> Region:
    return tuple(((int(o), int(n)),) for o, n in zip(offsets, sizes))


def is_box(region: Region) -> bool:
    return all(len(runs) == 1 for runs in region)


def first_index(shape: Sequence[int], region: Region) -> int:
    """Row-major index of the region's first element (its first run's start in each dimension)."""
    i = 0
    for d, runs in zip(shape, region):
        i = i * int(d) + (runs[0][0] if runs else 0)
    return i


def as_range(shape: Sequence[int], region: Region) -> tuple[int, int] | None:
    """Elements ``[a, b)`` when ``region`` is one row-major range of the tensor, else None.

    A box is a range when every dimension before some ``k`` has length 1 and every
    dimension after ``k`` is whole.
    """
    if not is_box(region):
        return None
    n = len(shape)
    k = 0
    while k < n and region[k][0][1] == 1:
        k += 1
    if k < n - 1 and any(region[j][0] != (0, int(shape[j])) for j in range(k + 1, n)):
        return None
    a = first_index(shape, region)
    return a, a + volume(region)


def range_boxes(shape: Sequence[int], a: int, b: int) -> list[Region]:
    """Elements ``[a, b)`` of a row-major tensor as boxes, in row-major order (each one a
    contiguous part of the range: at most ``2 * ndim - 1`` of them)."""
    shape = tuple(int(d) for d in shape)
    if a >= b:
        return []
    if not shape:
        return [()]
    inner = 1
    for d in shape[1:]:
        inner *= d
    if inner == 0:
        return []
    rest = shape[1:]

    def row(r: int, lo: int, hi: int) -> list[Region]:
        head: Region = (((r, 1),),)
        return [head + sub for sub in range_boxes(rest, lo, hi)] if rest else [head]

    r0, r_last = a // inner, (b - 1) // inner
    if r0 == r_last:
        return row(r0, a - r0 * inner, b - r0 * inner)
    out: list[Region] = []
    if a % inner:
        out += row(r0, a % inner, inner)
        r0 += 1
    r_end = b // inner
    if r_end > r0:
        out.append((((r0, r_end - r0),),) + whole(rest))
    if b % inner:
        out += row(r_end, 0, b % inner)
    return out


def _pairs(src: Runs, dst: Runs) -> list[tuple[int, int, int]]:
    """(position in src, position in dst, length) of every overlap of two run lists."""
    out = []
    ps = 0
    for s, sn in src:
        pd = 0
        for d, dn in dst:
            lo, hi = max(s, d), min(s + sn, d + dn)
            if hi > lo:
                out.append((ps + lo - s, pd + lo - d, hi - lo))
            pd += dn
        ps += sn
    return out


def overlaps(src: Region, dst: Region) -> Iterator[tuple[tuple[slice, ...], tuple[slice, ...]]]:
    """(slices into a piece holding ``src``, slices into one holding ``dst``) of every block of
    elements both hold; nothing when they share none."""
    per_dim = [_pairs(s, d) for s, d in zip(src, dst)]
    if any(not p for p in per_dim):
        return
    for combo in product(*per_dim):
        yield (tuple(slice(ps, ps + n) for ps, _, n in combo), tuple(slice(pd, pd + n) for _, pd, n in combo))


def intersects(src: Region, dst: Region) -> bool:
    return all(_pairs(s, d) for s, d in zip(src, dst))


# -- the manifest's form ---------------------------------------------------------------

def piece_fields(region: Region) -> dict[str, Any]:
    """A region as a manifest piece records it: ``offsets``/``lengths`` for a box, ``runs`` otherwise."""
    if is_box(region):
        return {"offsets": [runs[0][0] for runs in region], "lengths": [runs[0][1] for runs in region]}
    return {"runs": [[list(r) for r in runs] for runs in region]}


def has_region(piece: Any) -> bool:
    return isinstance(piece, dict) and ("offsets" in piece or "runs" in piece)


def _int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{v!r} is not a whole number")
    return v


def piece_region(piece: Any, shape: Sequence[int]) -> Region:
    """The region a manifest piece with ``offsets``/``lengths`` or ``runs`` holds.

    ValueError when the fields are malformed or leave the tensor's bounds.
    """
    ndim = len(shape)
    if "runs" in piece:
        runs = piece["runs"]
        if not isinstance(runs, list) or len(runs) != ndim:
            raise ValueError(f"runs {runs!r} are not one list per dimension of {ndim}")
        region = tuple(tuple((_int(r[0]), _int(r[1])) for r in dim if isinstance(r, list) and len(r) == 2)
                       for dim in runs)
        if any(len(out) != len(dim) for out, dim in zip(region, runs)):
            raise ValueError(f"runs {runs!r} are not [start, length] pairs")
    else:
        offs, lens = piece.get("offsets"), piece.get("lengths")
        if not (isinstance(offs, list) and isinstance(lens, list) and len(offs) == len(lens) == ndim):
            raise ValueError(f"offsets {offs!r} and lengths {lens!r} are not one number per dimension of {ndim}")
        region = box([_int(o) for o in offs], [_int(n) for n in lens])
    for d, (size, runs) in enumerate(zip(shape, region)):
        for start, n in runs:
            if start < 0 or n < 1 or start + n > int(size):
                raise ValueError(f"run ({start}, {n}) leaves dimension {d} of size {size}")
    return region


def tiling_problem(shape: Sequence[int], regions: Sequence[Region]) -> str | None:
    """Why ``regions`` do not cover a tensor of ``shape`` exactly once (None when they do).

    Every region in bounds, their volumes summing to the tensor's, no two sharing an
    element: a sweep along the dimension whose first runs differ most, comparing only
    regions whose extents overlap there.
    """
    total = 1
    for d in shape:
        total *= int(d)
    boxes: list[Region] = []
    for region in regions:
        boxes.extend(tuple(((s, n),) for s, n in combo) for combo in product(*region))
    covered = sum(volume(b) for b in boxes)
    if covered != total:
        return f"pieces cover {covered} of its {total} elements"
    if len(boxes) < 2 or not shape:
        return None
    axis = max(range(len(shape)), key=lambda d: len({b[d][0][0] for b in boxes}))
    boxes.sort(key=lambda b: b[axis][0][0])
    active: list[Region] = []
    for b in boxes:
        start = b[axis][0][0]
        active = [a for a in active if a[axis][0][0] + a[axis][0][1] > start]
        for a in active:
            if intersects(a, b):
                at = [runs[0][0] for runs in b]
                return f"pieces overlap near index {at}"
        active.append(b)
    return None
