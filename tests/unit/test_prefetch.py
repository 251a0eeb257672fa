"""The page-cache prefetch of a full check (``store/prefetch.py``): it reads what it should,
skips what it should not touch, and never changes what a check finds."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from hpcckpt._core import native
from hpcckpt.bench.limits import evict
from hpcckpt.store import prefetch
from hpcckpt.store.prefetch import Prefetch


def _evict(path: Path) -> int:
    """Drop ``path``'s clean pages; returns how many bytes stay resident."""
    evict(path)
    return _resident(path)


def _resident(path: Path) -> int:
    return native().file_resident(str(path))[0]


def test_reads_the_directory_files_into_the_page_cache(tmp_path: Path) -> None:
    data = tmp_path / "rank-0.h5"
    data.write_bytes(os.urandom(3 << 20) + b"x" * 12345)
    other = tmp_path / "rank-1.h5"
    other.write_bytes(os.urandom(1 << 20))
    if _evict(data) == data.stat().st_size or _evict(other) == other.stat().st_size:
        pytest.skip("this file system keeps evicted pages resident (no fadvise DONTNEED)")
    with Prefetch(tmp_path, block=1 << 20) as warm:
        assert len(warm.files) == 2
    assert _resident(data) == data.stat().st_size
    assert _resident(other) == other.stat().st_size


def test_skips_the_manifest_symlinks_and_special_files(tmp_path: Path) -> None:
    (tmp_path / "manifest.json").write_text("{}")
    (tmp_path / "rank-0.h5").write_bytes(b"a" * 4096)
    (tmp_path / "empty").write_bytes(b"")
    os.symlink(tmp_path / "rank-0.h5", tmp_path / "link.h5")
    os.mkfifo(tmp_path / "fifo")  # would block a reader that opened it
    (tmp_path / "sub").mkdir()
    with Prefetch(tmp_path) as warm:
        sizes = sorted(size for _, size in warm.files)
    assert sizes == [4096]
    assert warm.files == []  # closed on leaving


def test_nothing_is_read_when_the_files_would_not_fit_in_memory(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "rank-0.h5").write_bytes(b"a" * (1 << 20))
    monkeypatch.setattr(prefetch, "mem_available", lambda: 1 << 20)  # half of it is less than the file
    with Prefetch(tmp_path) as warm:
        assert warm.files == [] and warm._workers == []
    monkeypatch.setattr(prefetch, "mem_available", lambda: None)  # unknown: do not guess
    with Prefetch(tmp_path) as warm:
        assert warm.files == []


def test_a_vanished_directory_is_not_an_error(tmp_path: Path) -> None:
    with Prefetch(tmp_path / "gone") as warm:
        assert warm.files == []


def test_stop_ends_the_reads_early(tmp_path: Path) -> None:
    (tmp_path / "rank-0.h5").write_bytes(b"a" * (4 << 20))
    warm = Prefetch(tmp_path, block=4096).__enter__()
    warm.wait(stop=True)
    assert warm.files == [] and warm._workers == []


def test_each_thread_starts_with_a_long_piece_then_the_files_go_in_short_ones(tmp_path: Path) -> None:
    """The first piece of each thread is ``first_block`` long (a thread waits for the
    interpreter between two pieces, and the manifest's parse holds it), the rest ``block``;
    together they cover every file exactly once, in file order."""
    (tmp_path / "rank-0.h5").write_bytes(b"a" * 10_000)
    (tmp_path / "rank-1.h5").write_bytes(b"b" * 2_500)
    warm = Prefetch(tmp_path, threads=2, block=1_000, first_block=4_000)
    warm._open()
    try:
        pieces = warm._cut()
        sizes = dict(warm.files)
        assert [n for _fd, _off, n in pieces[:2]] == [4_000, 4_000]
        assert all(n <= 1_000 for _fd, _off, n in pieces[2:])
        for fd, size in sizes.items():
            mine = [(off, n) for f, off, n in pieces if f == fd]
            assert [off for off, _n in mine] == sorted(off for off, _n in mine)
            assert sum(n for _off, n in mine) == size
            assert all(a[0] + a[1] == b[0] for a, b in zip(mine, mine[1:]))
    finally:
        warm._close_files()
