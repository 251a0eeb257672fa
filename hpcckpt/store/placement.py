"""Who writes which bytes of a distributed state (manifest format ``hpcckpt/2``).

A rank's captured state has three kinds of tensors:

- **replicated**: identical on every rank (the parameters of a
  ``DistributedDataParallel`` module whose group spans the world, and the state of
  an optimizer over such parameters). Declared by the setup, never guessed. Written
  once, balanced by bytes over the ranks (``_stripe``): tensors under 256 KiB are dealt
  whole, the larger ones are cut at element boundaries into pieces written by
  consecutive ranks (at most one piece per tensor per rank), so that every rank writes
  ``1/world`` of the replicated bytes.
- **sharded**: a ``DTensor`` on a mesh of any number of dimensions over every rank
  (FSDP2 ``fully_shard``, HSDP, tensor parallelism, FSDP2 x TP), placed by any mix of
  ``Shard(d)``, ``_StridedShard`` and ``Replicate``, shards uneven or empty: the rank
  writes its local shard (only the first replica of it, when a mesh dimension
  replicates), and records the region of the global tensor it holds (global
  ``offsets``/``lengths`` in every dimension, or ``runs`` of indices where a strided
  shard interleaves; ``regions``), computed by DTensor's own placement arithmetic.
  ``Partial`` is refused: a term of a pending sum is not a part of the value.
- **local**: everything else (RNG states, module buffers, the sampler...), written by
  every rank for itself, as in format ``hpcckpt/1``.

Every piece is named after its tensor in the writer's rank file; ``plan`` returns the
tensors this rank writes (views of live memory, no copy) and the record fields the
commit turns into the manifest's ``shared`` table (``merge_shared``). A piece's
``start`` is a byte offset in the tensor's row-major bytes (for a region, that of its
first element).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import torch

from .._core import crc32c
from ..errors import ConfigError
from . import regions
from .entry import dtype_name, raw_bytes
from .shared import REPLICATED, SHARDED, digest

FORMAT_V1 = "hpcckpt/1"
FORMAT = "hpcckpt/2"
SPLIT_MIN_BYTES = 256 << 10  # smaller replicated tensors are written whole (one piece, no tiny I/O)


@dataclass(frozen=True)
class Placement:
    """This process's place in the job: rank, world, and the tensors declared replicated."""

    rank: int = 0
    world: int = 1
    replicated: frozenset[str] = frozenset()
    replicated_prefixes: tuple[str, ...] = ()

    def is_replicated(self, name: str) -> bool:
        return name in self.replicated or any(name.startswith(p) for p in self.replicated_prefixes)


@dataclass
class Plan:
    """What this rank writes and what it tells the commit about the shared tensors."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> bytes to write (a piece or whole)
    shared: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> {dtype, shape, kind}
    # name -> start byte of this rank's piece; a DTensor's shard: {"start", and its region (regions.piece_fields)}
    pieces: dict[str, Piece] = field(default_factory=dict)
    fingerprints: dict[str, int] = field(default_factory=dict)  # replicated name -> crc32c (check_replicas)


Piece = int | dict[str, Any]

_PLAIN = frozenset((torch.Tensor, torch.nn.Parameter))


def _is_dtensor(t: Any) -> bool:
    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter:  # nearly every tensor: no lookup
        return False
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without the distributed package
        return False
    return isinstance(t, DTensor)


def _partial_error(name: str, placements: Any) -> ConfigError:
    return ConfigError(
        f"state tensor {name!r} is a DTensor placed as {tuple(placements)}: a Partial placement holds on each "
        "rank a term of a sum (or max) not yet reduced, not a part of the value, so no set of its bytes is the "
        "tensor a checkpoint must hold. Reduce it before saving (t.redistribute(placements=[Replicate() or "
        "Shard(d) ...]) or t.full_tensor()), or keep it out of the registered state")


def _placement_types() -> tuple[type, ...]:
    from torch.distributed.tensor import Replicate, Shard
    try:
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:  # pragma: no cover - a torch without strided shards
        return Replicate, Shard
    return Replicate, Shard, _StridedShard


def _runs_of(index: torch.Tensor) -> regions.Runs:
    """Sorted global indices as (start, length) runs."""
    if index.numel() == 0:
        return ()
    breaks = torch.nonzero(index[1:] - index[:-1] != 1).flatten().tolist()
    starts = [0] + [b + 1 for b in breaks]
    ends = [b + 1 for b in breaks] + [index.numel()]
    return tuple((int(index[a]), b - a) for a, b in zip(starts, ends))


@lru_cache(maxsize=4096)
def _region(shape: tuple[int, ...], mesh_shape: tuple[int, ...], coord: tuple[int, ...],
            placements: tuple[Any, ...]) -> regions.Region:
    """The global indices, per dimension, of the local shard at mesh ``coord``.

    DTensor's own arithmetic (``torch.distributed.tensor._utils``, as
    ``compute_local_shape_and_global_offset`` applies it): each mesh dimension's
    ``Shard``/``_StridedShard`` placement in turn picks the indices of the ones before it
    along its tensor dimension, uneven chunks and strided interleaving as torch lays them
    out. ``compute_local_shape_and_global_offset`` returns only each dimension's first
    index; a strided shard's indices may not be one run.
    """
    from torch.distributed.tensor._utils import _get_shard_size_and_offsets
    replicate = _placement_types()[0]
    local = list(shape)
    index: dict[int, torch.Tensor] = {}
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, replicate):
            continue
        d = p.dim
        size, offsets = _get_shard_size_and_offsets(local[d], mesh_shape[mesh_dim], coord[mesh_dim], p,
                                                    index.get(d), shape[d], False)
        assert offsets is not None  # skip_offset=False
        local[d] = size
        index[d] = offsets[:size] if size else offsets[:0]
    return tuple(_runs_of(index[d]) if d in index else (((0, n),) if n else ()) for d, n in enumerate(shape))


def dtensor_region(t: Any, name: str) -> tuple[torch.Tensor, regions.Region, bool]:
    """(local tensor, the region of the global tensor it holds, whether this rank is its first replica).

    Any placement of ``Shard(d)``, ``_StridedShard`` and ``Replicate`` on a mesh of any
    number of dimensions, uneven shards included (a rank may hold nothing). ConfigError
    naming the tensor for a ``Partial`` placement or one hpcckpt does not know.
    """
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    known = _placement_types()
    for p in t.placements:
        if p.is_partial():
            raise _partial_error(name, t.placements)
        if not isinstance(p, known):
            raise ConfigError(f"state tensor {name!r} is a DTensor placed as {tuple(t.placements)}; hpcckpt saves "
                              "DTensors whose placements are Shard, _StridedShard and Replicate. Redistribute it "
                              "to those before saving")
    mesh = t.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:
        raise ConfigError(f"state tensor {name!r} is a DTensor on a mesh this rank is not part of")
    shape = tuple(int(d) for d in t.shape)
    region = _region(shape, tuple(int(d) for d in mesh.shape), tuple(int(c) for c in coord), tuple(t.placements))
    local = t.to_local()
    want_shape, offset = compute_local_shape_and_global_offset(t.shape, mesh, t.placements)
    got = regions.lengths(region)
    if tuple(local.shape) != got or tuple(want_shape) != got or (
            local.numel() and tuple(int(o) for o in offset) != tuple(runs[0][0] for runs in region)):
        raise ConfigError(f"state tensor {name!r} ({tuple(t.placements)}): its local shard has shape "
                          f"{tuple(local.shape)}, the mesh says {tuple(want_shape)} at {tuple(offset)}, hpcckpt "
                          f"computed {got}; a padded local tensor, or a placement hpcckpt reads wrongly: "
                          "report this as a bug")
    first = all(c == 0 for c, p in zip(coord, t.placements) if isinstance(p, known[0]))
    return local, region, first


def dtensor_range(t: Any, name: str) -> tuple[torch.Tensor, int, bool]:
    """(local tensor, start byte in the global tensor, whether this rank is the shard's first replica)
    for a shard that is one row-major range of its tensor (``Shard(0)``, ``Replicate``);
    ConfigError for any other."""
    local, region, first = dtensor_region(t, name)
    span = regions.as_range(t.shape, region) if local.numel() else (0, 0)
    if span is None:
        raise ConfigError(f"state tensor {name!r} ({tuple(t.placements)}): its local shard is not one range "
                          "of the tensor's bytes")
    return local, span[0] * local.element_size(), first


def plan(tensors: Mapping[str, torch.Tensor], where: Placement, *, fingerprint: bool = False) -> Plan:
    """Split ``tensors`` (a capture, live memory) into what this rank writes.

    ``fingerprint``: also checksum every replicated tensor whole (a debug mode: the
    commit then refuses a checkpoint whose "replicas" differ between ranks).
    """
    out = Plan()
    if where.world == 1 and set(map(type, tensors.values())) <= _PLAIN:  # one rank, no DTensor: all of it
        out.tensors = dict(tensors)
        return out
    replicated: list[tuple[str, torch.Tensor]] = []
    for name, t in tensors.items():
        if _is_dtensor(t):
            local, region, first = dtensor_region(t, name)
            mesh_size = t.device_mesh.size()  # type: ignore[attr-defined]  # a DTensor
            if mesh_size != where.world:
                raise ConfigError(
                    f"state tensor {name!r} is a DTensor on a mesh of {mesh_size} of the job's "
                    f"{where.world} ranks: the ranks outside it hold other copies hpcckpt cannot tell equal. Place "
                    "it on a mesh over every rank (a 2-D mesh with Replicate() on the data-parallel dimension, as "
                    "fully_shard on that mesh does)")
            out.shared[name] = {"dtype": dtype_name(t.dtype), "shape": list(t.shape), "kind": SHARDED}
            if first and local.numel():
                out.tensors[name] = local.detach() if local.is_contiguous() else local.detach().contiguous()
                out.pieces[name] = {"start": regions.first_index(t.shape, region) * local.element_size(),
                                    **regions.piece_fields(region)}
        elif where.world > 1 and where.is_replicated(name):
            replicated.append((name, t))
        else:
            out.tensors[name] = t
    _stripe(replicated, where, out)
    if fingerprint:
        out.fingerprints = {n: crc32c(raw_bytes(t.detach().cpu().contiguous())) for n, t in replicated}
    return out


def _stripe(tensors: list[tuple[str, torch.Tensor]], where: Placement, out: Plan) -> None:
    """Rank ``where.rank``'s share of the replicated tensors, balanced by bytes.

    Small tensors (under ``SPLIT_MIN_BYTES``) are dealt whole, largest first, each to
    the rank with the fewest bytes so far; the large ones, concatenated in capture
    order, are then cut so that every rank's total comes to ``total / world``: each
    rank takes one contiguous range of them (at most one piece per tensor). Every rank
    computes the same assignment from the same shapes, with no communication.
    """
    sizes = [t.numel() * t.element_size() for _, t in tensors]
    for name, t in tensors:
        out.shared[name] = {"dtype": dtype_name(t.dtype), "shape": list(t.shape), "kind": REPLICATED}
    load = [0] * where.world
    small = sorted((i for i, n in enumerate(sizes) if n < SPLIT_MIN_BYTES), key=lambda i: (-sizes[i], i))
    for i in small:
        r = min(range(where.world), key=lambda k: (load[k], k))
        load[r] += sizes[i]
        if r == where.rank and sizes[i]:
            out.tensors[tensors[i][0]] = tensors[i][1].detach()
            out.pieces[tensors[i][0]] = 0
    large = [i for i, n in enumerate(sizes) if n >= SPLIT_MIN_BYTES]
    big = sum(sizes[i] for i in large)
    target = -(-sum(sizes) // where.world)
    quota = [max(0, target - load[k]) for k in range(where.world)]
    total_quota = sum(quota) or 1
    below = sum(quota[:where.rank])
    lo, hi = big * below // total_quota, big * (below + quota[where.rank]) // total_quota
    if where.rank == where.world - 1:
        hi = big
    cursor = 0
    for i in large:
        name, t = tensors[i]
        size, nbytes = t.element_size(), sizes[i]
        # Each cut point rounded down to elements the same way by both ranks sharing it.
        a = min(max(lo - cursor, 0), nbytes) // size * size
        b = min(max(hi - cursor, 0), nbytes) // size * size
        if b > a:
            flat = t.detach().reshape(-1) if t.is_contiguous() else t.detach().contiguous().reshape(-1)
            out.tensors[name] = t.detach() if (a, b) == (0, nbytes) else flat[a // size:b // size]
            out.pieces[name] = a
        cursor += nbytes


_EMPTY_DIGEST = digest({})  # a rank with nothing shared (every save of a single rank): computed once


def record_fields(p: Plan, *, coordinator: bool) -> dict[str, Any]:
    """The fields a rank adds to its commit record (the whole table from the coordinator only)."""
    fields: dict[str, Any] = {"pieces": p.pieces, "shared_digest": digest(p.shared) if p.shared else _EMPTY_DIGEST}
    if p.fingerprints:
        fields["fingerprints"] = p.fingerprints
    if coordinator:
        fields["shared"] = p.shared
    return fields
