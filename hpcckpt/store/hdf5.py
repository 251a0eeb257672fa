"""The per-rank tensor file: standard HDF5 with offsets known before any byte is written.

Every tensor is a contiguous dataset allocated at creation time (early allocation,
no fill), aligned to 4 KiB when large, so writers can ``pwrite`` raw bytes at
``ds.id.get_offset()`` in parallel (or with O_DIRECT) and the result still opens
in h5py and h5dump. Dtypes NumPy lacks (bfloat16, float8) and bool are stored as
unsigned integers of the same width, with the torch dtype as a ``torch_dtype``
attribute; the manifest records every tensor's dtype.
"""
from __future__ import annotations

import errno
import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch

from .._core import crc32c, native
from ..errors import CheckpointCorrupt, ConfigError
from .checksum import FileCrc, checksum_problems
from .commit import open_checked
from .entry import ALIGN, TensorEntry, dtype_name, raw_bytes
from .staged_read import read_staged
from .tensortable import TensorTable

ALIGN_THRESHOLD = 64 << 10

# torch dtype -> HDF5 storage dtype (little endian)
_STORAGE: dict[torch.dtype, str] = {
    torch.float64: "<f8", torch.float32: "<f4", torch.float16: "<f2",
    torch.bfloat16: "<u2", torch.int64: "<i8", torch.int32: "<i4", torch.int16: "<i2",
    torch.int8: "|i1", torch.uint8: "|u1", torch.bool: "|u1",
    torch.uint16: "<u2", torch.uint32: "<u4", torch.uint64: "<u8",
    torch.complex64: "<c8", torch.complex128: "<c16",
}
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
    if hasattr(torch, _name):
        _STORAGE[getattr(torch, _name)] = "|u1"


def torch_dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise CheckpointCorrupt(f"unknown tensor dtype {name!r} in manifest")
    return dt


# Torch dtypes whose HDF5 storage type says what they are (float32 is "<f4"); the others
# (bfloat16 and bool and float8 stored as unsigned integers) carry a ``torch_dtype``
# attribute so that h5py users can tell them apart. One attribute per dataset was a third
# of the cost of planning a file with tens of thousands of tensors.
_SELF_DESCRIBED = {torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16,
                   torch.int8, torch.uint8, torch.uint16, torch.uint32, torch.uint64,
                   torch.complex64, torch.complex128}


def plan_file(path: Path, specs: Iterable[tuple[str, torch.dtype, tuple[int, ...]]],
              attrs: Mapping[str, str] | None = None) -> dict[str, TensorEntry]:
    """Create ``path`` with one early-allocated contiguous dataset per tensor.

    Returns each tensor's entry with its file offset (crc32c still 0). The file is
    fully formed HDF5 (zeros in the data) and closed; callers then write raw bytes.
    HDF5's low-level calls only, with the property lists and types made once: the cost
    per tensor is HDF5's own.
    """
    entries: dict[str, TensorEntry] = {}
    with h5py.File(path, "w", alignment_threshold=ALIGN_THRESHOLD, alignment_interval=ALIGN) as f:
        for key, value in (attrs or {}).items():
            f.attrs[key] = value
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_layout(h5py.h5d.CONTIGUOUS)
        dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
        dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
        lcpl = h5py.h5p.create(h5py.h5p.LINK_CREATE)
        lcpl.set_create_intermediate_group(True)
        scalar = h5py.h5s.create(h5py.h5s.SCALAR)
        types: dict[torch.dtype, tuple[Any, int, str, Any]] = {}
        for name, dtype, shape in specs:
            kind = types.get(dtype)
            if kind is None:
                if dtype not in _STORAGE:
                    raise ConfigError(f"tensor {name!r} has dtype {dtype}, which the HDF5 store does not support")
                storage = np.dtype(_STORAGE[dtype])
                label = dtype_name(dtype)
                attr = None
                if dtype not in _SELF_DESCRIBED:  # a UTF-8 string, as h5py's attrs[...] = str writes
                    attr = (h5py.h5t.py_create(h5py.string_dtype("utf-8"), logical=True),
                            np.array(label, dtype=h5py.string_dtype("utf-8")))
                kind = types[dtype] = (h5py.h5t.py_create(storage), storage.itemsize, label, attr)
            htype, itemsize, label, attr = kind
            nbytes = math.prod(shape) * itemsize
            space = h5py.h5s.create_simple(shape) if shape else scalar
            dsid = h5py.h5d.create(f.id, name.encode(), htype, space, dcpl=dcpl, lcpl=lcpl)
            if attr is not None:
                h5py.h5a.create(dsid, b"torch_dtype", attr[0], scalar).write(attr[1])
            offset = dsid.get_offset() if nbytes else None
            entries[name] = TensorEntry(name, label, tuple(shape), int(offset or 0), nbytes)
    return entries


def pwrite_all(fd: int, data: np.ndarray | memoryview, offset: int) -> None:
    view = memoryview(data).cast("B")  # type: ignore[arg-type]
    while view:
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n


def write_tensors(path: Path, tensors: Mapping[str, torch.Tensor], attrs: Mapping[str, str] | None = None,
                  *, fsync: bool = True) -> dict[str, TensorEntry]:
    """Plan and write a rank file from CPU tensors with plain ``pwrite`` (one thread)."""
    entries = plan_file(path, ((n, t.dtype, tuple(t.shape)) for n, t in tensors.items()), attrs)
    fd = os.open(path, os.O_WRONLY)
    try:
        for name, t in tensors.items():
            e = entries[name]
            data = raw_bytes(t.cpu())
            pwrite_all(fd, data, e.offset)
            entries[name] = TensorEntry(e.name, e.dtype, e.shape, e.offset, e.nbytes, crc32c(data))
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    return entries


def _destination(e: TensorEntry) -> torch.Tensor:
    """Fresh memory for one tensor, as a flat uint8 tensor of ``e.nbytes``.

    Tensors big enough to be 4 KiB-aligned in the file get native 4 KiB-aligned
    memory so O_DIRECT can read straight into them; the tensor keeps that memory
    alive. Small ones use torch.empty and come through the page cache. No huge
    pages here: for one-shot memory the kernel's compaction on first touch was
    measured at 0.9-1.2 GB/s, slower than the disk (4 KiB pages: ~4 GB/s).
    """
    if e.nbytes >= ALIGN_THRESHOLD:
        return torch.frombuffer(native().aligned_buffer(e.nbytes, ALIGN, False), dtype=torch.uint8)
    return torch.empty(e.nbytes, dtype=torch.uint8)


def _want_direct(path: Path, fd: int, direct: bool | None) -> bool:
    """O_DIRECT unless asked otherwise or most of the file is already cached."""
    if direct is not None:
        return direct
    try:
        resident, size = native().file_resident(str(path), fd=fd)
    except OSError:
        return True
    return not size or resident < size // 2


def _matches(t: Any, e: TensorEntry) -> bool:
    """``t`` is a dense, contiguous tensor of ``e``'s dtype and shape that bytes can land in."""
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided or not e.nbytes:
        return False
    return (t.dtype == torch_dtype(e.dtype) and tuple(t.shape) == e.shape and t.is_contiguous()
            and not t.is_conj() and not t.is_neg() and t.numel() * t.element_size() == e.nbytes)


def _in_place(t: Any, e: TensorEntry) -> np.ndarray | None:
    """A writable byte view of ``t`` if the tensor ``e`` can be read straight into it (CPU)."""
    if not _matches(t, e) or t.device.type != "cpu":
        return None
    return t.detach().reshape(-1).view(torch.uint8).numpy()


def _on_device(t: Any, e: TensorEntry) -> torch.Tensor | None:
    """``t`` if it is a CUDA tensor that ``e`` can be copied straight into (staged_read)."""
    return t if _matches(t, e) and t.is_cuda else None


def _disjoint(spans: dict[str, tuple[int, int]]) -> set[str]:
    """Names whose memory ``(start, end)`` overlaps an earlier one's (tied weights): not read in place."""
    clash: set[str] = set()
    end = 0
    for lo, hi, name in sorted((lo, hi, n) for n, (lo, hi) in spans.items()):
        if lo < end:
            clash.add(name)
        else:
            end = hi
    return clash


def _live_targets(entries: Mapping[str, TensorEntry], into: Mapping[str, Any] | None
                  ) -> tuple[dict[str, np.ndarray], dict[str, torch.Tensor]]:
    """Live CPU byte views and live CUDA tensors that can be read in place, tied ones left out."""
    if into is None:
        return {}, {}
    host = {n: v for n, e in entries.items() if (v := _in_place(into.get(n), e)) is not None}
    device = {n: t for n, e in entries.items() if n not in host and (t := _on_device(into.get(n), e)) is not None}
    for name in _disjoint({n: (v.ctypes.data, v.ctypes.data + v.nbytes) for n, v in host.items()}):
        del host[name]
    for name in _disjoint({n: (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
                           for n, t in device.items()}):
        del device[name]
    return host, device


def read_tensors(path: Path, entries: Mapping[str, TensorEntry], *, into: Mapping[str, Any] | None = None,
                 threads: int = 0, verify: bool = True, direct: bool | None = None,
                 stats: dict[str, Any] | None = None, fd: int | None = None) -> dict[str, torch.Tensor]:
    """``_read_tensors`` through ``fd``, or through a descriptor of ``path`` opened once and
    checked (``commit.open_checked``: regular, ours, long enough for every entry)."""
    if fd is not None:
        return _read_tensors(path, entries, fd, into=into, threads=threads, verify=verify, direct=direct,
                             stats=stats)
    own = open_checked(path, min_size=max((e.offset + e.nbytes for e in entries.values() if e.nbytes), default=0))
    try:
        return _read_tensors(path, entries, own, into=into, threads=threads, verify=verify, direct=direct,
                             stats=stats)
    finally:
        os.close(own)


def _read_tensors(path: Path, entries: Mapping[str, TensorEntry], fd: int, *, into: Mapping[str, Any] | None,
                  threads: int, verify: bool, direct: bool | None,
                  stats: dict[str, Any] | None) -> dict[str, torch.Tensor]:
    """Read tensors by raw offset, checking each crc32c.

    ``into``: live tensors by name (a capture of the training state). A tensor of the
    same dtype and shape, contiguous on the CPU, is read straight into (the result
    holds that very tensor, so ``load_state_dict`` copies nothing); the rest get fresh
    memory. In-place reads skip the first touch of new pages, the largest cost of a
    load after the disk, and need no second copy of the state in memory; but a
    checksum failure leaves those tensors holding damaged bytes (``stats`` then shows
    ``in_place_bytes`` > 0, set before any byte is read). Live CUDA tensors of the
    same dtype and shape are filled in place too, through pinned host chunks with
    the host-to-device copies overlapped with the reads (``staged_read``;
    ``device_bytes`` in ``stats``).

    The native reader preads chunks on several threads (``threads``; 0 = twice the
    usable CPUs, 8..16), checksums each chunk as it lands (no second pass), reads
    the in-place tensors first while more threads fault in the fresh ones.
    ``direct``: O_DIRECT (None: unless half the file is already in the page cache).
    ``stats``, if given, receives the reader's byte counts. Raises CheckpointCorrupt
    naming the first damaged tensor, or naming the file when it is shorter than the
    manifest says.
    """
    live, device = _live_targets(entries, into)
    out, items, names = _destinations(entries, live, device, into)
    in_place = sum(entries[n].nbytes for n in device) + sum(entries[n].nbytes for n in live)
    use_direct = _want_direct(path, fd, direct) if items or device else False
    if stats is not None:
        stats.update(in_place_bytes=in_place, direct=use_direct, device_bytes=in_place - sum(
            entries[n].nbytes for n in live))
    try:
        crcs, info = (native().read_items(str(path), items, threads=threads, direct=use_direct,
                                          populate=_populate_threads(items), fd=fd)
                      if items or not device else ([], {}))
        if device:
            crcs, names = list(crcs), list(names)
            staged: dict[str, int] = {}
            got = _read_to_device(path, fd, [(entries[n], t) for n, t in device.items()], use_direct, threads,
                                  staged)
            names += list(got)
            crcs += list(got.values())
            info = {**info, **{k: int(info.get(k, 0)) + v if k.endswith("_bytes") else v
                               for k, v in staged.items()}}
    except OSError as exc:
        if exc.errno == errno.ENODATA:
            raise CheckpointCorrupt(f"{path}: file is shorter than its manifest says ({exc.strerror}); "
                                    "it was truncated after the checkpoint was committed") from exc
        raise
    if stats is not None:
        stats.update(info)
    if verify:
        _check_crcs(path, entries, names, crcs)
    return out


def _destinations(entries: Mapping[str, TensorEntry], live: Mapping[str, np.ndarray],
                  device: Mapping[str, torch.Tensor], into: Mapping[str, Any] | None
                  ) -> tuple[dict[str, torch.Tensor], list[tuple[np.ndarray, int, bool]], list[str]]:
    """Each tensor's result (a live one, or fresh memory) and the host reads that fill them:
    (destination bytes, file offset, fresh), in the order of ``names``. CUDA targets are read
    apart (``_read_to_device``)."""
    out: dict[str, torch.Tensor] = {}
    items: list[tuple[np.ndarray, int, bool]] = []
    names: list[str] = []
    for name, e in entries.items():
        if name in device:
            out[name] = device[name]
            continue
        if name in live:
            out[name] = into[name]  # type: ignore[index]
            items.append((live[name], e.offset, False))
            names.append(name)
            continue
        raw = _destination(e)
        if e.nbytes:
            items.append((raw.numpy(), e.offset, True))
            names.append(name)
        dtype = torch_dtype(e.dtype)
        out[name] = raw.view(dtype).reshape(e.shape) if e.nbytes else torch.empty(e.shape, dtype=dtype)
    return out, items, names


def _populate_threads(items: list[tuple[np.ndarray, int, bool]]) -> int:
    """Fault-in threads in proportion to the fresh share of the bytes, one per CPU at most
    (up to 4). Measured on the 2-core VM, 2 GB cold, fresh process, against a raw read
    of the same file: all fresh, 2 threads 0.78-0.82x (1: 0.75-0.79x, 3: 0.71-0.73x);
    a resume with 2/3 fresh (parameters in place), 1 thread 0.86-0.96x (2: 0.77-0.86x)."""
    fresh = sum(item[0].nbytes for item in items if item[2])
    if not fresh:
        return 0
    total = sum(item[0].nbytes for item in items)
    cpus = native().usable_cpus()
    return max(1, min(cpus, 4, round(cpus * fresh / total)))


def _check_crcs(path: Path, entries: Mapping[str, TensorEntry], names: list[str], crcs: Any) -> None:
    """CheckpointCorrupt naming the first tensor whose bytes do not match its manifest crc32c."""
    for name, got_crc in zip(names, crcs):
        want = entries[name].crc32c
        if got_crc != want:
            raise CheckpointCorrupt(
                f"{path}: tensor {name!r} fails its checksum (crc32c {got_crc:#010x}, manifest "
                f"{want:#010x}); its bytes on disk are damaged")


def _read_to_device(path: Path, fd: int, targets: list[tuple[TensorEntry, torch.Tensor]], direct: bool,
                    threads: int, info: dict[str, int]) -> dict[str, int]:
    """CUDA targets: through pinned chunks, H2D overlapped with the reads (``staged_read``)."""
    return read_staged(path, targets, direct=direct, threads=threads, info=info, fd=fd)


def verify_tensors(path: Path, table: Mapping[str, Mapping[str, Any]], *, whole: FileCrc | None = None) -> list[str]:
    """Every damaged tensor of a rank file; ``table``: the manifest's tensor records by name
    (``offset``, ``nbytes``, ``crc32c``; validated by ``manifest.validate``).

    One descriptor (``commit.open_checked``), one native call for all the tensors
    (``checksum_ranges``: read in file order in large spans, each tensor checksummed from
    its thread's buffer; memory bounded by the threads, not the file), then one vectorised
    comparison: the cost is the bytes read plus well under a microsecond a tensor, however
    many tensors the file holds. Spans mostly in the page cache are read through it, the rest
    O_DIRECT (``checksum.DIRECT_WHERE_COLD``). ``whole``: the whole file's crc32c too, from
    the same reads (``checksum_problems``).
    """
    names, offsets, lengths, want = TensorTable.from_records(table).arrays()
    try:
        fd = open_checked(path, min_size=int((offsets + lengths).max()) if names else 0)
    except CheckpointCorrupt as exc:
        return [str(exc)]
    except OSError as exc:
        return [f"{path}: cannot be read ({exc.strerror or exc})"]
    try:
        return checksum_problems(path, fd, names, offsets, lengths, want, whole=whole)
    finally:
        os.close(fd)
