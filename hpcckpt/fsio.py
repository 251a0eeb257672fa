"""Small file helpers shared by every layer (it imports nothing of hpcckpt), the package's one
durable write (``atomic_write``, ``replacing``) among them."""
from __future__ import annotations

import contextlib
import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path

TMP_MARK = ".tmp-"  # in the name of a file or directory being written: never read as the real one


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


def fsync_path(path: Path) -> None:
    """fsync a file or directory by path (O_RDONLY opens either: no stat to tell them apart)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _beside(path: Path) -> Path:
    return path.with_name(f"{path.name}{TMP_MARK}{secrets.token_hex(4)}")


def _publish(tmp: Path, path: Path, durable: bool, strict: bool) -> None:
    os.replace(tmp, path)
    if durable:
        try:
            fsync_path(path.parent)  # the rename
        except OSError:
            if strict:
                raise


def atomic_write(path: Path, data: bytes | str, *, mode: int = 0o600, durable: bool = True,
                 strict: bool = True) -> None:
    """Replace ``path`` with ``data`` (text is written as UTF-8) atomically: a reader sees the
    old file or the new one, never a part. The one durable write of the package: a new file
    beside ``path`` (``O_EXCL``, ``mode`` less the umask), its data fsynced, renamed over
    ``path``, the directory fsynced; removed again when any of it fails. ``durable=False``: no
    fsync (a file whose loss in a crash costs nothing). ``strict=False``: the directory's fsync
    is best effort (a directory this process may write in but not open, a file system that
    refuses it): the file is in place, only the rename's durability is unconfirmed."""
    tmp = _beside(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        try:
            write_all(fd, data.encode() if isinstance(data, str) else data)
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        _publish(tmp, path, durable, strict)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def replacing(path: Path, *, mode: int = 0o600, durable: bool = True, strict: bool = True) -> Iterator[Path]:
    """``atomic_write`` for a writer that takes a path (``torch.save``, safetensors): yields a
    new empty file beside ``path`` to write; when the block ends, the file is fsynced, renamed
    over ``path`` and the directory fsynced (``durable``, ``strict`` as there); when it raises,
    the file is removed."""
    tmp = _beside(path)
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode))
    try:
        yield tmp
        if durable:
            fsync_path(tmp)
        _publish(tmp, path, durable, strict)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
