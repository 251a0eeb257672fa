"""ENOSPC from a real, full file system (a 4 MiB tmpfs) through a Batch."""

from __future__ import annotations

import errno
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from hpcckpt import _native

pytestmark = [pytest.mark.native, pytest.mark.fault]


def test_enospc_raised_once_with_path_and_pool_stays_usable(small_tmpfs: Callable[[str], Path], tmp_path: Path) -> None:
    full_fs = small_tmpfs("4m")
    data = np.random.default_rng(0).integers(0, 256, size=10 << 20, dtype=np.uint8)
    full = full_fs / "shard-0.bin"
    with _native.WriterPool(threads=2, chunk_bytes=1 << 20) as pool:
        batch = _native.Batch(pool, direct=True)  # tmpfs refuses O_DIRECT: page cache path
        batch.add(str(full), 0, data)
        batch.start()
        with pytest.raises(OSError) as info:
            batch.wait()
        assert info.value.errno == errno.ENOSPC
        assert info.value.filename == str(full)
        assert str(full) in str(info.value)
        assert batch.wait() is True  # raised exactly once
        assert batch.bytes_written < batch.bytes_total

        roomy = tmp_path / "roomy.bin"
        later = _native.Batch(pool)
        item = later.add(str(roomy), 0, data)
        later.start()
        assert later.wait()
        assert roomy.read_bytes() == data.tobytes()
        assert later.crc(item) == _native.crc32c(data)
