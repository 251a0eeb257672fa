"""Reading one rank's state out of a committed checkpoint, whatever wrote it.

``load_rank`` dispatches on the manifest's format once; every reader verifies each
tensor's (or piece's) crc32c as it reads, and none unpickles anything.

- ``hpcckpt/1``: each rank's file holds its whole state; a resume needs the same
  number of ranks.
- ``hpcckpt/2`` (``store.placement``): distributed tensors are pieces spread over the
  rank files. Any world size can resume: rank ``r`` reads every piece it needs
  (all of a replicated tensor, only the pieces that overlap its own shard for a live
  DTensor, whatever the mesh and placements that saved it: resharding, ``regions``)
  from whichever files hold them, and takes its local state and metadata tree from
  saved rank ``r % saved_world``.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import CheckpointCorrupt, ConfigError
from ..state import Flat
from . import catalog, hdf5, rankfile, regions
from .hdf5 import TensorEntry
from .hostmem import one_cuda_device
from .manifest import DISTRIBUTED_FORMATS
from .names import HDF5
from .placement import _is_dtensor, dtensor_region
from .shared import source_rank


def load_rank(info: catalog.CheckpointInfo, rank: int, world: int, *, into: Mapping[str, Any] | None = None,
              stats: dict[str, Any] | None = None) -> Flat:
    """Read and verify rank ``rank``'s state (of ``world`` ranks now) from a committed checkpoint.

    ``into``: live tensors by flat name (``TrainState.capture(plan=False)``); tensors
    are read straight into those that match (``hdf5.read_tensors``; CUDA ones through
    pinned chunks; a DTensor's local shard), torch archives are not. Optimizer state
    the live optimizer does not hold yet is read onto the GPU too when ``into`` is a
    ``LiveTensors`` whose optimizer's parameters are all on that CUDA device
    (``_optimizer_homes``). ``stats`` receives the reader's figures,
    ``in_place_bytes`` (live memory overwritten) and ``device_bytes`` included.
    """
    manifest = info.manifest
    if manifest is None:
        raise CheckpointCorrupt(f"{info.path} has no readable manifest")
    saved = int(manifest["world_size"])
    v2 = manifest.get("format") in DISTRIBUTED_FORMATS
    if saved != world and not v2:
        raise ConfigError(
            f"{info.path} was saved by {saved} ranks in format {manifest.get('format', 'hpcckpt/1')}, "
            f"which records no distributed layout; this job has {world}. Resume with {saved} ranks once; "
            "its next checkpoints can then be resumed on any number of ranks.")
    src = source_rank(rank, saved) if v2 else rank
    if into:  # one GPU per process: the staged reader pins for, and copies on, one device
        one_cuda_device((t.device for t in into.values() if isinstance(t, torch.Tensor) and not _is_dtensor(t)),
                        f"restore of {info.path}")
    shared = dict(manifest.get("shared") or {}) if v2 else {}
    rec = manifest["ranks"][str(src)]
    _, entries = catalog.rank_entries(manifest, src)
    for name in [n for n in entries if n not in shared and into is not None and _is_dtensor(into.get(n))]:
        # Saved whole by one rank (a local tensor), resumed sharded: one piece, read by range.
        e = entries[name]
        shared[name] = {"dtype": e.dtype, "shape": list(e.shape), "kind": "replicated",
                        "pieces": [{"rank": src, "start": 0, "nbytes": e.nbytes}]}
    local = {n: e for n, e in entries.items() if n not in shared}
    in_place: dict[str, Any] = {}
    try:
        tensors = _read_local(info, rec, local, into, in_place)
        if shared:
            tensors.update(_read_shared(info, manifest, shared, into, in_place, rec.get("meta")))
    finally:
        if stats is not None:
            stats.update(in_place.get("stats", {}))
            stats["in_place_bytes"] = in_place.get("in_place_bytes", 0)
    return Flat(tensors=tensors, meta=json.loads(json.dumps(rec["meta"])))


def _add_stats(acc: dict[str, Any], got: Mapping[str, Any]) -> None:
    """Sum a reader's figures into ``acc`` (byte counts and seconds add up; the rest is the last seen)."""
    figures = acc.setdefault("stats", {})
    for k, v in got.items():
        if k == "in_place_bytes":
            acc["in_place_bytes"] = acc.get("in_place_bytes", 0) + int(v)
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and isinstance(figures.get(k), (int, float)):
            figures[k] = figures[k] + v
        else:
            figures[k] = v


def _read_local(info: catalog.CheckpointInfo, rec: Mapping[str, Any], entries: dict[str, TensorEntry],
                into: Mapping[str, Any] | None, acc: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The saving rank's own tensors, from its file."""
    path = info.path / rec["file"]
    homes = _optimizer_homes(rec.get("meta"), entries, into) if rec.get("format") == HDF5 else {}
    targets = into if getattr(into, "overwrite", True) else None  # else shapes only: new memory
    stats: dict[str, Any] = {}
    try:
        return rankfile.read(path, rec, entries, into={**(targets or {}), **homes} if homes else targets,
                             stats=stats)
    finally:
        if homes:  # new memory: nothing live was overwritten there
            stats["in_place_bytes"] = stats.get("in_place_bytes", 0) - sum(entries[n].nbytes for n in homes)
        _add_stats(acc, stats)


def _target(name: str, spec: Mapping[str, Any], live: Any, *, overwrite: bool,
            home: torch.device | None) -> tuple[torch.Tensor, torch.Tensor, regions.Region, bool]:
    """(result, contiguous destination, the region of the global tensor it holds, in place) for one
    shared tensor.

    ``overwrite=False``: the live tensor only gives shape, device and DTensor placement;
    the bytes go to new memory. ``home``: the device of new memory for optimizer state
    the live optimizer does not hold yet (``_home_devices``).
    """
    dtype = hdf5.torch_dtype(str(spec["dtype"]))
    shape = tuple(int(d) for d in spec["shape"])
    if _is_dtensor(live):
        if tuple(live.shape) != shape or live.dtype != dtype:
            raise ConfigError(f"state tensor {name!r} is {tuple(live.shape)} {live.dtype} now and was saved as "
                              f"{shape} {dtype}; the model must have the same shapes to resume")
        local, region, _ = dtensor_region(live, name)
        if overwrite:  # a strided local shard (a transposed view) is filled block by block
            return live, local, region, True
        from torch.distributed.tensor import DTensor
        fresh = torch.empty(local.shape, dtype=dtype, device=local.device)
        built = DTensor.from_local(fresh, live.device_mesh, live.placements, run_check=False,
                                   shape=live.shape, stride=live.stride())
        return built, fresh, region, False
    if (overwrite and isinstance(live, torch.Tensor) and live.layout == torch.strided and live.dtype == dtype
            and tuple(live.shape) == shape and live.is_contiguous() and not live.is_conj() and not live.is_neg()):
        return live, live, regions.whole(shape), True
    device = live.device if isinstance(live, torch.Tensor) and tuple(live.shape) == shape else home
    fresh = torch.empty(shape, dtype=dtype, device=device)
    return fresh, fresh, regions.whole(shape), False


def _piece_regions(p: Mapping[str, Any], shape: tuple[int, ...], itemsize: int) -> list[regions.Region]:
    """The region a manifest piece holds, as boxes or one region laid out in the piece's order."""
    if regions.has_region(p):
        return [regions.piece_region(p, shape)]
    start, nbytes = int(p["start"]), int(p["nbytes"])
    return regions.range_boxes(shape, start // itemsize, (start + nbytes) // itemsize)


Read = tuple[str, TensorEntry, torch.Tensor, Any]  # (name, what the file holds, where it goes, unused)


@dataclass
class _SharedReads:
    """What ``_read_shared`` reads, per writer rank, then copies out of the temporaries it read into:
    byte ranges into a flat destination (``spans``) and boxes into a destination (``blocks``)."""

    jobs: dict[int, list[Read]] = field(default_factory=dict)
    spans: list[tuple[torch.Tensor, torch.Tensor, int]] = field(default_factory=list)  # (temp bytes, dest, offset)
    blocks: list[tuple[torch.Tensor, torch.Tensor, tuple[slice, ...], tuple[slice, ...]]] = field(default_factory=list)

    def read(self, rank: int, name: str, entry: TensorEntry, target: torch.Tensor) -> None:
        self.jobs.setdefault(rank, []).append((name, entry, target, None))

    def temp(self, rank: int, name: str, entry: TensorEntry, like: torch.Tensor) -> torch.Tensor:
        """A piece read whole into a temporary of ``like``'s dtype (its checksum covers all of it)."""
        temp = torch.empty(entry.nbytes // like.element_size(), dtype=like.dtype)
        self.read(rank, name, entry, temp)
        return temp

    def copy_out(self) -> None:
        for src_t, flat, offset in self.spans:
            flat[offset:offset + src_t.numel()].copy_(src_t)
        with torch.no_grad():
            for part, dest, src, dst in self.blocks:
                dest[dst].copy_(part[src])


def _read_shared(info: catalog.CheckpointInfo, manifest: Mapping[str, Any], shared: Mapping[str, Any],
                 into: Mapping[str, Any] | None, acc: dict[str, Any], meta: Any) -> dict[str, torch.Tensor]:
    """Every distributed tensor this rank needs, piece by piece, from the files that hold them.

    Only the pieces that overlap this rank's destination are read (whole: a piece's
    crc32c covers all of it), straight into the destination when the piece is a part of
    it laid out as there (a byte range inside a destination that is one range of the
    tensor, or the same region), else into a temporary from which the overlapping
    blocks are copied (another mesh or placement: ``regions.overlaps``).
    """
    overwrite = getattr(into, "overwrite", True)
    homes = _home_devices(meta, {n: TensorEntry(n, str(sp["dtype"]), tuple(int(d) for d in sp["shape"]), 0,
                                                sum(int(p["nbytes"]) for p in sp["pieces"]))
                                 for n, sp in shared.items()}, into)
    out: dict[str, torch.Tensor] = {}
    plan = _SharedReads()
    for name, spec in shared.items():
        result, dest, region, live = _target(name, spec, (into or {}).get(name), overwrite=overwrite,
                                             home=homes.get(name))
        out[name] = result
        if live:
            acc["in_place_bytes"] = acc.get("in_place_bytes", 0) + dest.numel() * dest.element_size()
        if dest.numel():
            for p in spec["pieces"]:
                _plan_piece(info, manifest, name, spec, p, dest, region, plan)
    _read_planned(info, manifest, plan, acc)
    plan.copy_out()
    return out


def _plan_piece(info: catalog.CheckpointInfo, manifest: Mapping[str, Any], name: str, spec: Mapping[str, Any],
                p: Mapping[str, Any], dest: torch.Tensor, region: Any, plan: _SharedReads) -> None:
    """How piece ``p`` of tensor ``name`` reaches ``dest`` (this rank's ``region`` of it), if it does."""
    shape = tuple(int(d) for d in spec["shape"])
    itemsize = dest.element_size()
    r, start, nbytes = int(p["rank"]), int(p["start"]), int(p["nbytes"])
    held = manifest["ranks"][str(r)]["tensors"][name]
    entry = TensorEntry(name, str(spec["dtype"]), (nbytes // itemsize,), int(held.get("offset", 0)),
                        nbytes, int(held.get("crc32c", 0)))
    try:
        got = _piece_regions(p, shape, itemsize)
    except ValueError as exc:
        raise CheckpointCorrupt(f"{info.path}: shared tensor {name!r}: piece of rank {r}: {exc}") from None
    contiguous = dest.is_contiguous()  # else only block copies can fill it
    span = regions.as_range(shape, region) if contiguous else None
    piece_span = regions.as_range(shape, got[0]) if len(got) == 1 else None
    if not regions.has_region(p):
        piece_span = (start // itemsize, (start + nbytes) // itemsize)
    if span is not None and piece_span is not None:  # both ranges of the row-major bytes
        lo, hi = span[0] * itemsize, span[1] * itemsize
        a, b = piece_span[0] * itemsize, piece_span[1] * itemsize
        if a >= hi or b <= lo:
            return
        if lo <= a and b <= hi:  # the whole piece lands in the destination
            plan.read(r, name, entry, dest.detach().reshape(-1)[(a - lo) // itemsize:(b - lo) // itemsize])
        else:  # a piece that straddles the destination: read it whole, copy the overlap
            temp = plan.temp(r, name, entry, dest)
            x, y = max(a, lo), min(b, hi)
            plan.spans.append((temp.view(torch.uint8)[x - a:y - a], dest.detach().reshape(-1).view(torch.uint8),
                               x - lo))
        return
    if not any(regions.intersects(g, region) for g in got):
        return
    if contiguous and len(got) == 1 and got[0] == region:  # this rank's own shard, as it was saved
        plan.read(r, name, entry, dest.detach().reshape(-1))
        return
    temp = plan.temp(r, name, entry, dest)
    pos = 0
    for g in got:  # a range's boxes lie one after another in the piece
        n = regions.volume(g)
        part = temp[pos:pos + n].view(regions.lengths(g))
        pos += n
        for src, dst in regions.overlaps(g, region):
            plan.blocks.append((part, dest, src, dst))


def _read_planned(info: catalog.CheckpointInfo, manifest: Mapping[str, Any], plan: _SharedReads,
                  acc: dict[str, Any]) -> None:
    """Read what ``plan`` holds, each writer rank's file once."""
    for r, reads in sorted(plan.jobs.items()):
        rec = manifest["ranks"][str(r)]
        path = info.path / rec["file"]
        stats: dict[str, Any] = {}
        try:
            got_t = rankfile.read(path, rec, {n: e for n, e, _, _ in reads}, into={n: t for n, _, t, _ in reads},
                                  stats=stats)
        finally:
            stats.pop("in_place_bytes", None)  # counted by _read_shared, once per destination
            _add_stats(acc, stats)
        for name, _, target, _ in reads:
            if got_t[name] is not target:  # not read in place (an archive, a CUDA or odd target): copy it
                target.copy_(got_t[name].reshape(target.shape))


def _optimizer_state_names(meta: Any) -> list[str]:
    """Tensor names of optimizer state (``objects/<opt>/state/<i>/<key>``) except ``step``."""
    return [n for names in _optimizer_state_by_object(meta).values() for n in names]


def _optimizer_state_by_object(meta: Any) -> dict[str, list[str]]:
    """``_optimizer_state_names`` by optimizer (registered object name).

    Recognised from the saved metadata tree: an object whose state_dict has
    ``param_groups`` and ``state``. ``step`` stays where torch keeps it (on the CPU
    unless the optimizer is capturable or fused; load_state_dict moves it then).
    """
    out: dict[str, list[str]] = {}
    objects = meta.get("objects") if isinstance(meta, dict) else None
    for obj, tree in (objects or {}).items():
        if not (isinstance(tree, dict) and "param_groups" in tree and isinstance(tree.get("state"), dict)):
            continue
        names = out.setdefault(obj, [])
        state = tree["state"]
        for _, sub in state.get("__dict__", list(state.items())):
            for key, leaf in (sub.items() if isinstance(sub, dict) else ()):
                if key != "step" and isinstance(leaf, dict) and isinstance(leaf.get("__tensor__"), str):
                    names.append(leaf["__tensor__"])
    return out


def _optimizer_homes(meta: Any, entries: Mapping[str, hdf5.TensorEntry],
                     into: Mapping[str, Any] | None) -> dict[str, torch.Tensor]:
    """New device memory for optimizer state the live optimizer does not hold yet.

    A resumed process has parameters but no optimizer state until its first step:
    without a home on the GPU that state (2/3 of an Adam checkpoint) would be read
    into new host memory and copied up by ``load_state_dict`` from pageable memory.
    When all of that optimizer's parameters are on one CUDA device, it is read
    through the pinned pipeline straight into tensors on that device instead;
    ``load_state_dict`` then keeps them (it moves state to each parameter's device,
    a no-op here). An optimizer whose parameters are on the CPU (offloaded) keeps
    its state on the host, whatever the model's device.
    """
    homes: dict[str, torch.Tensor] = {}
    for name, device in _home_devices(meta, entries, into).items():
        e = entries[name]
        homes[name] = torch.empty(e.shape, dtype=hdf5.torch_dtype(e.dtype), device=device)
    return homes


def _home_devices(meta: Any, entries: Mapping[str, hdf5.TensorEntry],
                  into: Mapping[str, Any] | None) -> dict[str, torch.device]:
    """Which missing optimizer state tensors get a GPU home, and on which device (no allocation)."""
    known = getattr(into, "optimizer_devices", None)
    if not into or not known:
        return {}  # where the optimizers' parameters live is unknown: host memory, as torch would
    out: dict[str, torch.device] = {}
    for obj, names in _optimizer_state_by_object(meta).items():
        devices = known.get(obj) or set()
        if len(devices) != 1:
            continue
        device = next(iter(devices))
        if device.type != "cuda":
            continue
        for name in names:
            e = entries.get(name)
            if e is not None and e.nbytes and e.shape and into.get(name) is None:
                out[name] = device
    return out


