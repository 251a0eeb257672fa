"""Type stubs for hpcckpt's compiled persist core (native/, built by scikit-build-core).

Every function that touches more than a few bytes releases the GIL. Errors
from the file system arrive as ``OSError(errno, strerror, path)``.
"""

from __future__ import annotations

from typing import Any

from typing_extensions import Buffer

def crc32c(data: Buffer, crc: int = 0) -> int:
    """CRC-32C (Castagnoli; iSCSI / google-crc32c convention).

    ``crc32c(b"123456789") == 0xE3069283`` and ``crc32c(b, crc32c(a)) == crc32c(a + b)``.
    Uses sse4.2 / ARMv8 CRC32 when the CPU has it (see :func:`crc32c_impl`).
    """

def crc32c_software(data: Buffer, crc: int = 0) -> int:
    """The portable table-driven CRC-32C (same results as :func:`crc32c`; for tests)."""

def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """``crc32c(A + B)`` from ``crc32c(A)``, ``crc32c(B)`` and ``len(B)``."""

def crc32c_impl() -> str:
    """``"sse4.2"``, ``"armv8-crc"`` or ``"software"``: chosen at run time."""

def parallel_copy(dst: Buffer, src: Buffer, threads: int = 0) -> None:
    """``dst[:] = src`` split across ``threads`` threads (0 = from size and CPU count).

    ``dst`` must be writable and C-contiguous. Raises ValueError if the sizes differ.
    """

class StagingBuffer:
    """Aligned, optionally prefaulted memory; exports the writable buffer protocol.

    ``numpy.frombuffer(buf, dtype)`` / ``torch.frombuffer(buf, dtype=...)`` view it
    without copying; the memory is freed when the last view is gone.
    """

    @property
    def nbytes(self) -> int: ...
    @property
    def alignment(self) -> int: ...
    @property
    def address(self) -> int:
        """Start address (to check alignment)."""

    def __len__(self) -> int: ...
    def __buffer__(self, flags: int, /) -> memoryview: ...

def aligned_buffer(nbytes: int, alignment: int = 4096, prefault: bool = True,
                   huge: bool | None = None) -> StagingBuffer:
    """posix_memalign'd memory. ``prefault``: every page is touched once now so later
    copies into it take no first-touch page faults. ``huge`` (default: ``prefault``):
    blocks >= 4 MiB are 2 MiB-aligned with MADV_HUGEPAGE; good for memory reused many
    times, not for one-shot memory (the kernel may compact memory on first touch).
    ValueError if ``alignment`` is not a power of two >= 8."""

def read_items(path: str, items: list[tuple[Buffer, int] | tuple[Buffer, int, bool]], threads: int = 0,
               chunk_bytes: int = 0, direct: bool = False, populate: int = 0,
               fd: int = -1) -> tuple[list[int], dict[str, int]]:
    """Read ``(writable buffer, file offset[, fresh])`` items of one file on ``threads``
    threads (0 = from the usable CPUs) in ``chunk_bytes`` chunks (0 = 16 MiB), each chunk
    crc32c'd as it lands. ``direct``: O_DIRECT where the file offset is 4 KiB-aligned
    (through a per-thread bounce buffer when the buffer is not). ``fresh``: the buffer is
    memory never touched; ``populate``: that many more threads fault fresh pages in ahead
    of the reads, while the items in use are read first. Returns each item's crc32c and
    ``{"direct_bytes", "buffered_bytes", "bounced_bytes", "threads"}``.
    ``OSError(ENODATA)`` when the file ends before an item does."""


def table_check(dtypes: list[Any], shapes: list[Any], nbytes: list[Any], crcs: list[Any], offsets: list[Any] | None,
                itemsize: dict[str, int], file_bytes: int, max_dims: int) -> tuple[bytes, bytes, bytes] | None:
    """A manifest's tensor table checked in one pass (``store.tensortable``): the offsets, nbytes
    and crc32c columns as native uint64, uint64 and uint32 bytes when every row passes the quick
    checks (plain ints, a dtype in ``itemsize``, a shape of at most ``max_dims`` dims >= 0 whose
    product times the dtype's size is ``nbytes``, at most ``file_bytes``, a crc within 32 bits,
    and with ``offsets`` a range ending inside the file; ``offsets`` None: zeros); None when
    some row needs a closer look (checked row by row then). Overflow anywhere counts as such a row."""

def table_check_packed(dtypes: list[Any], ndim: Buffer, dims: Buffer, nbytes: Buffer, crcs: Buffer,
                       offsets: Buffer | None, itemsize: dict[str, int], file_bytes: int, max_dims: int) -> bool:
    """``table_check`` for a table whose whole numbers are packed (hpcckpt/4): ``ndim`` uint16,
    ``dims`` (every row's dims in turn), ``nbytes`` and ``offsets`` uint64, ``crcs`` uint32 native
    buffers of the table's length; True when every row passes the same quick checks (and ``dims``
    holds exactly the dims ``ndim`` counts), False when some row needs a closer look."""

def checksum_ranges(fd: int, offsets: Buffer, lengths: Buffer, path: str = "", threads: int = 0,
                    chunk_bytes: int = 0, direct: bool = False) -> tuple[bytes, dict[str, int]]:
    """crc32c of each byte range ``[offsets[i], offsets[i] + lengths[i])`` (uint64 arrays) of the
    open regular file ``fd``: ranges taken in file order, gathered into spans of at most
    ``chunk_bytes`` (0 = 8 MiB; gaps under 1 MiB read through), each span read once on one of
    ``threads`` threads (0 = 4..8 from the usable CPUs; O_DIRECT with ``direct`` where allowed)
    and every range checksummed from that thread's buffer. Returns the crcs as native uint32
    bytes (``numpy.frombuffer(raw, numpy.uint32)``) and ``{"direct_bytes", "buffered_bytes",
    "threads"}``. ``OSError(ENODATA)`` when the file ends before a range does; ``path`` only
    names the file in errors."""


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask: a Slurm job's cpuset)."""


def file_resident(path: str, fd: int = -1) -> tuple[int, int]:
    """``(bytes of path in the page cache, file size)`` (mincore over a mapping); ``fd`` >= 0:
    of that open descriptor (``path`` then only names it in errors)."""

def barrier_kind() -> str:
    """Persistence barrier chosen at run time: ``"clwb"``, ``"clflushopt"``,
    ``"clflush"``, ``"dc cvap"``, ``"dc cvac"`` or ``"none"``."""

def cache_line_bytes() -> int:
    """Line size :func:`persist_range` steps by."""

def persist_range(buf: Buffer) -> None:
    """Write back every cache line of ``buf`` with :func:`barrier_kind`'s instruction,
    then fence (sfence / dsb ish). Makes stores durable only on DAX mappings; on
    page-cache files use :func:`fdatasync`."""

def store_fence() -> None:
    """Order all earlier stores before later ones (sfence / dsb ish)."""

def fdatasync(fd: int, path: str = "") -> None:
    """fdatasync(2), retried on EINTR; raises ``OSError(errno, strerror, path)``."""

class WriterPool:
    """Persistent writer threads, reused across checkpoints.

    Several :class:`Batch` objects may be in flight on one pool at once.
    """

    def __init__(self, threads: int = 0, chunk_bytes: int = 8 << 20) -> None:
        """``threads == 0``: from the CPU count (2..16). ``chunk_bytes``: unit of copy,
        checksum and pwrite."""

    @property
    def threads(self) -> int: ...
    @property
    def chunk_bytes(self) -> int: ...
    @property
    def closed(self) -> bool: ...
    def close(self) -> None:
        """Finish all queued work (batches already started complete) and join the
        threads (blocks, GIL released). Idempotent. Later ``Batch()``/``start()``
        raise RuntimeError."""

    def __enter__(self) -> WriterPool: ...
    def __exit__(self, *exc: object) -> None: ...

class Batch:
    """The writes of one checkpoint, run on a :class:`WriterPool`.

    Call sequence: ``add()`` * n -> ``start()`` -> ``wait_copied()`` (optional) ->
    ``wait()`` -> ``crc(i)``. After ``start()`` all work runs on the pool's threads:
    per chunk copy src -> staging (checksummed while hot) -> pwrite; per file, after
    its last chunk, fdatasync and close. Copies take priority over writes, but one
    thread keeps writing, so writes of chunk k overlap the copy of chunk k+1.
    A Batch dropped before ``wait()`` cancels work not yet begun and waits for work in
    progress before releasing its buffers.
    """

    def __init__(self, pool: WriterPool, direct: bool = False) -> None:
        """``direct``: the 4 KiB-aligned middle of each chunk is written with O_DIRECT
        (falls back to the page cache where the file system refuses O_DIRECT);
        unaligned heads and tails always go through the page cache."""

    def add(self, path: str, offset: int, data: Buffer, src: Buffer | None = None) -> int:
        """Queue one item; returns its id (0, 1, ...).

        Writes ``data`` at byte ``offset`` of ``path`` (opened once per batch with
        O_RDWR|O_CREAT, never truncated). With ``src``, first copies ``src`` into
        ``data`` (``data`` must then be writable and the same size). References to
        both buffers are held until the batch finishes. RuntimeError after start().
        """

    def start(self) -> None:
        """Open the files and queue the work; returns at once."""

    def wait_copied(self, timeout: float | None = None) -> bool:
        """True once every ``src`` was copied into staging (the caller may then modify
        the sources), or the batch failed (``wait()`` then raises). False on timeout."""

    def wait(self, timeout: float | None = None) -> bool:
        """True once every write returned and every distinct file was fdatasync'ed.

        False on timeout. On failure raises ``OSError(errno, strerror, path)`` for the
        first error (the message lists every error) exactly once; later calls return True.
        """

    def crc(self, item: int) -> int:
        """crc32c of item's bytes as written (chunk crcs combined); after ``wait()``."""

    @property
    def bytes_total(self) -> int: ...
    @property
    def bytes_copied(self) -> int: ...
    @property
    def bytes_written(self) -> int: ...
