"""The machine's limits, measured on the benchmark's own file system.

``write_gbps``: raw parallel O_DIRECT write + fdatasync of the same bytes by the
native writer pool with no copy and no checksum (fio-like: several streams), what
any checkpoint writer can at best reach; ``write_dd_gbps``: one ``dd oflag=direct
conv=fsync`` stream, for reference; ``read_gbps``: cold-cache read of the same
file, the better of one ``dd`` stream and four O_DIRECT reader threads (a single
stream leaves a virtual disk idle between requests; a loader need not); ``memcpy_gbps``: host copy into prefaulted staging with the
native parallel copy (``memcpy_1t_gbps``: one thread), the floor of any snapshot.
"""
from __future__ import annotations

import os
import re
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from .._core import native
from ..errors import HpcckptError

_DD_RE = re.compile(r"(\d+) bytes .* copied, ([0-9.]+) s")
GB = 1e9


def drop_caches(paths: list[Path]) -> str:
    """Evict ``paths`` from the page cache; returns the method used.

    As root the whole cache is dropped (``/proc/sys/vm/drop_caches``); otherwise
    each file gets ``posix_fadvise(DONTNEED)`` after an fsync (clean pages only).
    """
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        pass
    for path in paths:
        for p in ([path] if path.is_file() else [q for q in path.rglob("*") if q.is_file()]):
            evict(p)
    return "fadvise"


def evict(path: Path) -> None:
    """Drop one file's pages from the page cache (fsync first: only clean pages go)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _dd(args: list[str]) -> float:
    """Run dd; bytes per second from its own report."""
    out = subprocess.run(["dd", *args], capture_output=True, text=True, check=False)
    m = _DD_RE.search(out.stderr)
    if out.returncode != 0 or not m:
        raise HpcckptError(f"dd {' '.join(args)} failed ({out.returncode}): {out.stderr.strip()[-300:]}; "
                           "pick a --dir on a local file system that supports O_DIRECT")
    return int(m.group(1)) / float(m.group(2))


def read_threads() -> int:
    """Readers for the raw parallel read: as many as the CPUs allow, 4 to 16."""
    return max(4, min(16, native().usable_cpus()))


def parallel_read_bps(path: Path, *, threads: int = 0, block: int = 16 << 20, fresh: bool = False) -> float:
    """Read ``path`` with ``threads`` O_DIRECT readers (0: ``read_threads()``; page cache
    where refused); bytes/s.

    ``fresh``: into one new, never-touched buffer the size of the file (where a load's
    bytes must land) instead of a reused block per thread.
    """
    size = path.stat().st_size
    threads = threads or read_threads()
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        fd = os.open(path, os.O_RDONLY)
    padded = -(-size // 4096) * 4096
    whole = memoryview(native().aligned_buffer(padded, 4096, False, False)) if fresh else None
    bufs = [memoryview(native().aligned_buffer(block, 4096, True)) for _ in range(0 if fresh else threads)]

    def worker(k: int) -> None:
        for off in range(k * block, size, threads * block):
            # O_DIRECT wants whole blocks: the last one is rounded up (a short read at EOF).
            n = min(block, -(-(size - off) // 4096) * 4096)
            os.preadv(fd, [whole[off:off + n] if whole is not None else bufs[k][:n]], off)

    try:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(worker, range(threads)))
        return size / (time.perf_counter() - t0)
    finally:
        os.close(fd)


def direct_write_bps(path: Path, nbytes: int) -> float:
    """``dd`` of ``nbytes`` (whole 16 MiB blocks) to ``path`` with O_DIRECT + fsync; bytes/s."""
    block = 16 << 20
    return _dd(["if=/dev/zero", f"of={path}", f"bs={block}", f"count={max(1, nbytes // block)}",
                "oflag=direct", "conv=fsync"])


def parallel_write_bps(path: Path, nbytes: int, *, threads: int = 0, block: int = 16 << 20) -> float:
    """``nbytes`` written to a new ``path`` by the native writer pool: O_DIRECT pwrite of
    ``block``-sized pieces on ``threads`` threads (0: as the engines pick), then fdatasync;
    bytes/s. The data is one reused aligned buffer: nothing but the disk is measured."""
    block = min(block, max(4096, -(-nbytes // 4096) * 4096))  # a small state: its own size, whole pages
    n = max(block, nbytes // block * block)
    buf = native().aligned_buffer(min(n, 16 * block), 4096, True)
    np.frombuffer(buf, dtype=np.uint8)[:] = 0xA5
    path.unlink(missing_ok=True)
    pool = native().WriterPool(threads, block)
    try:
        batch = native().Batch(pool, True)
        for off in range(0, n, block):
            piece = memoryview(buf)[(off % len(buf)):(off % len(buf)) + block]
            batch.add(str(path), off, piece)
        t0 = time.perf_counter()
        batch.start()
        batch.wait()
        elapsed = time.perf_counter() - t0
    finally:
        pool.close()
    return n / elapsed


def write_read_gbps(directory: Path, nbytes: int) -> dict[str, float | str]:
    """Direct write + fsync and cold read bandwidth (GB/s) with a ``nbytes`` file."""
    path = directory / "bench-dd.bin"
    block = 16 << 20
    try:
        dd_write = direct_write_bps(path, nbytes)
        path.unlink()
        write = parallel_write_bps(path, nbytes)
        method = drop_caches([path])
        dd_read = _dd([f"if={path}", "of=/dev/null", f"bs={block}"])
        drop_caches([path])
        par_read = parallel_read_bps(path)
    finally:
        path.unlink(missing_ok=True)
    return {"write_gbps": write / GB, "write_dd_gbps": dd_write / GB,
            "read_gbps": max(dd_read, par_read) / GB, "read_dd_gbps": dd_read / GB,
            "read_parallel_gbps": par_read / GB, "cold_cache": method}


def memcpy_gbps(nbytes: int, *, threads: int = 0, repeats: int = 3) -> float:
    """Best of ``repeats`` copies of ``nbytes`` into prefaulted, aligned staging."""
    n = max(nbytes, 1 << 20)
    src = np.ones(n, dtype=np.uint8)
    dst = np.frombuffer(native().aligned_buffer(n, 4096, True), dtype=np.uint8)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        native().parallel_copy(dst, src, threads)
        best = min(best, time.perf_counter() - t0)
    return n / best / GB


def fresh_memory_gbps(nbytes: int, *, repeats: int = 3) -> float:
    """Best of ``repeats`` parallel copies into never-touched memory (4 KiB pages, as a
    load's new tensors get): the page-fault bound of any load that returns fresh tensors."""
    n = max(nbytes, 1 << 20)
    src = np.frombuffer(native().aligned_buffer(n, 4096, True), dtype=np.uint8)
    best = float("inf")
    for _ in range(repeats):
        dst = native().aligned_buffer(n, 4096, False, False)
        t0 = time.perf_counter()
        native().parallel_copy(dst, src)
        best = min(best, time.perf_counter() - t0)
        del dst
    return n / best / GB
