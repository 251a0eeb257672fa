"""A rank file's format, dispatched in one place for reading and for verifying.

- ``hdf5`` (concurrent engine): tensors at raw offsets, read by parallel ``pread``
  straight into live or new memory, each chunk's crc32c checked as it lands
  (``hdf5.read_tensors``);
- ``torch`` (sync engine): a ``torch.save`` archive, loaded with
  ``weights_only=True`` and every tensor's crc32c checked (``torchfile.read``).

``entries`` names the tensors wanted from the file (a rank's own, or the pieces of
shared tensors it holds); the manifest record ``rec`` says the format.

The readers (torch, h5py) are imported when a file is read, not with the catalog: listing
and checking manifests (``hpcckpt ls``, the epilog's ``scavenge``) then start in a tenth
of the time.
"""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointCorrupt
from .entry import TensorEntry
from .manifest import FORMATS
from .names import TORCH

if TYPE_CHECKING:
    import torch

    from .checksum import FileCrc


def _format(path: Path, rec: Mapping[str, Any]) -> str:
    fmt = rec.get("format")
    if fmt not in FORMATS:
        raise CheckpointCorrupt(f"{path}: unknown rank file format {fmt!r}; known formats: {', '.join(FORMATS)}")
    return str(fmt)


def read(path: Path, rec: Mapping[str, Any], entries: Mapping[str, TensorEntry], *,
         into: Mapping[str, Any] | None = None, stats: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """The tensors ``entries`` of one rank file, verified; HDF5 ones in place where ``into`` matches."""
    from . import hdf5, torchfile

    if _format(path, rec) == TORCH:
        got = torchfile.read(path, rec)
        return {n: got[n] for n in entries}
    return hdf5.read_tensors(path, entries, into=into, stats=stats)


def verify(path: Path, rec: Mapping[str, Any], *, whole: FileCrc | None = None) -> list[str]:
    """Every damaged tensor of one rank file (an empty list when it reads back intact);
    ``rec``: the rank's manifest record, already validated. ``whole``: the whole file's
    crc32c as well, from the same reads (left None where the format's reader cannot)."""
    if _format(path, rec) == TORCH:
        from . import torchfile
        return torchfile.verify(path, rec, whole=whole)
    from . import hdf5
    return hdf5.verify_tensors(path, rec.get("tensors", {}), whole=whole)
