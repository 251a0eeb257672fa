"""Scavenge: commit to the shared level a node-local checkpoint it lacks (issue 25, item 3).

A job killed without grace may hold, on its nodes' node-local levels, a newer checkpoint than
its shared checkpoint directory (drained every ``every_steps`` only). After the job, the
epilog (slurm/epilog) runs ``hpcckpt scavenge <node-local root>`` on every node, as the job's
user, and this module does the rest:

1. read the pointer ``<root>/.hpcckpt-level.json`` ({"shared": dir, "python": ...}, written by
   the job: ``levels._point``); the root's name must be the shared directory's key;
2. take the node's newest node-local step N; if the shared level already holds a committed
   step >= N, nothing is done;
3. contribute the files of step N this node holds whole (size per the manifest; each copy
   read back with its source's crc32c, and that crc32c, or each tensor's, checked against the
   manifest) into ``<shared>/step-N.tmp-scavenge-<manifest crc32c>/``. Every node of the job
   holds the same manifest, so every node adds its files to the same directory; a copy is
   written under a private name first and moved in without ever replacing a name;
4. when that directory holds every file the manifest lists and nothing else, verify every
   byte (whole-file and per-tensor crc32c, as a restore reads them), and commit it under the
   writer lock with the node-local manifest: there the shared level is checked again (a node
   that finds the step committed by another does nothing), and a live job holding the
   directory's writer lease is left alone. No retention runs: a scavenge removes no
   checkpoint.

Anything odd (no pointer, a damaged manifest or file, a symlink or stray file in the
staging directory) gives a one-line message and commits nothing; nothing is ever overwritten
or deleted but the scavenge's own temporary files (and its staging directory once the shared
level holds the step another way).
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import json
import os
import secrets
import shutil
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CheckpointCorrupt, HpcckptError
from . import catalog
from .commit import TMP_MARK, Transaction, discard, fsync_path, open_checked, read_manifest
from .copy import copy_verified
from .lock import LEASE_NAME, Holder, writer_lock
from .manifest import safe_relpath, validate
from .names import POINTER
from .publish import commit_and_prune

MAX_POINTER_BYTES = 64 << 10
STAGING_TAG = "scavenge"
LOCK_TIMEOUT_S = 120.0

COMMITTED = "committed"  # this call committed the step to the shared level
CURRENT = "current"  # the shared level already holds the node-local step or a newer one
EMPTY = "empty"  # no node-local checkpoint to scavenge
PARTIAL = "partial"  # this node's files are in; other nodes' scavenge adds theirs and commits
FAILED = "failed"  # refused or damaged: nothing committed (the message says why)
OK_STATUSES = (COMMITTED, CURRENT, EMPTY, PARTIAL)


@dataclass
class Result:
    status: str
    message: str
    local: Path
    shared: Path | None = None
    step: int | None = None
    path: Path | None = None  # the committed step directory (COMMITTED)
    contributed: list[str] = field(default_factory=list)  # files this call added to the staging directory
    missing: list[str] = field(default_factory=list)  # files the staging directory still lacks
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status in OK_STATUSES

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "status": self.status, "message": self.message, "local": str(self.local),
                "shared": None if self.shared is None else str(self.shared), "step": self.step,
                "path": None if self.path is None else str(self.path), "contributed": self.contributed,
                "missing": self.missing, "problems": self.problems, "warnings": self.warnings}


class _Stop(Exception):
    """Ends the scavenge with ``result`` (raised from helpers, and from under the writer lock)."""

    def __init__(self, result: Result) -> None:
        super().__init__(result.message)
        self.result = result


def level_key(shared: Path | str) -> str:
    """The name of a checkpoint directory's node-local root: a hash of its absolute path."""
    return hashlib.sha1(str(Path(shared).absolute()).encode()).hexdigest()[:16]


def staging_dir(shared: Path, step: int, manifest: dict[str, Any]) -> Path:
    """Where every node of a job gathers its files of ``step`` (the same name on every node:
    it is named by the manifest, which every node holds the same)."""
    return Transaction.temp_path(shared, catalog.step_name(step),
                                 f"{STAGING_TAG}-{int(manifest['manifest_crc32c']) & 0xFFFFFFFF:08x}")


def scavenge(local: Path | str, *, lock_timeout_s: float = LOCK_TIMEOUT_S) -> Result:
    """Contribute this node's files of its newest node-local step to the shared level, and
    commit the step there once every node's files are in and verify. Never raises for a
    problem of the directories: the result says what happened (``ok``, ``message``)."""
    root = Path(os.path.abspath(local))
    try:
        return _scavenge(root, lock_timeout_s)
    except _Stop as stop:
        return stop.result
    except (HpcckptError, OSError) as exc:  # filelock.Timeout is an OSError too
        return Result(FAILED, f"nothing committed: {_reason(exc)}", root)


def read_pointer(local: Path) -> Path:
    """The shared directory that the node-local root ``local`` belongs to (its pointer file)."""
    def refuse(why: str) -> _Stop:
        return _Stop(Result(FAILED, f"{local}: {why}; nothing scavenged", local))

    try:
        st = os.lstat(local)
    except OSError as exc:
        raise refuse(f"cannot be read ({exc.strerror})") from None
    if stat.S_ISLNK(st.st_mode):
        raise refuse("is a symbolic link; pass the node-local root itself")
    if not stat.S_ISDIR(st.st_mode):
        raise refuse("is not a directory")
    path = local / POINTER
    try:
        fd = open_checked(path, min_size=0)
    except FileNotFoundError:
        raise refuse(f"no {POINTER} in it: not the node-local root of a checkpoint directory (a job with "
                     "local_every_steps writes it)") from None
    except (OSError, CheckpointCorrupt) as exc:
        raise refuse(f"{POINTER} cannot be used ({_reason(exc)})") from None
    try:
        raw = os.pread(fd, MAX_POINTER_BYTES + 1, 0)
    finally:
        os.close(fd)
    if len(raw) > MAX_POINTER_BYTES:
        raise refuse(f"{POINTER} is larger than any pointer hpcckpt writes")
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        raise refuse(f"{POINTER} is not valid JSON (damaged)") from None
    shared = doc.get("shared") if isinstance(doc, dict) else None
    if not isinstance(shared, str) or not shared.startswith("/") or "\0" in shared:
        raise refuse(f"{POINTER} names no absolute shared directory")
    if level_key(shared) != local.name:
        raise refuse(f"{POINTER} names {shared}, whose node-local root is named {level_key(shared)}, not "
                     f"{local.name} (a pointer copied from elsewhere)")
    return Path(shared)


def _scavenge(local: Path, lock_timeout_s: float) -> Result:
    shared = read_pointer(local)

    def result(status: str, message: str, **kw: Any) -> Result:
        return Result(status, message, local, shared, **kw)

    if not shared.is_dir():
        raise _Stop(result(FAILED, f"the shared checkpoint directory {shared} is not there (or not a directory); "
                                   "nothing scavenged"))
    listing = [e for e in catalog.entries(local) if not e.tmp]
    if not listing:
        return result(EMPTY, f"{local} holds no node-local checkpoint; nothing to scavenge")
    step, name = listing[0].step, listing[0].name
    have = _shared_newest(shared)
    if have is not None and have >= step:
        return result(CURRENT, f"the shared level {shared} already holds step {have} (node-local: step {step}); "
                               "nothing to do", step=step)
    src = local / name
    manifest = _source_manifest(src, step, result)
    files: dict[str, Any] = manifest["files"]
    _refuse_uncommitted(shared, name, result, step)
    staging = staging_dir(shared, step, manifest)
    contributed, problems = _contribute(src, staging, shared, name, manifest, result, step)
    missing, stray = _inventory(staging, files)
    if stray:
        raise _Stop(result(FAILED, f"{staging} holds what hpcckpt never writes there ({stray[0]}"
                                   f"{f' and {len(stray) - 1} more' if len(stray) > 1 else ''}); nothing committed: "
                                   "remove that directory and run the scavenge again", step=step,
                           contributed=contributed, problems=stray + problems))
    if missing:
        return _incomplete(shared, staging, step, result, contributed, missing, problems, lock_timeout_s)
    ident = catalog.identity(staging)
    bad = catalog.verify_against(staging, manifest, full=True)
    if bad and catalog.identity(staging) != ident:  # renamed away while read: another node's commit?
        now = _shared_newest(shared)
        if now is not None and now >= step:
            return _committed_meanwhile(result, shared, step, contributed=contributed, problems=problems)
    if bad:
        raise _Stop(result(FAILED, f"step {step} gathered in {staging} fails verification ({bad[0]}"
                                   f"{f'; {len(bad) - 1} more' if len(bad) > 1 else ''}); nothing committed",
                           step=step, contributed=contributed, problems=bad))
    precheck = _precheck(shared, staging, name, files, step, ident, result, contributed)
    path, warnings, _removed = commit_and_prune(Transaction(shared, name, temp=staging), manifest, keep=None,
                                                lock_timeout_s=lock_timeout_s, precheck=precheck)
    own = f"; this node's own copy of {problems[0]} (another node's copy was used)" if problems else ""
    return result(COMMITTED, f"committed node-local step {step} to the shared level: {path} (the shared level "
                             f"held step {have if have is not None else 'none'}){own}", step=step, path=path,
                  contributed=contributed, problems=problems, warnings=warnings)


def _source_manifest(src: Path, step: int, result: Any) -> dict[str, Any]:
    """The node-local step's manifest, read and checked; a damaged one stops the scavenge."""
    try:
        manifest = read_manifest(src)
        validate(manifest, step=step)
    except CheckpointCorrupt as exc:
        raise _Stop(result(FAILED, f"node-local step {step} ({src}) has a damaged manifest ({_reason(exc)}); "
                                   "nothing scavenged", step=step)) from None
    return manifest


def _precheck(shared: Path, staging: Path, name: str, files: dict[str, Any], step: int, ident: Any, result: Any,
              contributed: list[str]) -> Callable[[], None]:
    """What the commit checks again under the writer lock, so that the decision and the commit
    are one step: the gathered step is still ours, whole, and still newer than the shared level's,
    and no live job writes there."""

    def precheck() -> None:
        if catalog.identity(staging) != ident:  # committed (renamed away) by another node's scavenge
            now = _shared_newest(shared)
            if now is not None and now >= step:
                raise _Stop(_committed_meanwhile(result, shared, step, contributed=contributed))
            raise _Stop(result(FAILED, f"{staging} changed while it was verified; nothing committed", step=step,
                               contributed=contributed))
        now = _shared_newest(shared)
        if now is not None and now >= step:
            discard(shared, [staging])
            raise _Stop(result(CURRENT, f"the shared level {shared} holds step {now} meanwhile; nothing to do",
                               step=step, contributed=contributed))
        _refuse_uncommitted(shared, name, result, step)
        holder = _live_writer(shared)
        if holder is not None:
            raise _Stop(result(FAILED, f"a live job holds the writer lease of {shared} ({holder}); step {step} "
                                       f"is left gathered in {staging}, not committed", step=step,
                               contributed=contributed))
        again, stray_now = _inventory(staging, files)
        if again or stray_now:
            raise _Stop(result(FAILED, f"{staging} changed while it was verified; nothing committed", step=step,
                               contributed=contributed))

    return precheck


def _incomplete(shared: Path, staging: Path, step: int, result: Any, contributed: list[str], missing: list[str],
                problems: list[str], lock_timeout_s: float) -> Result:
    """The staging directory lacks files: another node's scavenge may add them, unless the shared
    level got the step meanwhile (another node committed it): then ours is a leftover."""
    now = _shared_newest(shared)
    if now is not None and now >= step:
        with writer_lock(shared, timeout_s=lock_timeout_s):
            if catalog.identity(staging) is not None:
                discard(shared, [staging])
        return _committed_meanwhile(result, shared, step, contributed=contributed, problems=problems)
    held = f"added {len(contributed)} file(s)" if contributed else "added no file"
    if problems:
        return result(FAILED, f"step {step}: this node {held} to {staging}; its copy of {problems[0]}"
                              f"{f' (and {len(problems) - 1} more)' if len(problems) > 1 else ''}; nothing committed "
                              f"({len(missing)} file(s) still missing there: another node's copy may complete it)",
                      step=step, contributed=contributed, missing=missing, problems=problems)
    return result(PARTIAL, f"step {step}: this node {held} to {staging}; {len(missing)} file(s) still missing "
                           f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): the scavenge of "
                           "the nodes that hold them commits the step", step=step, contributed=contributed,
                  missing=missing)


def _contribute(src: Path, staging: Path, shared: Path, name: str, manifest: dict[str, Any], result: Any,
                step: int) -> tuple[list[str], list[str]]:
    """Copy this node's whole, intact files of ``src`` into ``staging``: (added, problems).
    ``staging`` is made when the first file goes in (a node with nothing to add leaves none)."""
    files: dict[str, Any] = manifest["files"]
    part = Transaction.temp_path(shared, name, f"{staging.name.split(TMP_MARK, 1)[1]}.part-{secrets.token_hex(4)}")
    added: list[str] = []
    problems: list[str] = []
    try:
        part.mkdir(mode=0o700)
        for rel in sorted(files):
            safe_relpath(rel, "manifest file")  # validate() checked it; a copy never leaves the directory
            dst = staging / rel
            if os.path.lexists(dst) or not _holds(src, rel):
                continue
            try:
                tmp = _under(part, rel)
                _size, crc = copy_verified(src / rel, tmp, size=int(files[rel]["bytes"]))
                want = files[rel].get("crc32c")
                bad = ([f"{src / rel}: crc32c {crc:#010x}, manifest says {want:#010x} (file content damaged)"]
                       if want is not None and crc != want else
                       [] if want is not None else  # the copy checked, the source named
                       [t.replace(str(part), str(src)) for t in _tensor_problems(part, manifest, rel)])
                if bad:
                    problems += bad
                    continue
                if not added:
                    _make_dir(staging, result, step)
                if _move_new(tmp, _under(staging, rel)):
                    added.append(rel)
            except FileNotFoundError as exc:
                if catalog.identity(staging) is None:
                    break  # the staging directory went (another node committed it): see _incomplete
                problems.append(f"{exc.filename or src / rel}: vanished while copied")
            except (OSError, CheckpointCorrupt) as exc:
                text = _reason(exc)
                problems.append(text if str(src / rel) in text else f"{src / rel}: {text}")
        if added:
            fsync_path(staging)
    finally:
        shutil.rmtree(part, ignore_errors=True)
    return added, problems


def _holds(src: Path, rel: str) -> bool:
    """Whether this node has a file named ``rel`` in its step directory (whole or not: a damaged
    one is a problem to report, one that is absent belongs to another node)."""
    try:
        os.lstat(src / rel)
        return True
    except OSError:
        return False


def _tensor_problems(part: Path, manifest: dict[str, Any], rel: str) -> list[str]:
    """Per-tensor check of a copied file whose manifest lists no whole-file crc32c (HDF5)."""
    out: list[str] = []
    for rank in range(int(manifest["world_size"])):
        if manifest["ranks"][str(rank)]["file"] == rel:
            out += catalog.verify_rank(part, manifest, rank)
    return out


def _under(base: Path, rel: str) -> Path:
    """``base/rel`` with the directories between made (never through a symlink)."""
    path = base
    for part in rel.split("/")[:-1]:
        path = path / part
        try:
            path.mkdir(mode=0o700)
        except FileExistsError:
            pass
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode):
            raise OSError(errno.ENOTDIR, "not a directory (hpcckpt never writes a symlink there)", str(path))
    return base / rel


def _make_dir(staging: Path, result: Any, step: int) -> None:
    """The staging directory, made if missing: a real directory of ours, never a symlink."""
    try:
        staging.mkdir(mode=0o700)
    except FileExistsError:
        pass
    st = os.lstat(staging)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        what = "a symbolic link" if stat.S_ISLNK(st.st_mode) else (
            "not a directory" if not stat.S_ISDIR(st.st_mode) else f"owned by uid {st.st_uid}")
        raise _Stop(result(FAILED, f"{staging} is {what}, not a directory this scavenge made; nothing committed: "
                                   "remove it and run the scavenge again", step=step))


def _move_new(src: Path, dst: Path) -> bool:
    """Move ``src`` to ``dst`` unless ``dst`` exists (then False: another node put it there).
    Never replaces a name: renameat2(RENAME_NOREPLACE), or where the file system lacks it, a
    hard link (which fails on an existing name) and an unlink."""
    try:
        _rename_noreplace(src, dst)
        return True
    except FileExistsError:
        return False
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
            raise
    try:
        os.link(src, dst, follow_symlinks=False)
    except FileExistsError:
        return False
    os.unlink(src)
    return True


def _rename_noreplace(src: Path, dst: Path) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available")
    at_fdcwd, rename_noreplace = -100, 1
    if fn(at_fdcwd, os.fsencode(src), at_fdcwd, os.fsencode(dst), rename_noreplace) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(dst))


def _inventory(staging: Path, files: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(missing, stray): the listed files the staging directory lacks, and whatever in it is not
    a listed file of the listed size (a symlink, a FIFO, a stray or resized file)."""
    dirs = {"/".join(rel.split("/")[:i]) for rel in files for i in range(1, rel.count("/") + 1)}
    try:
        top = os.lstat(staging)
    except FileNotFoundError:
        return sorted(files), []
    if stat.S_ISLNK(top.st_mode) or not stat.S_ISDIR(top.st_mode) or top.st_uid != os.geteuid():
        what = ("a symbolic link" if stat.S_ISLNK(top.st_mode) else "not a directory"
                if not stat.S_ISDIR(top.st_mode) else f"owned by uid {top.st_uid}")
        return sorted(files), [f"{staging}: {what}"]
    stray: list[str] = []
    present: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(staging):
        base = Path(dirpath)
        for entry in sorted(dirnames + filenames):
            path = base / entry
            rel = str(path.relative_to(staging))
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue
            if stat.S_ISLNK(st.st_mode):
                stray.append(f"{path}: a symbolic link")
            elif stat.S_ISDIR(st.st_mode):
                if rel not in dirs:
                    stray.append(f"{path}: a directory the manifest does not list")
            elif not stat.S_ISREG(st.st_mode):
                stray.append(f"{path}: not a regular file")
            elif rel not in files:
                stray.append(f"{path}: a file the manifest does not list")
            elif st.st_size != int(files[rel]["bytes"]):
                stray.append(f"{path}: {st.st_size} bytes, the manifest says {files[rel]['bytes']}")
            elif st.st_uid != os.geteuid():
                stray.append(f"{path}: owned by uid {st.st_uid}")
            else:
                present.add(rel)
        dirnames[:] = [d for d in dirnames if not os.path.islink(base / d)]
    return sorted(set(files) - present), stray


def _shared_newest(shared: Path) -> int | None:
    """The shared level's newest committed step (manifest and sizes checked), or None.
    Takes no lock (it runs under the writer lock too); a step that vanishes is skipped."""
    for entry in catalog.entries(shared):
        if entry.tmp:
            continue
        info = catalog.inspect_step(shared, entry.step)
        if info is not None and info.status == "committed":
            return entry.step
    return None


def _committed_meanwhile(result: Any, shared: Path, step: int, **kw: Any) -> Result:
    """The outcome when another node's scavenge committed ``step`` while this one worked on it."""
    return result(CURRENT, f"step {step} was committed to {shared} meanwhile (another node's scavenge); "
                           "nothing to do", step=step, **kw)


def _refuse_uncommitted(shared: Path, name: str, result: Any, step: int) -> None:
    """A ``step-N`` at the shared level that is not a committed checkpoint is evidence for a
    human (``catalog.prune`` keeps it too): the scavenge never replaces it."""
    path = shared / name
    if os.path.lexists(path):
        info = catalog.inspect_step(shared, step)
        if info is not None and info.status == "committed":  # another node's scavenge, just now
            raise _Stop(_committed_meanwhile(result, shared, step))
        why = "; ".join(info.problems[:1]) if info is not None and info.problems else "it is not a committed checkpoint"
        raise _Stop(result(FAILED, f"{path} exists but does not verify ({why}); the scavenge never replaces it: "
                                   "look at it, remove it, and run the scavenge again", step=step))


def _live_writer(shared: Path) -> str | None:
    """Who holds the writer lease of ``shared`` (a live job), or None. Called under the writer
    lock, which a job takes before its lease: none can take it between this check and the commit."""
    try:
        fd = os.open(shared / LEASE_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None  # no lease file (or not one we can read): no job of ours holds it
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return None  # a file system without flock: no lease to respect
            holder = Holder.parse(os.pread(fd, 4096, 0))
            return holder.describe() if holder is not None else "a process that did not record itself"
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError) and not isinstance(exc, HpcckptError) and exc.strerror:
        where = f" ({exc.filename})" if exc.filename else ""
        return f"{exc.strerror}{where}"
    return str(exc) or type(exc).__name__


__all__ = ["POINTER", "Result", "level_key", "read_pointer", "scavenge", "staging_dir"]
