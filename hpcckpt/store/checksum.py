"""Checksums of files and of byte ranges in them, read by the native core.

``fd_crc32c``: a whole file (``commit.verify_files``). ``checksum_problems``: every tensor
of a rank file by its byte range and, given a ``FileCrc``, the whole file's crc32c from the
same reads (a full verify reads each byte once). Nothing here imports h5py: verifying a
sync-format checkpoint does not pay for it.
"""
from __future__ import annotations

import errno
from pathlib import Path

import numpy as np

from .._core import native
from ..errors import CheckpointCorrupt

DIRECT_WHERE_COLD = 2  # checksum_ranges: O_DIRECT for the spans mostly not in the page cache
_NONE = np.zeros(0, dtype=np.uint64)


class FileCrc:
    """The crc32c of a file's first ``nbytes`` bytes, asked of a reader that reads those bytes
    anyway (a full verify's tensor checksums: ``checksum_ranges(whole_len=)``, one pass for
    both); ``crc`` stays None when that reader did not compute it (then ``verify_files``
    reads the file itself)."""
    __slots__ = ("nbytes", "crc")

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.crc: int | None = None


def fd_crc32c(fd: int, size: int) -> int:
    """crc32c of the first ``size`` bytes of an open file (pread: its offset is left alone):
    one native call, chunks read and checksummed on parallel threads (through the page cache
    where a prefetch put them, O_DIRECT elsewhere) and combined."""
    if not size:
        return 0
    try:
        _, stats = native().checksum_ranges(fd, _NONE, _NONE, direct=DIRECT_WHERE_COLD, whole_len=size)
    except OSError as exc:
        if exc.errno == errno.ENODATA:
            raise CheckpointCorrupt(f"file ends before the {size} bytes its manifest lists") from None
        raise
    return int(stats["whole_crc32c"])


def checksum_problems(path: Path, fd: int, names: list[str], offsets: np.ndarray, lengths: np.ndarray,
                      want: np.ndarray, *, whole: FileCrc | None = None) -> list[str]:
    """Every range of the open file ``fd`` whose crc32c is not ``want``'s, named after its tensor
    (``names``; ``offsets``, ``lengths``: uint64 arrays, ``want``: uint32): one native call
    (``checksum_ranges``, O_DIRECT unless half the file is cached), one vectorised comparison.
    A file too short or unreadable is one problem saying so. ``whole``: its ``crc`` is set to
    the crc32c of the file's first ``nbytes`` bytes, checksummed from the same reads (every
    byte read once for both checks). What is in the page cache (a prefetch's) is read from it,
    the rest with O_DIRECT, span by span."""
    try:
        raw, stats = native().checksum_ranges(fd, offsets, lengths, path=str(path), direct=DIRECT_WHERE_COLD,
                                              whole_len=0 if whole is None else whole.nbytes)
    except OSError as exc:
        if exc.errno == errno.ENODATA:
            return [f"{path}: file is shorter than its manifest says ({exc.strerror}); it was truncated after "
                    "the checkpoint was committed"]
        return [f"{path}: cannot be read ({exc.strerror or exc})"]
    if whole is not None and whole.nbytes:
        whole.crc = int(stats["whole_crc32c"])
    got = np.frombuffer(raw, dtype=np.uint32)
    return [f"{path}: tensor {names[i]!r} fails its checksum (crc32c {int(got[i]):#010x}, manifest "
            f"{int(want[i]):#010x}); its bytes on disk are damaged" for i in np.flatnonzero(got != want)]
