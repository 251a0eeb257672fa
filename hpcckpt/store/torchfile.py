"""The sync engine's format: a ``torch.save`` archive read back only with
``torch.load(weights_only=True)`` (never unpickling arbitrary objects).

The archive holds ``{"tensors": {name: tensor}}``; the JSON metadata lives in the
manifest. The whole-file crc32c is computed while the archive is written; each
tensor's crc32c is recorded too, so verification names the damaged tensor.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

import torch

from .._core import crc32c
from ..errors import CheckpointCorrupt
from .commit import TMP_MARK, explain_os_error
from .hdf5 import dtype_name, raw_bytes


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
            while view:
                view = view[os.write(self.fd, view):]
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
        torch.save({"tensors": cpu}, w)  # type: ignore[arg-type]
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
        "tensors": {n: {"dtype": dtype_name(t.dtype), "shape": list(t.shape), "nbytes": t.numel() * t.element_size(),
                        "crc32c": crc32c(raw_bytes(t))} for n, t in cpu.items()},
    }


def read(path: Path, rec: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # the zip reader raises RuntimeError/others on damage
        raise CheckpointCorrupt(f"{path}: cannot be read as a torch archive ({exc}); the file is damaged") from None
    tensors = data.get("tensors") if isinstance(data, dict) else None
    if not isinstance(tensors, dict):
        raise CheckpointCorrupt(f"{path}: archive has no 'tensors' table")
    for name, info in rec["tensors"].items():
        t = tensors.get(name)
        if t is None:
            raise CheckpointCorrupt(f"{path}: tensor {name!r} is missing from the archive")
        got = crc32c(raw_bytes(t))
        if got != info["crc32c"]:
            raise CheckpointCorrupt(
                f"{path}: tensor {name!r} fails its checksum (crc32c {got:#010x}, manifest "
                f"{info['crc32c']:#010x}); its bytes on disk are damaged")
    return tensors


def verify(path: Path, rec: Mapping[str, Any]) -> list[str]:
    try:
        read(path, rec)
    except CheckpointCorrupt as exc:
        return [str(exc)]
    return []
