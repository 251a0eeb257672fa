"""Small file-descriptor helpers shared by every layer (it imports nothing of hpcckpt)."""
from __future__ import annotations

import os
import stat


def write_all(fd: int, data: bytes | memoryview) -> None:
    """Write every byte of ``data`` to ``fd`` (``os.write`` may write fewer than asked)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def owned_private(st: os.stat_result) -> bool:
    """The rule for a directory hpcckpt keeps its own files in (``JobEnv.staging_dir``'s, the
    node-local level's): ``st`` (an ``lstat``, never a symlink's target) is a real directory of
    this process's user with no group or other permission bits."""
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077


def safe_parent(st: os.stat_result) -> bool:
    """The rule for the directory holding such a private one: a real directory (``lstat``) of
    root or of this process's user that other users may not write in, unless it is sticky
    (then nobody else may rename or remove what it holds)."""
    return (stat.S_ISDIR(st.st_mode) and st.st_uid in (0, os.geteuid())
            and (not st.st_mode & 0o022 or bool(st.st_mode & stat.S_ISVTX)))
