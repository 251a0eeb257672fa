"""Read a checkpoint's files into the page cache while its manifest is being checked.

A full check (``catalog.check(full=True)``: ``hpcckpt verify``) must parse and validate
the manifest before it knows which byte ranges to checksum; at tens of thousands of
tensors that takes as long as reading the data itself. ``Prefetch`` starts reading the
step directory's files at once, on threads of its own (``sendfile`` to ``/dev/null``:
the kernel reads the pages, nothing is copied to user space), so the disk works while
the manifest is parsed. When the checksums start, the prefetch is stopped (``stop``) and
they read what it cached through the page cache and the rest with O_DIRECT, span by span
(``checksum_ranges(direct=2)``): the disk's full rate for what the prefetch did not reach,
no second read of what it did. It only warms the cache: what is trusted is still decided
by the checksums that follow, and a file that cannot be read here is read again, and
reported, there.

Nothing is prefetched when the files would not fit comfortably in the memory the kernel
says is available (half of ``MemAvailable``): a cache that evicts its own first pages
would make the data read twice.
"""
from __future__ import annotations

import os
import threading
from pathlib import Path
from types import TracebackType

from .commit import MANIFEST

BLOCK = 16 << 20
# Each thread's first piece: the manifest's parse (``json.loads``: C, 0.1 s at 65,536 tensors)
# holds the interpreter throughout, and a thread between two ``sendfile`` calls waits for it;
# with 16 MiB first pieces the disk sat idle for most of the parse.
FIRST_BLOCK = 64 << 20
THREADS = 2


def mem_available() -> int | None:
    """``MemAvailable`` in bytes, or None where /proc/meminfo does not say."""
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class Prefetch:
    """``with Prefetch(step_dir): ...``: the directory's regular files (not the manifest,
    not symlinks) read into the page cache meanwhile; leaving the block waits for the reads
    (or stops them early when the block raised)."""

    def __init__(self, directory: Path, *, threads: int = THREADS, block: int = BLOCK,
                 first_block: int = FIRST_BLOCK) -> None:
        self.directory = directory
        self.threads = max(1, threads)
        self.block = block
        self.first_block = max(block, first_block)
        self.files: list[tuple[int, int]] = []  # (fd, size)
        self.pieces: list[tuple[int, int, int]] = []  # (fd, offset, length), in file order
        self._next = 0
        self._lock = threading.Lock()
        self._stop = False
        self._workers: list[threading.Thread] = []

    def __enter__(self) -> Prefetch:
        try:
            self._open()
        except OSError:
            self._close_files()
            return self
        if self.files:
            self.pieces = self._cut()
            for k in range(min(self.threads, len(self.pieces))):
                t = threading.Thread(target=self._run, name=f"hpcckpt-prefetch-{k}", daemon=True)
                t.start()
                self._workers.append(t)
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.wait(stop=et is not None)

    def stop(self) -> None:
        """Read no further (each thread finishes the piece it is reading); does not wait."""
        self._stop = True

    def wait(self, *, stop: bool = False) -> None:
        """Wait for the reads (``stop``: after the piece each thread is reading)."""
        self._stop = self._stop or stop
        for t in self._workers:
            t.join()
        self._workers.clear()
        self._close_files()

    def _open(self) -> None:
        total = 0
        with os.scandir(self.directory) as it:
            entries = [e for e in it if e.name != MANIFEST and e.is_file(follow_symlinks=False)]
        for e in entries:
            try:
                fd = os.open(e.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError:
                continue
            st = os.fstat(fd)
            if not st.st_size or (st.st_mode & 0o170000) != 0o100000:
                os.close(fd)
                continue
            self.files.append((fd, st.st_size))
            total += st.st_size
        avail = mem_available()
        if avail is None or total > avail // 2:
            self._close_files()

    def _cut(self) -> list[tuple[int, int, int]]:
        """The files in pieces: the first one per thread ``first_block`` long, then ``block``."""
        pieces: list[tuple[int, int, int]] = []
        for fd, size in self.files:
            off = 0
            while off < size:
                n = min(self.first_block if len(pieces) < self.threads else self.block, size - off)
                pieces.append((fd, off, n))
                off += n
        return pieces

    def _take(self) -> tuple[int, int, int] | None:
        """The next (fd, offset, length) to read, in file order, or None."""
        with self._lock:
            k = self._next
            self._next += 1
        return self.pieces[k] if k < len(self.pieces) else None

    def _run(self) -> None:
        try:
            null = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
        except OSError:
            return
        try:
            while not self._stop:
                piece = self._take()
                if piece is None:
                    return
                fd, off, n = piece
                while n > 0 and not self._stop:
                    sent = os.sendfile(null, fd, off, n)
                    if sent <= 0:
                        break
                    off += sent
                    n -= sent
        except OSError:
            return  # only a hint: the checksums read (and report) these bytes again
        finally:
            os.close(null)

    def _close_files(self) -> None:
        for fd, _ in self.files:
            os.close(fd)
        self.files = []
