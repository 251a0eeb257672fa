"""The machine's limits, measured on the benchmark's own file system.

``write_gbps``: raw direct-I/O write + fsync (``dd oflag=direct conv=fsync``), what
any checkpoint writer can at best reach; ``read_gbps``: cold-cache sequential read
of the same file; ``memcpy_gbps``: host copy into prefaulted staging with the
native parallel copy (``memcpy_1t_gbps``: one thread), the floor of any snapshot.
"""
from __future__ import annotations

import os
import re
import subprocess
import time
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
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return "fadvise"


def _dd(args: list[str]) -> float:
    """Run dd; bytes per second from its own report."""
    out = subprocess.run(["dd", *args], capture_output=True, text=True, check=False)
    m = _DD_RE.search(out.stderr)
    if out.returncode != 0 or not m:
        raise HpcckptError(f"dd {' '.join(args)} failed ({out.returncode}): {out.stderr.strip()[-300:]}; "
                           "pick a --dir on a local file system that supports O_DIRECT")
    return int(m.group(1)) / float(m.group(2))


def write_read_gbps(directory: Path, nbytes: int) -> tuple[float, float, str]:
    """(direct write + fsync GB/s, cold read GB/s, cache-drop method) with a ``nbytes`` file."""
    path = directory / "bench-dd.bin"
    block = 16 << 20
    count = max(1, nbytes // block)
    try:
        write = _dd(["if=/dev/zero", f"of={path}", f"bs={block}", f"count={count}", "oflag=direct", "conv=fsync"])
        method = drop_caches([path])
        read = _dd([f"if={path}", "of=/dev/null", f"bs={block}"])
    finally:
        path.unlink(missing_ok=True)
    return write / GB, read / GB, method


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
