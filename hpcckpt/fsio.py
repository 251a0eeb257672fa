"""Small file-descriptor helpers shared by every layer (it imports nothing of hpcckpt)."""
from __future__ import annotations

import os


def write_all(fd: int, data: bytes | memoryview) -> None:
    """Write every byte of ``data`` to ``fd`` (``os.write`` may write fewer than asked)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
