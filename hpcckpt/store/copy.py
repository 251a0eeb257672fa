"""Copy a checkpoint file to another level and prove the copy: the levels' drain
(``levels.save.drain``) and the epilog's scavenge (``store.scavenge``) both use it."""
from __future__ import annotations

import os
from pathlib import Path

from .._core import crc32c
from ..fsio import write_all
from .commit import fsync_path, open_checked

COPY_CHUNK = 16 << 20


def copy_verified(src: Path, dst: Path, *, size: int | None = None) -> tuple[int, int]:
    """Copy ``src`` to a new ``dst``, fsync it, read it back: its crc32c must be the source's
    as read. Returns ``(size, crc32c)`` of what was copied.

    ``src`` is opened once and checked open (``commit.open_checked``: no symlink, no FIFO,
    a regular file of ours or of its directory's owner, of exactly ``size`` bytes when
    given); ``dst`` must not exist (``O_EXCL|O_NOFOLLOW``: nothing is ever written through
    a name somebody else put there). OSError or CheckpointCorrupt otherwise."""
    crc, n_in = 0, 0
    fd_in = open_checked(Path(src), size=size)
    try:
        fd_out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            while data := os.read(fd_in, COPY_CHUNK):
                crc = crc32c(data, crc)
                n_in += len(data)
                write_all(fd_out, data)
            os.fsync(fd_out)
        finally:
            os.close(fd_out)
    finally:
        os.close(fd_in)
    back, n = 0, 0
    fd = os.open(dst, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with open(fd, "rb", buffering=0) as f:
        while data := f.read(COPY_CHUNK):
            back = crc32c(data, back)
            n += len(data)
    if (n, back) != (n_in, crc):
        raise OSError(f"{dst} reads back as {n} bytes crc32c {back:#010x}, written {n_in} bytes {crc:#010x}")
    fsync_path(Path(dst).parent)
    return n_in, crc
