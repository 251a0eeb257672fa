"""The per-rank tensor file: standard HDF5 with offsets known before any byte is written.

Every tensor is a contiguous dataset allocated at creation time (early allocation,
no fill), aligned to 4 KiB when large, so writers can ``pwrite`` raw bytes at
``ds.id.get_offset()`` in parallel (or with O_DIRECT) and the result still opens
in h5py and h5dump. The torch dtype is kept as a dataset attribute; dtypes NumPy
lacks (bfloat16, float8) are stored as unsigned integers of the same width.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

import h5py
import numpy as np
import torch

from .._core import crc32c
from ..errors import CheckpointCorrupt, ConfigError

ALIGN = 4096
ALIGN_THRESHOLD = 64 << 10
_READ_CHUNK = 32 << 20

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


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise CheckpointCorrupt(f"unknown tensor dtype {name!r} in manifest")
    return dt


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives in a rank file, as the manifest records it."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    crc32c: int = 0

    def to_json(self) -> dict[str, object]:
        return {"dtype": self.dtype, "shape": list(self.shape), "offset": self.offset,
                "nbytes": self.nbytes, "crc32c": self.crc32c}

    @staticmethod
    def from_json(name: str, d: Mapping[str, Any]) -> TensorEntry:
        return TensorEntry(name, str(d["dtype"]), tuple(int(x) for x in d["shape"]),
                           int(d["offset"]), int(d["nbytes"]), int(d.get("crc32c", 0)))


def raw_bytes(t: torch.Tensor) -> np.ndarray:
    """A flat uint8 NumPy view of a contiguous CPU tensor's bytes (no copy)."""
    if t.device.type != "cpu":
        raise ConfigError(f"raw_bytes needs a CPU tensor, got one on {t.device}")
    t = t.contiguous().reshape(-1)
    if t.numel() == 0:
        return np.empty(0, dtype=np.uint8)
    return t.view(torch.uint8).numpy()


def plan_file(path: Path, specs: Iterable[tuple[str, torch.dtype, tuple[int, ...]]],
              attrs: Mapping[str, str] | None = None) -> dict[str, TensorEntry]:
    """Create ``path`` with one early-allocated contiguous dataset per tensor.

    Returns each tensor's entry with its file offset (crc32c still 0). The file is
    fully formed HDF5 (zeros in the data) and closed; callers then write raw bytes.
    """
    entries: dict[str, TensorEntry] = {}
    with h5py.File(path, "w", alignment_threshold=ALIGN_THRESHOLD, alignment_interval=ALIGN) as f:
        for key, value in (attrs or {}).items():
            f.attrs[key] = value
        for name, dtype, shape in specs:
            if dtype not in _STORAGE:
                raise ConfigError(f"tensor {name!r} has dtype {dtype}, which the HDF5 store does not support")
            storage = np.dtype(_STORAGE[dtype])
            nbytes = int(np.prod(shape, dtype=np.int64)) * storage.itemsize
            space = h5py.h5s.create_simple(shape) if shape else h5py.h5s.create(h5py.h5s.SCALAR)
            dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
            dcpl.set_layout(h5py.h5d.CONTIGUOUS)
            dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
            dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
            lcpl = h5py.h5p.create(h5py.h5p.LINK_CREATE)
            lcpl.set_create_intermediate_group(True)
            dsid = h5py.h5d.create(f.id, name.encode(), h5py.h5t.py_create(storage), space, dcpl=dcpl, lcpl=lcpl)
            ds = h5py.Dataset(dsid)
            ds.attrs["torch_dtype"] = dtype_name(dtype)
            offset = dsid.get_offset() if nbytes else None
            entries[name] = TensorEntry(name, dtype_name(dtype), tuple(shape), int(offset or 0), nbytes)
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


def _pread_into(fd: int, buf: memoryview, offset: int, path: Path) -> None:
    while buf:
        n = os.preadv(fd, [buf], offset)
        if n == 0:
            raise CheckpointCorrupt(f"{path}: unexpected end of file at offset {offset} (file truncated)")
        buf = buf[n:]
        offset += n


def read_tensors(path: Path, entries: Mapping[str, TensorEntry], *, threads: int = 4,
                 verify: bool = True) -> dict[str, torch.Tensor]:
    """Read tensors by raw offset into fresh CPU tensors, checking each crc32c.

    Raises CheckpointCorrupt naming the first tensor whose bytes do not match.
    """
    out: dict[str, torch.Tensor] = {}
    jobs: list[tuple[str, memoryview, int]] = []
    for name, e in entries.items():
        t = torch.empty(e.shape, dtype=torch_dtype(e.dtype))
        out[name] = t
        if e.nbytes:
            view = memoryview(raw_bytes(t))  # type: ignore[arg-type]
            for start in range(0, e.nbytes, _READ_CHUNK):
                jobs.append((name, view[start:start + _READ_CHUNK], e.offset + start))
    fd = os.open(path, os.O_RDONLY)
    try:
        with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
            list(pool.map(lambda j: _pread_into(fd, j[1], j[2], path), jobs))
    finally:
        os.close(fd)
    if verify:
        for name, e in entries.items():
            got = crc32c(raw_bytes(out[name])) if e.nbytes else 0
            if e.nbytes and got != e.crc32c:
                raise CheckpointCorrupt(
                    f"{path}: tensor {name!r} fails its checksum (crc32c {got:#010x}, manifest "
                    f"{e.crc32c:#010x}); its bytes on disk are damaged")
    return out


def verify_tensors(path: Path, entries: Mapping[str, TensorEntry]) -> list[str]:
    """Every damaged tensor of a rank file (reads one tensor at a time)."""
    problems: list[str] = []
    for name, e in entries.items():
        try:
            read_tensors(path, {name: e}, threads=2)
        except CheckpointCorrupt as exc:
            problems.append(str(exc))
        except OSError as exc:
            problems.append(f"{path}: cannot read tensor {name!r}: {exc}")
    return problems
