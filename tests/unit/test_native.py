"""Tests of the compiled core through hpcckpt._native (real files, real fsync)."""

from __future__ import annotations

import errno
import os
import random
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from hpcckpt import _native

pytestmark = pytest.mark.native

REPO = Path(__file__).resolve().parents[2]

_POLY = 0x82F63B78
_TABLE = []
for _n in range(256):
    _c = _n
    for _ in range(8):
        _c = (_c >> 1) ^ _POLY if _c & 1 else _c >> 1
    _TABLE.append(_c)


def crc32c_reference(data: bytes, crc: int = 0) -> int:
    """Bytewise CRC-32C, straight from the definition."""
    c = crc ^ 0xFFFFFFFF
    for b in data:
        c = _TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def test_crc32c_known_vectors() -> None:
    assert _native.crc32c(b"123456789") == 0xE3069283
    assert _native.crc32c(b"") == 0
    assert _native.crc32c(bytes(32)) == 0x8A9136AA
    assert _native.crc32c_impl() in {"sse4.2", "armv8-crc", "software"}


def test_crc32c_matches_reference_on_random_data() -> None:
    rng = random.Random(1234)
    blob = rng.randbytes(70_000)
    for _ in range(60):
        start = rng.randrange(0, 16)
        length = rng.choice([0, 1, 7, 8, 9, 255, 768, 769, rng.randrange(0, 70_000 - 16)])
        piece = blob[start : start + length]
        expected = crc32c_reference(piece)
        assert _native.crc32c(piece) == expected
        assert _native.crc32c_software(piece) == expected


def test_crc32c_chaining_combine_and_buffer_kinds() -> None:
    data = np.random.default_rng(5).integers(0, 256, size=3_000_001, dtype=np.uint8)
    whole = _native.crc32c(data)
    assert whole == _native.crc32c_software(data.tobytes())
    a, b = data[:1_234_567], data[1_234_567:]
    assert _native.crc32c(b, _native.crc32c(a)) == whole
    assert _native.crc32c_combine(_native.crc32c(a), _native.crc32c(b), len(b)) == whole
    assert _native.crc32c(memoryview(data.tobytes())[5:]) == _native.crc32c(data[5:].tobytes())
    with pytest.raises((BufferError, ValueError)):
        _native.crc32c(data[::2])  # not contiguous


def test_parallel_copy_threads_and_size_mismatch() -> None:
    src = np.random.default_rng(6).integers(0, 256, size=(9 << 20) + 3, dtype=np.uint8)
    for threads in (0, 1, 2, 5):
        dst = np.zeros_like(src)
        _native.parallel_copy(dst, src, threads)
        assert np.array_equal(dst, src)
    with pytest.raises(ValueError, match="bytes"):
        _native.parallel_copy(np.zeros(10, np.uint8), np.zeros(11, np.uint8))
    with pytest.raises(BufferError):
        _native.parallel_copy(b"x" * 10, np.zeros(10, np.uint8))  # bytes are read-only


def test_aligned_buffer_views_and_lifetime() -> None:
    buf = _native.aligned_buffer((1 << 20) + 5, alignment=1 << 16)
    assert buf.address % (1 << 16) == 0
    assert len(buf) == buf.nbytes == (1 << 20) + 5
    view = np.frombuffer(buf, dtype=np.uint8)
    view[:] = 7
    del buf  # the numpy view keeps the memory alive
    assert int(view.sum()) == 7 * ((1 << 20) + 5)
    assert np.frombuffer(_native.aligned_buffer(4096, prefault=False), np.uint8).size == 4096
    with pytest.raises(ValueError, match="power of two"):
        _native.aligned_buffer(100, alignment=3000)


def test_aligned_buffer_with_torch() -> None:
    torch = pytest.importorskip("torch")
    buf = _native.aligned_buffer(16 * 4)
    t = torch.frombuffer(buf, dtype=torch.float32)
    t.copy_(torch.arange(16, dtype=torch.float32))
    assert np.frombuffer(buf, np.float32)[15] == 15.0


def test_barrier_persist_range_on_mmap(tmp_path: Path) -> None:
    import mmap

    assert _native.barrier_kind() in {"clwb", "clflushopt", "clflush", "dc cvap", "dc cvac", "none"}
    path = tmp_path / "dax-like.bin"
    path.write_bytes(bytes(1 << 16))
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 1 << 16) as m:
        m[:] = b"\xab" * (1 << 16)
        _native.persist_range(m)
        _native.store_fence()
        m.flush()
    assert path.read_bytes() == b"\xab" * (1 << 16)


def test_fdatasync_raises_oserror_with_path(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    with open(path, "wb") as f:
        f.write(b"x")
        _native.fdatasync(f.fileno(), str(path))
    r, w = os.pipe()
    os.close(r)
    os.close(w)
    with pytest.raises(OSError) as info:
        _native.fdatasync(w, "/some/ckpt/file")
    assert info.value.errno == 9  # EBADF
    assert info.value.filename == "/some/ckpt/file"


def _rand(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint8)


@pytest.mark.parametrize("direct", [False, True])
def test_batch_writes_read_back_with_item_crcs(tmp_path: Path, direct: bool) -> None:
    with _native.WriterPool(threads=3, chunk_bytes=256 << 10) as pool:
        a = _rand((5 << 20) + 4096, 1)
        b = _rand(1_000_003, 2)
        staging = _native.aligned_buffer(a.nbytes)
        batch = _native.Batch(pool, direct=direct)
        f1, f2 = tmp_path / "rank0.bin", tmp_path / "rank1.bin"
        ia = batch.add(str(f1), 0, staging, src=a)
        ib = batch.add(str(f1), a.nbytes + 3, b)
        ic = batch.add(str(f2), 8192, b)
        assert (ia, ib, ic) == (0, 1, 2)
        assert batch.bytes_total == a.nbytes + 2 * b.nbytes
        batch.start()
        assert batch.wait() is True
        assert batch.bytes_written == batch.bytes_total
        assert batch.bytes_copied == a.nbytes
        raw1 = f1.read_bytes()
        assert raw1[: a.nbytes] == a.tobytes()
        assert raw1[a.nbytes + 3 :] == b.tobytes()
        assert f2.read_bytes()[8192:] == b.tobytes()
        assert batch.crc(ia) == _native.crc32c(a)
        assert batch.crc(ib) == batch.crc(ic) == _native.crc32c(b)
        with pytest.raises(IndexError):
            batch.crc(3)


def test_batch_does_not_truncate_existing_file(tmp_path: Path) -> None:
    path = tmp_path / "keep.bin"
    path.write_bytes(b"A" * 100)
    with _native.WriterPool(threads=1) as pool:
        batch = _native.Batch(pool)
        batch.add(str(path), 10, b"BBBB")
        batch.start()
        assert batch.wait()
    assert path.read_bytes() == b"A" * 10 + b"BBBB" + b"A" * 86


def test_wait_copied_lets_caller_mutate_sources_before_wait(tmp_path: Path) -> None:
    src = _rand(16 << 20, 3)
    expected = src.tobytes()
    staging = _native.aligned_buffer(src.nbytes)
    with _native.WriterPool(threads=2, chunk_bytes=1 << 20) as pool:
        batch = _native.Batch(pool)
        item = batch.add(str(tmp_path / "w.bin"), 0, staging, src=src)
        batch.start()
        assert batch.wait_copied(timeout=60.0)
        assert batch.bytes_copied == src.nbytes
        src[:] = 0  # the training step goes on; staging already holds the snapshot
        assert batch.wait(timeout=60.0)
    assert (tmp_path / "w.bin").read_bytes() == expected
    assert batch.crc(item) == _native.crc32c(expected)


def test_batch_call_order_errors(tmp_path: Path) -> None:
    with _native.WriterPool(threads=1) as pool:
        batch = _native.Batch(pool)
        with pytest.raises(RuntimeError, match="before start"):
            batch.wait()
        batch.add(str(tmp_path / "x"), 0, b"abc")
        batch.start()
        with pytest.raises(RuntimeError, match="after start"):
            batch.add(str(tmp_path / "x"), 0, b"abc")
        with pytest.raises(RuntimeError, match="twice"):
            batch.start()
        assert batch.wait()
        with pytest.raises(ValueError, match="same|bytes"):
            _native.Batch(pool).add(str(tmp_path / "y"), 0, bytearray(4), src=b"12345")
    with pytest.raises(RuntimeError, match="closed"):
        _native.Batch(pool)


def test_several_batches_in_flight_then_commit_record(tmp_path: Path) -> None:
    pool = _native.WriterPool(threads=2, chunk_bytes=512 << 10)
    datas = [_rand((3 << 20) + 17 * i, 10 + i) for i in range(4)]
    batches = []
    for i, d in enumerate(datas):
        b = _native.Batch(pool, direct=bool(i % 2))
        b.add(str(tmp_path / f"step{i}.bin"), 0, d)
        b.start()
        batches.append(b)
    # Wait from several Python threads at once: the GIL is released while waiting.
    results: list[bool] = []
    threads = [threading.Thread(target=lambda b=b: results.append(b.wait())) for b in batches]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [True] * 4
    record = "".join(f"step{i}.bin {b.crc(0):08x}\n" for i, b in enumerate(batches)).encode()
    commit = _native.Batch(pool)
    commit.add(str(tmp_path / "COMMIT"), 0, record)
    commit.start()
    assert commit.wait()
    pool.close()
    for i, d in enumerate(datas):
        on_disk = (tmp_path / f"step{i}.bin").read_bytes()
        assert on_disk == d.tobytes()
        assert f"step{i}.bin {_native.crc32c(on_disk):08x}".encode() in (tmp_path / "COMMIT").read_bytes()


def test_pool_close_finishes_batches_in_flight(tmp_path: Path) -> None:
    pool = _native.WriterPool(threads=2, chunk_bytes=64 << 10)
    data = _rand(8 << 20, 21)
    started = _native.Batch(pool)
    item = started.add(str(tmp_path / "inflight.bin"), 0, data)
    started.start()
    pending = _native.Batch(pool)  # created but never started
    pending.add(str(tmp_path / "never.bin"), 0, b"x")
    pool.close()
    assert pool.closed
    assert started.wait(timeout=0.0)  # close() drained the queue
    assert started.crc(item) == _native.crc32c(data)
    assert (tmp_path / "inflight.bin").read_bytes() == data.tobytes()
    with pytest.raises(RuntimeError, match="closed"):
        pending.start()
    assert not (tmp_path / "never.bin").exists()


def test_batch_dropped_before_wait_is_safe(tmp_path: Path) -> None:
    with _native.WriterPool(threads=2, chunk_bytes=64 << 10) as pool:
        for i in range(5):
            b = _native.Batch(pool)
            b.add(str(tmp_path / f"drop{i}.bin"), 0, _rand(4 << 20, i), src=None)
            b.start()
            del b  # cancels queued chunks, waits for the running ones
        ok = _native.Batch(pool)
        ok.add(str(tmp_path / "after.bin"), 0, b"still works")
        ok.start()
        assert ok.wait()
    assert (tmp_path / "after.bin").read_bytes() == b"still works"


def test_open_error_names_the_path_and_raises_once(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-dir" / "x.bin"
    with _native.WriterPool(threads=1) as pool:
        batch = _native.Batch(pool)
        batch.add(str(missing), 0, b"data")
        batch.start()
        with pytest.raises(OSError) as info:
            batch.wait()
        assert info.value.errno == errno.ENOENT
        assert info.value.filename == str(missing)
        assert batch.wait() is True


def test_write_error_names_the_path(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    # open(O_RDWR) of a FIFO succeeds on Linux; pwrite then fails with ESPIPE.
    with _native.WriterPool(threads=1) as pool:
        batch = _native.Batch(pool)
        batch.add(str(fifo), 0, b"x" * 10)
        batch.start()
        with pytest.raises(OSError) as info:
            batch.wait(timeout=300.0)
        assert info.value.errno == errno.ESPIPE
        assert info.value.filename == str(fifo)
        assert "pwrite" in str(info.value)


def test_wait_timeout_arguments(tmp_path: Path) -> None:
    with _native.WriterPool(threads=1) as pool:
        batch = _native.Batch(pool)
        batch.add(str(tmp_path / "t.bin"), 0, b"t")
        batch.start()
        with pytest.raises(ValueError, match="timeout"):
            batch.wait(timeout=-1.0)
        assert batch.wait(timeout=600.0)
        assert batch.wait(timeout=0.0)  # finished: a zero timeout still says so


@pytest.mark.slow
def test_native_cpp_tests_pass_on_host() -> None:
    if shutil.which("cmake") is None:
        pytest.skip("cmake not installed (scripts/bootstrap installs it)")
    proc = subprocess.run(
        [str(REPO / "scripts" / "native-test")], capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 failed" in proc.stdout


@pytest.mark.slow
def test_native_cpp_tests_pass_on_arm64_under_qemu() -> None:
    missing = [t for t in ("aarch64-linux-gnu-g++", "qemu-aarch64-static") if shutil.which(t) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} missing: run scripts/install-arm64-tools")
    proc = subprocess.run(
        [str(REPO / "scripts" / "native-test-arm64")], capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count(" checks, 0 failed") == 3
    assert "crc32c impl: armv8-crc" in proc.stdout
    assert "crc32c impl: software" in proc.stdout
    assert "barrier: dc cvac" in proc.stdout


@pytest.mark.slow
def test_native_sources_name_every_header_they_use() -> None:
    """GCC 13+ and libc++ include less transitively than GCC 12: a missing #include
    that builds here must still fail in CI, not on a user's GPU node."""
    if shutil.which("clang++-16") is None:
        pytest.skip("clang++-16 missing: run scripts/native-check-headers --install-only (scripts/bootstrap does)")
    # the binding is checked against this interpreter's headers (and its nanobind)
    proc = subprocess.run([str(REPO / "scripts" / "native-check-headers")], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "HPCCKPT_PYTHON": sys.executable})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    n = len(list((REPO / "native").glob("src/*.cpp"))) + len(list((REPO / "native").glob("tests/*.cpp"))) + 1
    assert f"libstdc++ 14: {n} files checked" in proc.stderr
    assert f"libc++ 16 (no transitive includes): {n} files checked" in proc.stderr


def test_read_items_through_a_checked_descriptor(tmp_path: Path) -> None:
    """The fd form reads the open file, never its name; a FIFO or symlink is refused, never waited on."""
    import numpy as np

    from hpcckpt._core import crc32c as _crc
    from hpcckpt._core import native as _native
    data = os.urandom(1 << 16)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        path.rename(tmp_path / "moved")
        path.symlink_to("/etc/hostname")  # the name now leads elsewhere: the descriptor does not
        buf = np.empty(len(data), dtype=np.uint8)
        crcs, _ = _native().read_items("named-in-errors", [(buf, 0)], fd=fd)
        assert bytes(buf) == data and crcs == [_crc(data)]
        assert _native().file_resident("x", fd=fd)[1] == len(data)
    finally:
        os.close(fd)
    with pytest.raises(OSError) as link:
        _native().read_items(str(path), [(np.empty(8, dtype=np.uint8), 0)])
    assert link.value.errno == errno.ELOOP
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(OSError) as special:
        _native().read_items(str(fifo), [(np.empty(8, dtype=np.uint8), 0)])
    assert special.value.errno == errno.EINVAL


@pytest.mark.parametrize("direct", [0, 1, 2])
def test_checksum_ranges_matches_each_range_in_any_order(tmp_path: Path, direct: int) -> None:
    """Many small ranges, gaps, one range longer than a chunk, an empty one, overlaps and an
    unsorted order: every crc is the crc32c of exactly its bytes."""
    rng = random.Random(5)
    data = rng.randbytes(3 << 20)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    ranges = [(rng.randrange(0, len(data) - 5000), rng.randrange(0, 5000)) for _ in range(3000)]
    ranges += [(4096, 2 << 20), (100, 0), (len(data) - 7, 7), (0, 1), (200_000, 300), (200_100, 300)]
    rng.shuffle(ranges)
    offsets = np.array([o for o, _ in ranges], dtype=np.uint64)
    lengths = np.array([n for _, n in ranges], dtype=np.uint64)
    fd = os.open(path, os.O_RDONLY)
    try:
        for chunk in (0, 64 << 10):  # the default, and small chunks (the long range in 32 pieces)
            raw, stats = _native.checksum_ranges(fd, offsets, lengths, path=str(path), threads=3,
                                                 chunk_bytes=chunk, direct=direct)
            got = np.frombuffer(raw, dtype=np.uint32)
            want = [_native.crc32c(data[o:o + n]) if n else 0 for o, n in ranges]
            assert got.tolist() == want
            assert 2 << 20 <= stats["direct_bytes"] + stats["buffered_bytes"] <= 2 * len(data)  # bytes read once
    finally:
        os.close(fd)


def test_checksum_ranges_names_a_short_file_and_refuses_bad_arguments(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * 10_000)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(OSError) as short:
            _native.checksum_ranges(fd, np.array([9_000], dtype=np.uint64), np.array([2_000], dtype=np.uint64),
                                    path="named.h5")
        assert short.value.errno == errno.ENODATA and short.value.filename == "named.h5"
        with pytest.raises(ValueError, match="same length"):
            _native.checksum_ranges(fd, np.zeros(2, dtype=np.uint64), np.zeros(3, dtype=np.uint64))
        with pytest.raises(OSError) as wraps:
            _native.checksum_ranges(fd, np.array([2**64 - 10], dtype=np.uint64), np.array([20], dtype=np.uint64))
        assert wraps.value.errno == errno.EINVAL
        raw, _ = _native.checksum_ranges(fd, np.zeros(0, dtype=np.uint64), np.zeros(0, dtype=np.uint64))
        assert raw == b""
    finally:
        os.close(fd)


@pytest.mark.parametrize("direct", [0, 1, 2])
def test_checksum_ranges_gives_the_whole_file_crc_from_the_same_reads(tmp_path: Path, direct: int) -> None:
    """With whole_len, the crc32c of the file's first whole_len bytes comes with the ranges' own:
    ranges straddling blocks, longer than a block, overlapping, empty, and reaching past
    whole_len, and ranges apart as a checkpoint's tensors lie; every byte read once (no range
    is read again for the whole file)."""
    rng = random.Random(11)
    data = rng.randbytes((3 << 20) + 777)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    overlapping = [(rng.randrange(0, len(data) - 5000), rng.randrange(0, 5000)) for _ in range(2000)]
    overlapping += [(4096, 2 << 20), (100, 0), (len(data) - 7, 7), (0, 1), (65_530, 20), (200_100, 300)]
    rng.shuffle(overlapping)
    # As a checkpoint's tensors lie: apart, in any order, gaps (headers) between some of them.
    apart, at = [], rng.randrange(0, 100)
    while at < len(data):
        n = min(rng.choice([0, 1, 64, 5208, 70_000]), len(data) - at)
        apart.append((at, n))
        at += n + rng.choice([0, 0, 1, 63, 4096])
    rng.shuffle(apart)
    for ranges in (overlapping, apart):
        _whole_and_ranges(path, data, ranges, direct)


def _whole_and_ranges(path: Path, data: bytes, ranges: list[tuple[int, int]], direct: int) -> None:
    offsets = np.array([o for o, _ in ranges], dtype=np.uint64)
    lengths = np.array([n for _, n in ranges], dtype=np.uint64)
    fd = os.open(path, os.O_RDONLY)
    try:
        for whole_len in (len(data), len(data) - 3000, 1):
            for chunk in (0, 64 << 10):
                raw, stats = _native.checksum_ranges(fd, offsets, lengths, path=str(path), threads=3,
                                                     chunk_bytes=chunk, direct=direct, whole_len=whole_len)
                assert np.frombuffer(raw, dtype=np.uint32).tolist() == [
                    _native.crc32c(data[o:o + n]) if n else 0 for o, n in ranges]
                assert stats["whole_crc32c"] == _native.crc32c(data[:whole_len])
                if whole_len == len(data):
                    assert stats["direct_bytes"] + stats["buffered_bytes"] <= len(data) + (64 << 10)
        _, alone = _native.checksum_ranges(fd, np.zeros(0, dtype=np.uint64), np.zeros(0, dtype=np.uint64),
                                           whole_len=len(data), chunk_bytes=64 << 10, direct=direct)
        assert alone["whole_crc32c"] == _native.crc32c(data)
        _, none = _native.checksum_ranges(fd, np.zeros(0, dtype=np.uint64), np.zeros(0, dtype=np.uint64))
        assert "whole_crc32c" not in none
        with pytest.raises(OSError) as short:
            _native.checksum_ranges(fd, offsets[:3], lengths[:3], path="named.pt", whole_len=len(data) + 1,
                                    direct=direct)
        assert short.value.errno == errno.ENODATA and short.value.filename == "named.pt"
    finally:
        os.close(fd)


def test_checksum_ranges_reads_what_is_cached_through_the_cache_and_the_rest_direct(tmp_path: Path) -> None:
    """direct=2 (a verify after a prefetch): spans mostly in the page cache are read through
    it, the others with O_DIRECT; the crcs are the same either way."""
    data = random.Random(2).randbytes(8 << 20)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    offsets = np.arange(0, 8 << 20, 1 << 20, dtype=np.uint64)
    lengths = np.full(8, 1 << 20, dtype=np.uint64)
    fd = os.open(path, os.O_RDONLY)
    try:
        try:
            os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
        except OSError:
            pytest.skip("this file system refuses O_DIRECT")
        os.fsync(fd)
        # Another process may drop the page cache meanwhile (the bench tests do, as root):
        # only a call during which the cache held exactly the first half counts.
        for _attempt in range(5):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            if _native.file_resident(str(path), fd=fd)[0] != 0:
                continue
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead past what is read
            os.pread(fd, 4 << 20, 0)  # the first half cached, as a prefetch leaves it
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_NORMAL)
            if _native.file_resident(str(path), fd=fd)[0] != 4 << 20:
                continue
            raw, stats = _native.checksum_ranges(fd, offsets, lengths, path=str(path), chunk_bytes=1 << 20,
                                                 direct=2, whole_len=len(data))
            assert np.frombuffer(raw, dtype=np.uint32).tolist() == [
                _native.crc32c(data[o:o + (1 << 20)]) for o in range(0, 8 << 20, 1 << 20)]
            assert stats["whole_crc32c"] == _native.crc32c(data)
            if _native.file_resident(str(path), fd=fd)[0] != 4 << 20:
                continue  # evicted during the call: the split is not the one set up
            assert stats["buffered_bytes"] == 4 << 20 and stats["direct_bytes"] == 4 << 20
            return
        pytest.skip("the page cache of the test file kept changing (evicted by another process, or "
                    "kept after POSIX_FADV_DONTNEED)")
    finally:
        os.close(fd)


@pytest.mark.parametrize("direct", [False, True])
def test_batch_add_many_copies_from_addresses_and_writes_at_offsets(tmp_path: Path, direct: bool) -> None:
    """Many items in one call: some copied by the writers from source addresses into the staging
    buffer, some written from it as they are; every byte lands at its file offset, crcs in order."""
    rng = np.random.default_rng(3)
    sources = [rng.integers(0, 256, size=int(n), dtype=np.uint8) for n in rng.integers(1, 20_000, size=300)]
    sources.append(rng.integers(0, 256, size=(1 << 20) + 5, dtype=np.uint8))  # several writer chunks
    lengths = np.array([s.nbytes for s in sources], dtype=np.uint64)
    slot_offsets = np.concatenate([[0], np.cumsum(lengths[:-1] + 7)]).astype(np.uint64)  # gaps in the slot
    file_offsets = np.zeros(len(sources), dtype=np.uint64)  # another order in the file: last item first
    pos = 4096
    for i in reversed(range(len(sources))):
        file_offsets[i] = pos
        pos += int(lengths[i]) + 3
    staging = _native.aligned_buffer(int(slot_offsets[-1] + lengths[-1]))
    view = np.frombuffer(staging, dtype=np.uint8)
    half = len(sources) // 2
    for i in range(half, len(sources)):  # the second half is staged by the caller
        view[int(slot_offsets[i]):int(slot_offsets[i] + lengths[i])] = sources[i]
    addresses = np.array([s.ctypes.data for s in sources[:half]], dtype=np.uint64)
    path = tmp_path / "rank-0.h5"
    with _native.WriterPool(threads=3, chunk_bytes=256 << 10) as pool:
        batch = _native.Batch(pool, direct=direct)
        first = batch.add_many(str(path), staging, file_offsets[:half], slot_offsets[:half], lengths[:half],
                               addresses)
        second = batch.add_many(str(path), staging, file_offsets[half:], slot_offsets[half:], lengths[half:])
        assert (first, second) == (0, half)
        assert batch.add_many(str(path), staging, *(np.zeros(0, dtype=np.uint64),) * 3) == -1
        with pytest.raises(ValueError, match="outside"):
            batch.add_many(str(path), staging, np.array([0], dtype=np.uint64),
                           np.array([staging.nbytes - 4], dtype=np.uint64), np.array([8], dtype=np.uint64))
        with pytest.raises(ValueError, match="same length"):
            batch.add_many(str(path), staging, file_offsets[:2], slot_offsets[:3], lengths[:2])
        batch.start()
        assert batch.wait() is True
        raw = path.read_bytes()
        for i, s in enumerate(sources):
            assert raw[int(file_offsets[i]):int(file_offsets[i] + lengths[i])] == s.tobytes(), i
        crcs = np.frombuffer(batch.crcs(0, len(sources)), dtype=np.uint32).tolist()
        assert crcs == [_native.crc32c(s) for s in sources] == [batch.crc(i) for i in range(len(sources))]
        with pytest.raises(IndexError):
            batch.crcs(1, len(sources))
