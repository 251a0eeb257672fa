"""The sync engine's format: a ``torch.save`` archive read back only with
``torch.load(weights_only=True)`` (never unpickling arbitrary objects).

The archive holds ``{"tensors": {name: tensor}}``; the JSON metadata lives in the
manifest. The whole-file crc32c is computed while the archive is written; each
tensor's crc32c is recorded too, so verification names the damaged tensor. A resume
checks both before it uses anything (``read``): it trusts exactly what ``verify`` does.
"""
from __future__ import annotations

import os
import zipfile
from pathlib import Path
from typing import Any, Mapping

import torch

from .._core import crc32c
from ..errors import CheckpointCorrupt
from ..fsio import write_all
from .commit import TMP_MARK, explain_os_error, fd_crc32c, open_checked
from .entry import dtype_name, raw_bytes
from .tensortable import TensorTable


class _CrcWriter:
    """A write-only file object that checksums what passes through it."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.crc = 0
        self.size = 0
        self.error: OSError | None = None  # torch's zip writer hides it behind "unexpected pos"

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.crc = crc32c(view, self.crc)
        n = len(view)
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
    w = _CrcWriter(fd)
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
    return {
        "format": "torch",
        "file_info": {"bytes": w.size, "crc32c": w.crc},
        "tensors": TensorTable(list(cpu), [dtype_name(t.dtype) for t in cpu.values()],
                               [list(t.shape) for t in cpu.values()],
                               [t.numel() * t.element_size() for t in cpu.values()],
                               [crc32c(raw_bytes(t)) for t in cpu.values()]),
    }


def read(path: Path, rec: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The archive's tensors, trusted exactly as ``verify`` trusts them (``_load``)."""
    return _load(path, rec, whole_file=True)


def _load(path: Path, rec: Mapping[str, Any], *, whole_file: bool) -> dict[str, torch.Tensor]:
    """The archive's tensors, every check passed.

    The file is opened once (``commit.open_checked``: no symlink, no FIFO, a regular file
    of the manifest's size) and everything is read through that descriptor. Before
    anything of it is used, its whole-file crc32c must match the manifest's (it covers
    the pickle, which the per-tensor checksums do not; ``whole_file=False`` for ``verify``,
    whose ``commit.verify_files`` checks it and which goes on to name the tensor), its zip directory must list only
    stored (uncompressed) members that fit in the file, and every listed tensor must be a
    dense tensor of the manifest's dtype and shape over a storage of exactly its bytes
    (a stride-0 view cannot make a checksum allocate); then each tensor's crc32c.
    """
    info = rec.get("file_info") or {}
    size = info.get("bytes")
    try:
        fd = open_checked(path, size=size if isinstance(size, int) else None)
    except OSError as exc:
        raise CheckpointCorrupt(f"{path}: cannot be opened ({exc.strerror or exc}); hpcckpt writes it as a "
                                "plain file") from None
    try:
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
    finally:
        os.close(fd)
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


def verify(path: Path, rec: Mapping[str, Any]) -> list[str]:
    """The damaged tensor, named (the whole-file crc32c is ``commit.verify_files``'s to report)."""
    try:
        _load(path, rec, whole_file=False)
    except CheckpointCorrupt as exc:
        return [str(exc)]
    return []
