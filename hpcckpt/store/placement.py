"""Who writes which bytes of a distributed state (manifest format ``hpcckpt/2``).

A rank's captured state has three kinds of tensors:

- **replicated**: identical on every rank (the parameters of a
  ``DistributedDataParallel`` module whose group spans the world, and the state of
  an optimizer over such parameters). Declared by the setup, never guessed. Written
  once, balanced by bytes over the ranks (``_stripe``): tensors under 256 KiB are dealt
  whole, the larger ones are cut at element boundaries into pieces written by
  consecutive ranks (at most one piece per tensor per rank), so that every rank writes
  ``1/world`` of the replicated bytes.
- **sharded**: a ``DTensor`` (FSDP2 ``fully_shard``) whose placements are ``Shard(0)``
  or ``Replicate``: its local shard is a contiguous row range of the global tensor;
  the rank writes it (only the first replica of it, when a mesh dimension replicates).
- **local**: everything else (RNG states, module buffers, the sampler...), written by
  every rank for itself, as in format ``hpcckpt/1``.

Every piece is named after its tensor in the writer's rank file; ``plan`` returns the
tensors this rank writes (views of live memory, no copy) and the record fields the
commit turns into the manifest's ``shared`` table (``merge_shared``). A piece's
``start`` is a byte offset in the tensor's row-major bytes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from .._core import crc32c
from ..errors import ConfigError
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
    pieces: dict[str, int] = field(default_factory=dict)  # name -> start byte of this rank's piece
    fingerprints: dict[str, int] = field(default_factory=dict)  # replicated name -> crc32c (check_replicas)


_PLAIN = frozenset((torch.Tensor, torch.nn.Parameter))


def _is_dtensor(t: Any) -> bool:
    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter:  # nearly every tensor: no lookup
        return False
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without the distributed package
        return False
    return isinstance(t, DTensor)


def dtensor_range(t: Any, name: str) -> tuple[torch.Tensor, int, bool]:
    """(local tensor, start byte in the global tensor, whether this rank is the shard's first replica).

    ConfigError for placements whose local part is not a contiguous row range.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for p in t.placements:
        if not (isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim == 0)):
            raise ConfigError(
                f"state tensor {name!r} is a DTensor placed as {tuple(t.placements)}; hpcckpt saves DTensors "
                "sharded on dim 0 (Shard(0), FSDP2's default) or replicated. Shard parameters on dim 0 "
                "(fully_shard's default shard_placement_fn)")
    local = t.to_local()
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    if tuple(local.shape) != tuple(shape):
        raise ConfigError(f"state tensor {name!r}: its local shard has shape {tuple(local.shape)}, the mesh "
                          f"says {tuple(shape)} (a padded or uneven local tensor); report this as a bug")
    row = local.element_size()
    for d in t.shape[1:]:
        row *= int(d)
    coord = t.device_mesh.get_coordinate() or []
    first = all(c == 0 for c, p in zip(coord, t.placements) if isinstance(p, Replicate))
    return local, int(offset[0]) * row if len(t.shape) else 0, first


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
            local, start, first = dtensor_range(t, name)
            out.shared[name] = {"dtype": dtype_name(t.dtype), "shape": list(t.shape), "kind": SHARDED}
            if first and local.numel():
                out.tensors[name] = local.detach() if local.is_contiguous() else local.detach().contiguous()
                out.pieces[name] = start
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
