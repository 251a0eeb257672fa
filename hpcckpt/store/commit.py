"""The commit protocol: the only way a checkpoint directory becomes visible.

1. write into ``<root>/<name>.tmp-<unique>/`` (same directory, never the system temp);
2. fsync every file; 3. write ``manifest.json`` and fsync it;
4. ``os.replace`` the directory to ``<root>/<name>``; 5. fsync ``<root>`` (after 6);
6. set ``<root>/LATEST`` (a hint: rewritten in place, or a new file renamed over it); one
   fsync of ``<root>`` covers both renames (5 and 6; so do retention's renames aside made
   before 4, ``publish.commit_and_prune``).

A directory without a manifest, or whose checksums fail, does not exist for load.
"""
from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import secrets
import shutil
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

from .._core import crc32c
from .._gc import collector_paused
from ..errors import CheckpointCorrupt
from ..fsio import TMP_MARK, fsync_path, write_all
from ..fsio import atomic_write as atomic_write  # the package's one durable write: the store's too
from .checksum import fd_crc32c
from .manifest import decode, encode, refuse_newer, safe_relpath
from .names import LATEST, MANIFEST, SPARE_PREFIX, TRASH_PREFIX

# A pruned step directory a live engine keeps to write its next save into (SPARE_PREFIX,
# ``engines/recycle``) is never listed, and swept once a crash left it this old.
STALE_SPARE_AGE_S = 600.0
# ~250 bytes a tensor: 64 MiB is some 250,000 tensors, far beyond any model's state; a
# larger "manifest" is refused before it is parsed (parsing is the cost of every listing).
MAX_MANIFEST_BYTES = 64 << 20
_READ_CHUNK = 16 << 20
# Parsed manifests, by path and the crc32c of their bytes: a restore, a listing and a
# prune look at the same manifest several times, and parsing and re-encoding a large one
# (13 MB at 65,536 tensors) costs seconds while reading and checksumming it costs
# milliseconds. Keyed by content, so a manifest changed in place is parsed afresh.
_PARSED: OrderedDict[tuple[str, int, int], dict[str, Any]] = OrderedDict()
_PARSED_SIZE: dict[tuple[str, int, int], int] = {}
_PARSED_MAX_BYTES = 64 << 20
_PARSED_LOCK = threading.Lock()


def _parsed(key: tuple[str, int, int]) -> dict[str, Any] | None:
    with _PARSED_LOCK:
        data = _PARSED.get(key)
        if data is not None:
            _PARSED.move_to_end(key)
        return data


def _remember(key: tuple[str, int, int], data: dict[str, Any]) -> None:
    with _PARSED_LOCK:
        _PARSED[key] = data
        _PARSED_SIZE[key] = key[1]
        while sum(_PARSED_SIZE.values()) > _PARSED_MAX_BYTES and len(_PARSED) > 1:
            old, _ = _PARSED.popitem(last=False)
            _PARSED_SIZE.pop(old, None)


def write_new_durable(path: Path, data: bytes) -> None:
    """Create ``path`` (it must not exist) holding ``data``, and fsync it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def rewrite_durable(path: Path, data: bytes) -> bool:
    """Overwrite the regular file ``path`` with ``data`` in place (same inode: its directory
    entry does not change) and fdatasync it; False when there is no such file (nothing is
    created). A symlink or anything but a regular file there is an OSError."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        write_all(fd, data)
        os.ftruncate(fd, len(data))
        os.fdatasync(fd)  # the data and the size: what reading it back needs
    finally:
        os.close(fd)
    return True


def replace_hint(path: Path, data: bytes) -> None:
    """Set the hint ``path`` (``LATEST``) to ``data``, without fsyncs of its own: a following
    fsync of the directory makes a new file's rename durable, and the hint's loss, emptiness
    or staleness after a crash costs nothing (readers never trust it alone).

    An existing regular file is rewritten in place (write, then truncate to the new length):
    a new file and a rename at every commit cost ~0.1 ms of CPU each here (ext4 allocates
    the new inode and frees the replaced one), against ~4 us in place, and a small state saved
    at every step pays that at every step. A reader racing the rewrite may see the old name or,
    between the write and the truncate, the new name followed by the rest of the old one, after
    a newline: ``read_latest`` then gives the new name (the rest is only newlines) or no name,
    never another step. Absent, or not a regular file (a symlink is not followed): a new file
    replaces it."""
    try:  # O_NONBLOCK: a FIFO there (ENXIO) must not block the commit
        fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno not in (errno.ENOENT, errno.ELOOP, errno.ENXIO):
            raise
        _new_hint(path, data)
        return
    try:
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
        if regular:
            written = os.pwrite(fd, data, 0)
            if written != len(data):
                raise OSError(errno.EIO, f"short write ({written} of {len(data)} bytes)", str(path))
            os.ftruncate(fd, len(data))
    finally:
        os.close(fd)
    if not regular:
        _new_hint(path, data)


def _new_hint(path: Path, data: bytes) -> None:
    """``replace_hint`` by a new file renamed over ``path``."""
    tmp = path.with_name(f"{path.name}{TMP_MARK}{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        write_all(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def file_crc32c(path: Path) -> tuple[int, int]:
    """(size, crc32c) of a whole file, read in large chunks."""
    crc = 0
    size = 0
    buf = bytearray(_READ_CHUNK)
    view = memoryview(buf)
    with open(open_regular(path), "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = crc32c(view[:n], crc)
            size += n
    return size, crc


def _relative_files(top: str, prefix: str = "") -> Iterator[tuple[str, str]]:
    """(path relative to ``top``, path) of every file below ``top``, as ``os.walk`` finds
    them (directories, symlinked ones included, are not files; those are not descended
    into), sorted by name in each directory, with strings and one scandir per directory:
    a commit describes its files with this at every save."""
    with os.scandir(top) as it:
        entries = list(it)
    subdirs = []
    for e in sorted(entries, key=lambda e: e.name):
        if e.is_dir():
            if not e.is_symlink():
                subdirs.append(e)
        else:
            yield prefix + e.name, e.path
    for d in subdirs:
        yield from _relative_files(d.path, f"{prefix}{d.name}/")


SEAL_KEY = "manifest_crc32c"
# The seal, the manifest's last member: the crc32c of every byte before it.
_SEAL = re.compile(rb',\n "manifest_crc32c": ([0-9]{1,10})\n}\n\Z')


def seal_manifest(manifest: dict[str, Any]) -> bytes:
    """Serialise a manifest with a self-checksum: its last member, ``manifest_crc32c``, is the
    crc32c of the bytes before it (the comma that introduces it excluded), so that a reader
    checks it on the bytes it read, without encoding the parsed manifest again (for a manifest
    of 65,536 tensors that re-encoding cost as much as parsing it). Manifests written before
    this seal carry the crc32c of their canonical JSON (sorted keys, no spaces) instead, which
    ``read_manifest`` still checks."""
    body = encode({k: v for k, v in manifest.items() if k != SEAL_KEY})
    if not body:
        raise ValueError("a manifest has members besides its seal")
    head = readable_json(body).encode()
    assert head.endswith(b"\n}\n")
    head = head[:-3]
    return head + f',\n "{SEAL_KEY}": {crc32c(head)}\n}}\n'.encode()


# One encoder, not one per value. Below the second level keys keep their order: a rank's metadata
# tree is the registered objects' state_dict()s, whose key order is part of what a restore gives
# back (an optimizer's per-parameter state lists step, exp_avg, exp_avg_sq as it made them; a
# torch.save of the restored state_dict() is the uninterrupted run's bytes only in that order).
_COMPACT = json.JSONEncoder(sort_keys=False, separators=(", ", ": "))


def readable_json(obj: dict[str, Any]) -> str:
    """JSON with one line per key for the first two levels (one line per rank, per file).

    ``json.dumps(indent=...)`` runs Python's pure encoder: for a manifest of a few hundred
    tensors that cost ~20 ms of GIL-holding CPU per save in the background thread, which
    training felt. This uses the C encoder for everything below the second level.
    """
    compact = _COMPACT.encode
    lines = []
    for key in sorted(obj):
        value = obj[key]
        if isinstance(value, dict) and value:
            inner = ",\n".join(f"  {json.dumps(k)}: {compact(value[k])}" for k in sorted(value))
            lines.append(f" {json.dumps(key)}: {{\n{inner}\n }}")
        else:
            lines.append(f" {json.dumps(key)}: {compact(value)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def read_manifest(ckpt_dir: Path) -> dict[str, Any]:
    """Parse and self-verify ``manifest.json``; raise CheckpointCorrupt naming the problem.

    The self-checksum proves the manifest was not damaged, not that its fields make
    sense: ``manifest.validate`` (run by ``catalog.check``) does that. The same bytes
    read again (same path, same crc32c) return the dict parsed the first time: callers
    must not change it.
    """
    path = ckpt_dir / MANIFEST
    try:
        fd = open_checked(path)
    except FileNotFoundError:
        raise CheckpointCorrupt(f"{path} is missing: the checkpoint was never committed") from None
    except OSError as exc:  # ELOOP: a symlink; EACCES...
        raise CheckpointCorrupt(f"{path} cannot be opened ({exc.strerror}); hpcckpt writes it as a plain "
                                "file") from None
    try:
        size = os.fstat(fd).st_size
        if size > MAX_MANIFEST_BYTES:
            raise CheckpointCorrupt(f"{path} is {size} bytes, more than any manifest ({MAX_MANIFEST_BYTES}); "
                                    "it is not an hpcckpt manifest")
        with os.fdopen(os.dup(fd), "rb") as f:
            raw = f.read(MAX_MANIFEST_BYTES + 1)
    finally:
        os.close(fd)
    key = (str(path), len(raw), crc32c(raw))
    cached = _parsed(key)
    if cached is not None:
        return cached
    try:
        with collector_paused():
            data = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # bad JSON, bad UTF-8, absurd nesting or numbers
        raise CheckpointCorrupt(f"{path} is not valid JSON ({str(exc)[:200]}); the manifest is damaged") from None
    if not isinstance(data, dict) or SEAL_KEY not in data:
        raise CheckpointCorrupt(f"{path} has no manifest_crc32c field; not an hpcckpt manifest")
    if not _sealed_ok(raw, data):
        raise CheckpointCorrupt(f"{path} fails its own checksum: the manifest is damaged")
    try:
        refuse_newer(data)
        with collector_paused():  # a packed table's shapes: a list per tensor, none in a cycle
            decode(data)
    except CheckpointCorrupt as exc:
        raise CheckpointCorrupt(f"{path}: {exc}") from None
    _remember(key, data)
    return data


def _sealed_ok(raw: bytes, data: dict[str, Any]) -> bool:
    """Whether the manifest's bytes ``raw`` (parsed: ``data``) match its seal (``seal_manifest``),
    or, written before that seal, the crc32c of its canonical JSON."""
    seal = _SEAL.search(raw, max(0, len(raw) - 64))
    if seal is not None:
        return crc32c(memoryview(raw)[:seal.start()]) == int(seal.group(1)) == data[SEAL_KEY]
    body = {k: v for k, v in data.items() if k != SEAL_KEY}
    try:
        canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    except (ValueError, RecursionError):
        return False
    return crc32c(canonical) == data[SEAL_KEY]


def open_regular(path: Path) -> int:
    """A read-only descriptor of ``path`` if it is a regular file (never follows a symlink,
    never blocks on a FIFO); OSError otherwise (ELOOP for a symlink, EINVAL for anything else)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", str(path))
    return fd


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def open_checked(path: Path, *, size: int | None = None, min_size: int = 0) -> int:
    """A read-only descriptor of the checkpoint file ``path``, opened once and checked open.

    The step directory is opened ``O_DIRECTORY|O_NOFOLLOW`` and the file ``openat``-ed
    relative to it with ``O_NOFOLLOW|O_NONBLOCK`` (a symlink is ELOOP, a FIFO never
    blocks); ``fstat`` of that descriptor must show a regular file owned by us or by the
    directory's owner, of exactly ``size`` bytes when given (the manifest's) and at least
    ``min_size``. Every reader then reads through this descriptor, never by name again, so
    nothing swapped in under the name after the check is read. CheckpointCorrupt when the
    open file fails a check; OSError (ENOENT, ELOOP, EACCES...) when it cannot be opened.
    """
    dfd = os.open(path.parent, _DIR_FLAGS)
    try:
        fd = os.open(path.name, _FILE_FLAGS, dir_fd=dfd)
        try:
            _check_open(fd, os.fstat(dfd), path, size, min_size)
        except BaseException:
            os.close(fd)
            raise
    finally:
        os.close(dfd)
    return fd


def _check_open(fd: int, dir_st: os.stat_result, path: Path, size: int | None, min_size: int) -> None:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointCorrupt(f"{path}: not a regular file (hpcckpt never writes special files into a "
                                "checkpoint)")
    if st.st_uid not in (os.geteuid(), dir_st.st_uid):
        raise CheckpointCorrupt(f"{path}: owned by uid {st.st_uid}, not by the checkpoint's owner "
                                f"(uid {dir_st.st_uid}); another user put it there")
    if size is not None and st.st_size != size:
        raise CheckpointCorrupt(f"{path}: size {st.st_size} bytes, manifest says {size} (truncated, extended "
                                "or replaced after the checkpoint was committed)")
    if st.st_size < min_size:
        raise CheckpointCorrupt(f"{path}: file is shorter than its manifest says ({st.st_size} bytes, its "
                                f"tensors need {min_size}); it was truncated after the checkpoint was committed")


def read_regular(path: Path, limit: int) -> bytes:
    """Up to ``limit`` bytes of a regular file (see ``open_regular``)."""
    with os.fdopen(open_regular(path), "rb") as f:
        return f.read(limit)


def open_member(ckpt_dir: Path, rel: str) -> tuple[Path, os.stat_result]:
    """(path, lstat) of a file a manifest names, refusing anything but a regular file.

    ``rel`` was checked to be a plain relative path (``manifest.safe_relpath``); here no
    component may be a symlink, so nothing outside the step directory is ever read.
    """
    path = ckpt_dir
    parts = rel.split("/")
    for i, part in enumerate(parts):
        path = path / part
        st = os.lstat(path)  # FileNotFoundError: missing
        want_dir = i < len(parts) - 1
        if stat.S_ISLNK(st.st_mode) or (stat.S_ISDIR(st.st_mode) != want_dir) or \
                (not want_dir and not stat.S_ISREG(st.st_mode)):
            raise CheckpointCorrupt(f"{path}: not a regular {'directory' if want_dir else 'file'} "
                                    "(hpcckpt never writes symlinks or special files into a checkpoint)")
    return path, st


def verify_files(ckpt_dir: Path, *, full: bool = True, manifest: dict[str, Any] | None = None,
                 crcs: dict[str, int] | None = None) -> list[str]:
    """Problems with the files a manifest lists (empty list = fine).

    ``full=False`` checks sizes only; ``full=True`` also re-reads every file and
    compares its crc32c. ``manifest``: already read (and checked) by the caller.
    ``crcs``: whole-file crc32cs the caller already computed (of exactly the bytes the
    manifest lists, by file name): those files are not read again.
    """
    if manifest is None:
        try:
            manifest = read_manifest(ckpt_dir)
        except CheckpointCorrupt as exc:
            return [str(exc)]
    files = manifest.get("files", {})
    if not isinstance(files, dict):
        return [f"{ckpt_dir / MANIFEST}: 'files' is not an object; the manifest is damaged"]
    problems: list[str] = []
    for rel, info in sorted(files.items()):
        problems += _verify_one(ckpt_dir, rel, info, full=full, known=(crcs or {}).get(rel))
    return problems


def _verify_one(ckpt_dir: Path, rel: str, info: Any, *, full: bool, known: int | None = None) -> list[str]:
    try:
        safe_relpath(rel, "manifest file")
        want = info["bytes"]
        path, st = open_member(ckpt_dir, rel)
    except FileNotFoundError:
        return [f"{ckpt_dir / rel}: missing"]
    except (CheckpointCorrupt, TypeError, KeyError) as exc:
        return [f"{ckpt_dir}: {exc}"]
    except OSError as exc:
        return [f"{ckpt_dir / rel}: cannot be read ({exc.strerror})"]
    if st.st_size != want:
        return [f"{path}: size {st.st_size} bytes, manifest says {want} (truncated or extended)"]
    if full and "crc32c" in info:
        crc = known
        if crc is None:
            try:
                fd = open_checked(path, size=want)  # what is read is what was checked: no re-open by name
                try:
                    crc = fd_crc32c(fd, want)
                finally:
                    os.close(fd)
            except CheckpointCorrupt as exc:
                return [str(exc)]
            except OSError as exc:
                return [f"{path}: cannot be read ({exc.strerror})"]
        if crc != info["crc32c"]:
            return [f"{path}: crc32c {crc:#010x}, manifest says {info['crc32c']!r} (file content damaged)"]
    return []


def read_latest(root: Path) -> str | None:
    """The entry name ``LATEST`` holds, or None (absent, empty, not UTF-8, or not a plain name)."""
    try:
        raw = read_regular(root / LATEST, 4096)
    except OSError:  # absent, or not a plain file
        return None
    try:
        name = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        return None
    if not name or name in (".", "..") or "/" in name or not name.isprintable():
        return None
    return name


def discard(root: Path, paths: list[Path], *, trash: list[Path] | None = None, durable: bool = True,
            tracked: list[Path] | None = None, leftovers: list[Path] | None = None) -> None:
    """Delete directories of ``root`` so that none is ever seen half-deleted.

    Each is first renamed aside to a hidden ``.trash-`` name that the catalog never
    lists (atomic), the renames are made durable, then the trees are deleted. A kill
    at any instant leaves either the whole directory or an invisible leftover, which
    the next ``discard`` (``sweep_trash``) removes. Call under the writer lock.
    ``trash``: the trees are appended there instead, for ``remove_trash`` (no lock needed:
    they are invisible and each is deleted whole or left for a later sweep).
    ``durable=False`` (with ``trash`` only): the caller fsyncs ``root`` itself before any
    tree in ``trash`` is deleted (a commit's one fsync of the root covers these renames).
    ``tracked``: trees the caller already holds renamed aside (waiting for that fsync, or to
    be deleted): never swept here as leftovers. ``leftovers``: what to sweep, when the caller
    has just listed ``root`` under the same lock (``catalog.prune``'s one listing) and named
    them (``sweep_candidates``' rule): the root is not listed again.
    """
    if not durable and trash is None:
        raise ValueError("discard(durable=False) needs a trash list: the trees are deleted only after the caller's fsync")
    aside: list[Path] = []
    for path in paths:
        target = root / f"{TRASH_PREFIX}{path.name}-{secrets.token_hex(4)}"  # ``trashed_name`` reads it back
        try:
            os.rename(path, target)
        except FileNotFoundError:
            continue  # already gone
        aside.append(target)
    if aside and durable:
        fsync_path(root)
    doomed = aside + (leftovers if leftovers is not None
                      else sweep_candidates(root, exclude=set(aside) | set(trash or ()) | set(tracked or ())))
    if trash is not None:
        trash += doomed
        return
    remove_trash(doomed)


def trashed_name(trash: str) -> str | None:
    """The name a tree had before ``discard`` renamed it aside to ``trash`` (None for another name)."""
    if not trash.startswith(TRASH_PREFIX):
        return None
    return trash[len(TRASH_PREFIX):].rsplit("-", 1)[0]


def older_than(path: Path, age_s: float) -> bool:
    """Whether ``path`` was last modified ``age_s`` seconds ago or more (False once it is gone)."""
    try:
        return time.time() - os.lstat(path).st_mtime >= age_s
    except FileNotFoundError:
        return False


def remove_trash(paths: list[Path]) -> None:
    """Delete trees ``discard`` renamed aside (another process may be deleting them too)."""
    for target in paths:
        _remove_tree(target)


def sweep_candidates(root: Path, *, exclude: set[Path]) -> list[Path]:
    """Leftovers of earlier discards that a kill interrupted, and spares (``SPARE_PREFIX``)
    no live engine has touched for ``STALE_SPARE_AGE_S``."""
    names = {p.name for p in exclude}
    try:
        with os.scandir(root) as it:
            return [root / e.name for e in it if e.name not in names and (
                e.name.startswith(TRASH_PREFIX)
                or (e.name.startswith(SPARE_PREFIX) and older_than(root / e.name, STALE_SPARE_AGE_S)))]
    except OSError:
        return []


def _remove_tree(path: Path) -> None:
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def explain_os_error(exc: OSError, root: Path, path: Path | str) -> OSError:
    """``exc`` with a message a user can act on (ENOSPC names the device's directory)."""
    if exc.errno == errno.ENOSPC:
        return OSError(errno.ENOSPC, f"No space left on device: no space left on the device holding {root}; "
                                     "free space there or give the job another checkpoint directory", str(path))
    if exc.errno == errno.EDQUOT:
        return OSError(errno.EDQUOT, f"Disk quota exceeded on the file system holding {root}; "
                                     "free space or raise the quota", str(path))
    return exc


def exchange_dirs(a: Path, b: Path) -> None:
    """Atomically swap two directory entries (renameat2 RENAME_EXCHANGE)."""
    libc = ctypes.CDLL(None, use_errno=True)
    at_fdcwd, rename_exchange = -100, 2
    rc = libc.renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange)
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"renameat2(RENAME_EXCHANGE) failed: {os.strerror(err)}", str(b))


class Transaction:
    """A checkpoint directory being written; visible only after ``commit``.

    ``checksum_files`` names the files (relative) whose whole-file crc32c goes
    into the manifest; by default every file. Formats that carry their own
    per-tensor checksums (HDF5) list only sizes for speed.
    """

    def __init__(self, root: Path, name: str, *, unique: str | None = None, temp: Path | None = None,
                 recycled: bool = False) -> None:
        """``temp``: adopt a directory made by ``temp_dir`` (ranks of one save write into it first).
        ``recycled``: ``temp`` is a committed checkpoint's directory reused whole (the concurrent
        engine's ``recycle``), its entries durable since that commit and none added since: the
        commit rewrites its manifest in place and does not fsync the directory."""
        self.root = Path(root)
        self.name = name
        if temp is not None:  # made inside the root, so the root exists
            if Path(temp).parent != self.root or not Path(temp).name.startswith(f"{name}{TMP_MARK}"):
                raise ValueError(f"{temp} is not a temporary directory of {self.root / name}")
            self.path = Path(temp)
        else:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            self.path = self.temp_path(self.root, name, unique or secrets.token_hex(6))
            self.path.mkdir(mode=0o700, exist_ok=unique is not None)
        self.final = self.root / name
        self.recycled = recycled and temp is not None
        self.committed = False
        self.warnings: list[str] = []  # faults after the rename (``_after_rename``)

    @staticmethod
    def temp_path(root: Path, name: str, unique: str) -> Path:
        """Where a save of ``name`` is written before its commit: beside it, never in a system temp dir."""
        return Path(root) / f"{name}{TMP_MARK}{unique}"

    @staticmethod
    def temp_dir(root: Path, name: str, unique: str) -> Path:
        """``temp_path``, created (every rank of a save may call it; the coordinator's commit adopts it)."""
        path = Transaction.temp_path(root, name, unique)
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        return path

    def __enter__(self) -> Transaction:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        if not self.committed:
            self.abort()

    def abort(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def describe_files(self, *, checksum: bool | set[str] = True) -> dict[str, dict[str, int]]:
        files: dict[str, dict[str, int]] = {}
        for rel, path in _relative_files(str(self.path)):
            if rel == MANIFEST:
                continue
            if checksum is True or (isinstance(checksum, set) and rel in checksum):
                size, crc = file_crc32c(Path(path))
                files[rel] = {"bytes": size, "crc32c": crc}
            else:
                files[rel] = {"bytes": os.stat(path).st_size}
        return files

    def commit(self, manifest: dict[str, Any], *, checksum: bool | set[str] = True,
               fsync_files: bool = True, update_latest: bool = True, fsync_root: bool = True) -> Path:
        """Make the checkpoint durable and visible. Coordinator only.

        ``fsync_files=False`` when the writers have already fsynced their files.
        ``fsync_root=False``: the rename is visible but not yet durable; the caller makes
        it durable with ``make_durable`` (after renames of its own in the root, which the
        same fsync covers) before it reports the checkpoint saved.
        """
        manifest = dict(manifest)
        files = self.describe_files(checksum=checksum)
        manifest["files"] = {**files, **manifest.get("files", {})}
        if fsync_files:
            for rel in files:  # the files just described: the tree is not walked again
                fsync_path(self.path / rel)
            for dirpath, _dirs, _files in os.walk(self.path):
                fsync_path(Path(dirpath))
        sealed = seal_manifest(manifest)
        if not (self.recycled and rewrite_durable(self.path / MANIFEST, sealed)):
            write_new_durable(self.path / MANIFEST, sealed)
            fsync_path(self.path)  # the new entries: the manifest's (and the files', unless fsync_files did)
        replaced = False
        try:
            os.replace(self.path, self.final)  # no stat first: the common case is one rename
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
                raise
            # The same step committed before (a restart re-reached it): swap atomically so
            # that a crash at any instant leaves one complete step directory in place.
            exchange_dirs(self.path, self.final)
            replaced = True
        self.committed = True
        if update_latest:  # a hint: its rename is made durable by the one fsync of the root below
            self._after_rename("update LATEST", replace_hint, self.root / LATEST, (self.name + "\n").encode())
        if fsync_root:
            self.make_durable()
        if replaced:
            self._after_rename("remove the replaced copy", discard, self.root, [self.path])
        return self.final

    def make_durable(self) -> None:
        """fsync the root: the commit's rename (and LATEST's, and any other rename made in the
        root since) survives a crash. A fault is a warning (``_after_rename``)."""
        self._after_rename("make the rename durable (fsync of the checkpoint root)", fsync_path, self.root)

    def _after_rename(self, what: str, fn: Any, *args: Any) -> None:
        """A step after the rename: the checkpoint is committed (visible, and what the next
        resume loads) whatever happens here, so a failure is a warning, never a failed save."""
        try:
            fn(*args)
        except OSError as exc:
            self.warnings.append(f"step {self.name} is committed, but could not {what}: {exc}")
