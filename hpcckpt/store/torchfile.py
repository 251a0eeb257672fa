"""The sync engine's format: a ``torch.save`` archive read back only with
``torch.load(weights_only=True)`` (never unpickling arbitrary objects).

The archive holds ``{"tensors": {name: tensor}}``; the JSON metadata lives in the
manifest. The whole-file crc32c is computed while the archive is written; each
tensor's crc32c is recorded too, so verification names the damaged tensor. A resume
checks both before it uses anything (``read``): it trusts exactly what ``verify`` does.
"""
from __future__ import annotations

import functools
import io
import os
import pickle
import warnings
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .._core import crc32c, crc32c_combine
from .._gc import collector_paused
from ..errors import CheckpointCorrupt
from ..fsio import write_all
from .checksum import FileCrc, checksum_problems, fd_crc32c
from .commit import TMP_MARK, explain_os_error, open_checked
from .entry import TensorEntry, dtype_name, raw_bytes
from .names import TORCH
from .tensortable import TensorTable


class _CrcWriter:
    """A write-only file object that checksums what passes through it.

    ``sizes``: the byte counts of the tensors being saved. torch.save hands each storage
    record to ``write`` as a view of the tensor's own memory; a write of one of those sizes
    is checksummed on its own (and folded into the file's crc32c) and ``places`` maps the
    address of its memory to ``(file offset, size, crc32c)``, so that each tensor's record
    is found by its ``data_ptr()`` (``_offsets``) without reading the archive again."""

    def __init__(self, fd: int, sizes: frozenset[int] = frozenset()) -> None:
        self.fd = fd
        self.crc = 0
        self.size = 0
        self.sizes = sizes
        self.places: dict[int, tuple[int, int, int]] = {}
        self.error: OSError | None = None  # torch's zip writer hides it behind "unexpected pos"

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        if n in self.sizes:
            crc = crc32c(view)
            self.places.setdefault(np.frombuffer(view, dtype=np.uint8).ctypes.data, (self.size, n, crc))
            self.crc = crc32c_combine(self.crc, crc, n)
        else:
            self.crc = crc32c(view, self.crc)
        try:
            write_all(self.fd, view)
        except OSError as exc:
            self.error = self.error or exc
            raise
        self.size += n
        return n

    def flush(self) -> None:
        pass


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy when it views a larger storage (torch.save writes the whole storage:
    a piece of a replicated tensor would cost the whole tensor on disk)."""
    if t.untyped_storage().nbytes() != t.numel() * t.element_size() or t.storage_offset():
        return t.clone()
    return t


def write(path: Path, tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """Write and fsync ``path``; return the manifest record fields for it."""
    cpu = {n: _own_storage(t.detach().cpu().contiguous()) for n, t in tensors.items()}
    root = path.parent.parent if TMP_MARK in path.parent.name else path.parent
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    nbytes = [t.numel() * t.element_size() for t in cpu.values()]
    w = _CrcWriter(fd, frozenset(b for b in nbytes if b))
    try:
        torch.save({"tensors": cpu}, w)  # type: ignore[arg-type]  # torch stubs want IO[bytes]; w has write/flush
        os.fsync(fd)
    except OSError as exc:
        raise explain_os_error(exc, root, path) from None
    except RuntimeError:
        if w.error is None:
            raise
        raise explain_os_error(w.error, root, path) from None
    finally:
        os.close(fd)
    crcs = [crc32c(raw_bytes(t)) for t in cpu.values()]
    addresses = [t.data_ptr() for t in cpu.values()]
    return {
        "format": TORCH,
        "file_info": {"bytes": w.size, "crc32c": w.crc},
        "tensors": TensorTable(list(cpu), [dtype_name(t.dtype) for t in cpu.values()],
                               [list(t.shape) for t in cpu.values()], nbytes, crcs,
                               _offsets(w.places, addresses, nbytes, crcs)),
    }


def _offsets(places: dict[int, tuple[int, int, int]], addresses: list[int], nbytes: list[int],
             crcs: list[int]) -> list[int] | None:
    """Each tensor's file offset: where the write of its own memory (its address, size and
    crc32c) went, or None for all when one is not found (a torch that copies a record
    before writing it, or writes it in pieces; readers then find the records in the
    archive, ``_index``). Tensors sharing a storage share its record. Empty: 0."""
    out = []
    for a, b, c in zip(addresses, nbytes, crcs):
        if not b:
            out.append(0)
            continue
        at = places.get(a)
        if at is None or at[1] != b or at[2] != c:
            return None
        out.append(at[0])
    return out


def read(path: Path, rec: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The archive's tensors, trusted exactly as ``verify`` trusts them.

    The archive's pickle is read by ``_index`` (no tensor built, no storage read), each
    tensor is read from its record into memory of its own by the parallel reader
    (``hdf5.read_tensors``: its crc32c checked as it lands, through the page cache), then
    the whole file's crc32c is checked from the page cache before anything is returned. An
    archive ``_index`` does not recognise is read by ``torch.load(weights_only=True)``."""
    from .hdf5 import read_tensors
    fd = _open(path, _size(rec))
    try:
        found = _places(fd, rec)
        if found is None:
            return _load_fd(path, fd, rec, whole_file=True)
        out = read_tensors(path, found, fd=fd, direct=False)
        _check_whole_file(path, fd, rec.get("file_info") or {})
    finally:
        os.close(fd)
    return out


def _places(fd: int, rec: Mapping[str, Any]) -> dict[str, TensorEntry] | None:
    """Where each tensor's bytes lie: the manifest's offsets, recorded as the archive was
    written (validated: inside the file; each tensor's crc32c is checked where it is read),
    or, for a manifest without them, the archive's own index (``_index``)."""
    table = TensorTable.from_records(rec["tensors"])
    if table.offsets is not None:
        return table.entries()
    return _index(fd, rec, os.fstat(fd).st_size)


def _size(rec: Mapping[str, Any]) -> int | None:
    size = (rec.get("file_info") or {}).get("bytes")
    return size if isinstance(size, int) else None


def _open(path: Path, size: int | None) -> int:
    """The archive opened once (``commit.open_checked``: no symlink, no FIFO, a regular file
    of the manifest's size); everything is read through this descriptor."""
    try:
        return open_checked(path, size=size)
    except OSError as exc:
        raise CheckpointCorrupt(f"{path}: cannot be opened ({exc.strerror or exc}); hpcckpt writes it as a "
                                "plain file") from None


def _load_fd(path: Path, fd: int, rec: Mapping[str, Any], *, whole_file: bool) -> dict[str, torch.Tensor]:
    """The archive's tensors through ``torch.load(weights_only=True)``, every check passed.

    Before anything of the file is used, its whole-file crc32c must match the manifest's
    (it covers the pickle, which the per-tensor checksums do not; ``whole_file=False`` for
    ``verify``, whose ``commit.verify_files`` checks it and which goes on to name the
    tensor), its zip directory must list only stored (uncompressed) members that fit in the
    file, and every listed tensor must be a dense tensor of the manifest's dtype and shape
    over a storage of exactly its bytes (a stride-0 view cannot make a checksum allocate);
    then each tensor's crc32c.
    """
    info = rec.get("file_info") or {}
    if whole_file:
        _check_whole_file(path, fd, info)
    with os.fdopen(os.dup(fd), "rb") as f:
        _check_zip(path, f, os.fstat(fd).st_size)
        f.seek(0)
        try:
            data = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as exc:  # the zip reader raises RuntimeError/others on damage
            raise CheckpointCorrupt(f"{path}: cannot be read as a torch archive ({exc}); the file is "
                                    "damaged") from None
    tensors = data.get("tensors") if isinstance(data, dict) else None
    if not isinstance(tensors, dict):
        raise CheckpointCorrupt(f"{path}: archive has no 'tensors' table")
    for name, entry in rec["tensors"].items():
        _check_tensor(path, name, tensors.get(name), entry)
    return tensors


def _check_whole_file(path: Path, fd: int, info: Mapping[str, Any]) -> None:
    want = info.get("crc32c")
    if not isinstance(want, int):
        return  # written before whole-file checksums were recorded: the per-tensor ones still hold
    got = fd_crc32c(fd, int(info["bytes"]))
    if got != want:
        raise CheckpointCorrupt(f"{path}: crc32c {got:#010x}, manifest says {want:#010x} (file content "
                                "damaged or altered)")


def _check_zip(path: Path, f: Any, size: int) -> None:
    """Only stored members whose sizes fit in the file: nothing the loader inflates or sizes beyond it."""
    try:
        members = zipfile.ZipFile(f).infolist()
    except (zipfile.BadZipFile, OSError, ValueError) as exc:
        raise CheckpointCorrupt(f"{path}: not a torch archive ({exc}); the file is damaged") from None
    total = 0
    for m in members:
        total += m.file_size
        if m.compress_type != zipfile.ZIP_STORED or m.file_size != m.compress_size or total > size:
            raise CheckpointCorrupt(f"{path}: archive member {m.filename!r} is compressed or larger than the "
                                    "file; torch.save never writes that, so it is not trusted")


def _check_tensor(path: Path, name: str, t: Any, entry: Mapping[str, Any]) -> None:
    if not isinstance(t, torch.Tensor):
        raise CheckpointCorrupt(f"{path}: tensor {name!r} is missing from the archive")
    nbytes = int(entry["nbytes"])
    if (dtype_name(t.dtype) != entry["dtype"] or list(t.shape) != list(entry["shape"]) or t.layout != torch.strided
            or not t.is_contiguous() or t.storage_offset() or t.untyped_storage().nbytes() != nbytes
            or t.numel() * t.element_size() != nbytes):
        raise CheckpointCorrupt(
            f"{path}: tensor {name!r} is {dtype_name(t.dtype)} {list(t.shape)} over a "
            f"{t.untyped_storage().nbytes()}-byte storage, the manifest says {entry['dtype']} {entry['shape']} "
            f"({nbytes} bytes); the archive is not the one that was written")
    got = crc32c(raw_bytes(t))
    if got != entry["crc32c"]:
        raise CheckpointCorrupt(
            f"{path}: tensor {name!r} fails its checksum (crc32c {got:#010x}, manifest "
            f"{entry['crc32c']:#010x}); its bytes on disk are damaged")


def verify(path: Path, rec: Mapping[str, Any], *, whole: FileCrc | None = None) -> list[str]:
    """Every damaged tensor, named (the whole-file crc32c is ``commit.verify_files``'s to
    report; ``whole`` gets it from the same reads when asked): the tensors at the manifest's
    offsets (as arrays, no object per tensor) or where ``_index`` finds them, checksummed in
    one native call (coalesced reads in file order, ``checksum.checksum_problems``), or, for an
    archive ``_index`` does not recognise, ``torch.load`` and each tensor."""
    try:
        fd = _open(path, _size(rec))
        try:
            t = TensorTable.from_records(rec["tensors"])
            if not t.has_offsets():  # a manifest written before offsets were recorded
                found = _index(fd, rec, os.fstat(fd).st_size)
                if found is None:
                    _load_fd(path, fd, rec, whole_file=False)
                    return []
                t = TensorTable(t.names, t.dtypes, t.shapes, t.nbytes, t.crcs, [found[n].offset for n in t.names])
            return checksum_problems(path, fd, *t.arrays(), whole=whole)
        finally:
            os.close(fd)
    except CheckpointCorrupt as exc:
        return [str(exc)]
    except OSError as exc:
        return [f"{path}: cannot be read ({exc.strerror or exc})"]


# -- the archive's pickle, read without building a tensor ---------------------------------

class _Unrecognised(Exception):
    """Something torch.save does not write for ``{"tensors": {name: tensor}}``."""


class _StorageType:
    __slots__ = ("dtype",)

    def __init__(self, dtype: torch.dtype | None) -> None:
        self.dtype = dtype  # None: an untyped storage (its tensor's dtype comes from the rebuild)


class _Storage:
    __slots__ = ("key", "nbytes", "dtype")

    def __init__(self, key: str, nbytes: int, dtype: torch.dtype | None) -> None:
        self.key, self.nbytes, self.dtype = key, nbytes, dtype


class _Ref:
    """One tensor of the pickle: its storage, offset, size and stride (as the pickle gave them:
    ``_index`` compares them with the manifest's ints) and dtype."""
    __slots__ = ("storage", "offset", "size", "stride", "dtype")

    def __init__(self, storage: _Storage, offset: int, size: Any, stride: Any, dtype: torch.dtype) -> None:
        self.storage, self.offset, self.size, self.stride, self.dtype = storage, offset, size, stride, dtype


def _rebuild_v2(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any,
                metadata: Any = None) -> _Ref:
    if type(storage) is not _Storage or storage.dtype is None or type(offset) is not int:
        raise _Unrecognised
    return _Ref(storage, offset, size, stride, storage.dtype)


def _rebuild_v3(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any, dtype: Any,
                metadata: Any = None) -> _Ref:
    if type(storage) is not _Storage or not isinstance(dtype, torch.dtype) or type(offset) is not int:
        raise _Unrecognised
    return _Ref(storage, offset, size, stride, dtype)


class _Pickle(pickle.Unpickler):
    """The archive's ``data.pkl`` through the C unpickler with only what ``torch.save`` writes
    for a dict of plain CPU tensors allowed (``find_class`` refuses every other global, as
    the pickle documentation's "restricting globals" shows): a tensor becomes a ``_Ref``
    naming its storage's record, offset, size and stride. Nothing is called but these."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name in ("_rebuild_tensor_v2", "_rebuild_tensor_v3"):
            return _rebuild_v2 if name == "_rebuild_tensor_v2" else _rebuild_v3
        if module == "collections" and name == "OrderedDict":
            return _empty_hooks
        if module == "torch.storage" and name == "UntypedStorage":
            return _StorageType(None)
        if module == "torch":
            if name in _storage_dtypes():
                return _StorageType(_storage_dtypes()[name])
            found = getattr(torch, name, None)
            if isinstance(found, torch.dtype):
                return found
        raise _Unrecognised

    def persistent_load(self, pid: Any) -> _Storage:
        if (type(pid) is not tuple or len(pid) != 5 or pid[0] != "storage" or type(pid[1]) is not _StorageType
                or type(pid[2]) is not str or type(pid[4]) is not int or pid[4] < 0):
            raise _Unrecognised
        dtype = pid[1].dtype
        return _Storage(pid[2], pid[4] * (dtype.itemsize if dtype is not None else 1), dtype)


@functools.cache
def _storage_dtypes() -> dict[str, torch.dtype]:
    """Legacy typed storage class names as torch.save pickles them (``FloatStorage``...) -> dtype;
    empty where this torch does not say (every typed storage then goes to ``torch.load``)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return {str(v): k for k, v in torch.storage._dtype_to_storage_type_map().items()}
    except (AttributeError, TypeError):
        return {}


def _empty_hooks(*args: Any) -> dict[str, Any]:
    if args:
        raise _Unrecognised
    return {}


def _index(fd: int, rec: Mapping[str, Any], size: int) -> dict[str, TensorEntry] | None:
    """Where each of the manifest's tensors lies in the archive: ``name -> TensorEntry`` (its
    record's file offset, the manifest's dtype, shape, size and crc32c), or None when the
    archive is not exactly what ``write`` makes of the manifest's tensors (a dense tensor of
    the manifest's dtype and shape over a stored record of exactly its bytes, inside the
    file); the caller then reads it with ``torch.load``, which names what is wrong. The pickle is read from the zip directory
    (``torch``'s own reader), never more of it than the file holds."""
    try:
        with os.fdopen(os.dup(fd), "rb") as f:
            zf: Any = torch._C.PyTorchFileReader(f)
            if not zf.has_record("data.pkl") or not 0 < zf.get_record_size("data.pkl") <= size:
                return None
            with collector_paused():  # ~65,000 small objects that cannot form a cycle
                data = _Pickle(io.BytesIO(zf.get_record("data.pkl"))).load()
            tensors = data.get("tensors") if type(data) is dict else None
            if type(tensors) is not dict:
                return None
            out = {}
            places: dict[str, tuple[int, int]] = {}
            table = TensorTable.from_records(rec["tensors"])
            names: dict[torch.dtype, str] = {}
            for name, dtype, dims, nbytes, crc in zip(table.names, table.dtypes, table.shapes, table.nbytes,
                                                      table.crcs):
                ref = tensors.get(name)
                if type(ref) is not _Ref:
                    return None
                shape = tuple(dims)  # validated ints (manifest.validate); the pickle's are compared with them
                have = names.get(ref.dtype) or names.setdefault(ref.dtype, dtype_name(ref.dtype))
                if (have != dtype or ref.size != shape or ref.offset != 0 or ref.storage.nbytes != nbytes
                        or ref.stride != _contiguous(shape)):
                    return None
                key = ref.storage.key
                if key not in places:
                    record = f"data/{key}"
                    if not zf.has_record(record) or zf.get_record_size(record) != nbytes:
                        return None
                    places[key] = (int(zf.get_record_offset(record)), nbytes)
                offset = places[key][0]
                if offset + nbytes > size:
                    return None
                out[name] = TensorEntry(name, dtype, shape, offset, nbytes, crc)
            return out
    except (_Unrecognised, pickle.UnpicklingError, RuntimeError, ValueError, TypeError, EOFError, KeyError,
            AttributeError, IndexError, OverflowError, MemoryError, RecursionError):
        return None


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(stride))
