"""Reading the checkpoint root: list, verify, pick the newest good one, prune."""
from __future__ import annotations

import os
import re
import stat
import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CheckpointCorrupt, NoCheckpoint
from . import rankfile
from .checksum import FileCrc
from .commit import (
    LATEST,
    MANIFEST,
    SPARE_PREFIX,
    STALE_SPARE_AGE_S,
    TRASH_PREFIX,
    discard,
    older_than,
    open_member,
    read_latest,
    read_manifest,
    verify_files,
)
from .entry import TensorEntry
from .lock import reader_lock
from .manifest import NEWER, validate, validate_meta
from .names import step_name
from .prefetch import Prefetch
from .tensortable import TensorTable

# Exactly the names ``step_name`` writes: ASCII digits, no leading zero, nothing after
# (``\Z``, not ``$``, which also matches before a trailing newline). Any other name
# (``step-0099``, ``step-99\n``, other scripts' digits) is not a checkpoint and is ignored.
STEP_RE = re.compile(r"\Astep-(0|[1-9][0-9]*)\Z")
STEP_TMP_RE = re.compile(r"\Astep-(0|[1-9][0-9]*)\.tmp-")
STALE_TMP_AGE_S = 600.0
SCAN_ATTEMPTS = 50


@dataclass
class CheckpointInfo:
    step: int
    status: str  # committed | incomplete | corrupt
    path: Path
    bytes: int
    problems: list[str] = field(default_factory=list)
    manifest: dict[str, Any] | None = None
    ident: tuple[int, int] | None = None  # (st_dev, st_ino) when scanned: see ``vanished``

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"step": self.step, "status": self.status, "path": str(self.path), "bytes": self.bytes}
        if self.problems:
            d["problems"] = self.problems
        if self.manifest:
            d["engine"] = self.manifest.get("engine")
            d["world_size"] = self.manifest.get("world_size")
            d["created"] = self.manifest.get("created")
        return d


def _dir_bytes(path: Path) -> int:
    """Bytes of the regular files under ``path`` (symlinks not followed; vanishing files skipped)."""
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                total += st.st_size
    return total


def identity(path: Path) -> tuple[int, int] | None:
    """(device, inode) of the entry itself, or None when it is gone."""
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return st.st_dev, st.st_ino


def vanished(info: CheckpointInfo) -> bool:
    """True when ``info.path`` was removed or replaced since it was scanned.

    Retention renames a directory aside before deleting it (``commit.discard``) and a
    re-commit of a step swaps directories atomically, so a reader that fails on a
    checkpoint can tell "damaged" from "gone while I read it": only the latter changes
    the entry's identity. A vanished checkpoint is never evidence of corruption.
    """
    return info.ident is None or identity(info.path) != info.ident


def rank_entries(manifest: dict[str, Any], rank: int) -> tuple[str, dict[str, TensorEntry]]:
    rec = manifest["ranks"][str(rank)]
    tensors = rec.get("tensors", {})
    if isinstance(tensors, TensorTable):
        return rec["file"], tensors.entries()
    return rec["file"], {n: TensorEntry.from_json(n, e) for n, e in tensors.items()}


def _dir_step(path: Path) -> int | None:
    m = STEP_RE.match(path.name)
    return int(m.group(1)) if m else None


# Manifests already validated for a step (``read_manifest`` hands back the same dict for
# the same bytes); the dict is held here, so its id is never reused while it is listed.
_VALIDATED: OrderedDict[tuple[int, int | None], dict[str, Any]] = OrderedDict()
_VALIDATED_LOCK = threading.Lock()


def _validated(manifest: dict[str, Any], step: int | None) -> bool:
    key = (id(manifest), step)
    with _VALIDATED_LOCK:
        if _VALIDATED.get(key) is manifest:
            _VALIDATED.move_to_end(key)
            return True
    return False


def _remember_valid(manifest: dict[str, Any], step: int | None) -> None:
    with _VALIDATED_LOCK:
        _VALIDATED[(id(manifest), step)] = manifest
        while len(_VALIDATED) > 256:
            _VALIDATED.popitem(last=False)


def _validate_once(manifest: dict[str, Any], step: int | None) -> None:
    if not _validated(manifest, step):
        validate(manifest, step=step)
        _remember_valid(manifest, step)


def _validated_while_verifying(path: Path, manifest: dict[str, Any], step: int | None,
                               warm: Prefetch | None) -> list[str]:
    """``validate`` and a full ``verify_against`` at once: once everything that says which
    bytes to read is checked (``validate(meta=False)``), the checksums run on a thread of
    their own (native reads, the GIL released) while this one checks the metadata trees
    (``validate_meta``, Python over every tensor reference). CheckpointCorrupt from the
    validation, after the checksums are done; their problems otherwise. ``warm``: the
    prefetch, stopped as the checksums start (they read the rest themselves, O_DIRECT)."""
    if _validated(manifest, step):
        if warm is not None:
            warm.stop()
        return verify_against(path, manifest, full=True)
    validate(manifest, step=step, meta=False)
    if warm is not None:
        warm.stop()
    for rec in manifest["ranks"].values():
        if isinstance(rec.get("tensors"), TensorTable):
            # The ranges the checksums read, built here: on the checksum thread they would wait
            # for the interpreter while validate_meta holds it, and start that much later.
            rec["tensors"].arrays()
    found: list[list[str] | BaseException] = []

    def checksums() -> None:
        try:
            found.append(verify_against(path, manifest, full=True))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            found.append(exc)
    worker = threading.Thread(target=checksums, name="hpcckpt-verify", daemon=True)
    worker.start()
    try:
        validate_meta(manifest)
    finally:
        worker.join()
    _remember_valid(manifest, step)
    if isinstance(found[0], BaseException):
        raise found[0]
    return found[0]


def check(path: Path, *, full: bool) -> tuple[dict[str, Any] | None, list[str]]:
    """(manifest, problems) for one step directory; the manifest only if it can be trusted.

    Cheap mode checks the manifest's own checksum, every field of it
    (``manifest.validate``: before anything reads a byte or sizes memory from it) and
    the files' sizes; full mode also re-reads every byte (whole-file and per-tensor crc32c).
    """
    # Full: the disk reads the files while the manifest is checked, and goes on while the
    # checksums start on what is already cached (``prefetch``).
    with Prefetch(path) if full else nullcontext() as warm:
        try:
            manifest = read_manifest(path)
            if full:
                return manifest, _validated_while_verifying(path, manifest, _dir_step(path), warm)
            _validate_once(manifest, _dir_step(path))
        except CheckpointCorrupt as exc:
            if warm is not None:
                warm.wait(stop=True)  # nothing more of it will be read
            text = str(exc)
            return None, [text if str(path) in text else f"{path / MANIFEST}: {text}"]
        return manifest, verify_against(path, manifest, full=False)


def verify_against(path: Path, manifest: dict[str, Any], *, full: bool) -> list[str]:
    """Problems of the files in ``path`` against ``manifest`` (already read and validated), as
    ``check`` finds them: sizes; with ``full``, every byte (whole-file and per-tensor crc32c).
    For a directory whose manifest is not (yet) inside it: the scavenge's staging directory."""
    if not full:
        return verify_files(path, full=False, manifest=manifest)
    # Each rank file's tensors first, its whole-file crc32c from the same reads; then the
    # files (those crcs not read again), reported first as before.
    crcs: dict[str, int] = {}
    tensors: list[str] = []
    for rank in range(int(manifest["world_size"])):
        tensors += verify_rank(path, manifest, rank, crcs=crcs)
    return verify_files(path, full=True, manifest=manifest, crcs=crcs) + tensors


def verify_rank(path: Path, manifest: dict[str, Any], rank: int, *, crcs: dict[str, int] | None = None) -> list[str]:
    """Every damaged tensor of one rank's file (a missing or resized file is reported by
    verify_files). ``crcs``: the file's whole crc32c is added to it (by name) when the
    reader computed it in the same pass."""
    rec = manifest["ranks"][str(rank)]
    try:
        _, st = open_member(path, rec["file"])
        info = manifest["files"][rec["file"]]
        if st.st_size != info["bytes"]:
            return []
        whole = FileCrc(info["bytes"]) if crcs is not None and "crc32c" in info else None
        problems = rankfile.verify(path / rec["file"], rec, whole=whole)
        if crcs is not None and whole is not None and whole.crc is not None:
            crcs[rec["file"]] = whole.crc
        return problems
    except CheckpointCorrupt:
        return []  # a symlink or special file: verify_files reported it
    except OSError as exc:
        return [f"{path / rec['file']}: cannot be read ({exc.strerror or exc})"]


def _inspect(p: Path, step: int, *, full: bool) -> CheckpointInfo | None:
    """One step directory's status, or None when it vanished while being looked at."""
    for _attempt in range(3):
        ident = identity(p)
        if ident is None:
            return None
        if p.is_symlink():
            return CheckpointInfo(step, "corrupt", p, 0, [f"{p} is a symlink; hpcckpt never creates one, "
                                                          "so it is not trusted as a checkpoint"], ident=ident)
        if not p.is_dir():
            return None
        manifest, problems = check(p, full=full)
        nbytes = _dir_bytes(p)
        if identity(p) != ident:
            continue  # removed or re-committed while being checked: look again
        if manifest is None and not (p / MANIFEST).exists():
            status = "incomplete"
        else:
            status = "corrupt" if problems else "committed"
        return CheckpointInfo(step, status, p, nbytes, problems, manifest, ident=ident)
    return None


def inspect_step(root: Path, step: int, *, full: bool = False) -> CheckpointInfo | None:
    """``root/step-<step>`` as ``scan`` would report it (None when it is not there)."""
    return _inspect(root / step_name(step), step, full=full)


def _root_mtime(root: Path) -> int | None:
    try:
        return os.stat(root).st_mtime_ns
    except OSError:
        return None


def _scan_once(root: Path, full: bool) -> tuple[list[CheckpointInfo], bool]:
    """(infos, stable): stable when no listed entry vanished while it was looked at."""
    out: list[CheckpointInfo] = []
    stable = True
    try:
        entries = sorted(root.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return out, True
    for p in entries:
        info: CheckpointInfo | None = None
        if m := STEP_RE.match(p.name):
            info = _inspect(p, int(m.group(1)), full=full)
        elif m := STEP_TMP_RE.match(p.name):
            ident = identity(p)
            if ident is not None and not p.is_symlink():
                info = CheckpointInfo(int(m.group(1)), "incomplete", p, _dir_bytes(p),
                                      [f"{p}: temporary directory of a save that never committed"], ident=ident)
        else:
            continue
        if info is None:
            stable = False
        else:
            out.append(info)
    out.sort(key=lambda c: (c.step, c.status != "committed"))
    return out, stable


def scan(root: Path, *, full: bool = False) -> list[CheckpointInfo]:
    """Every step directory under ``root`` (committed, incomplete or corrupt), oldest first.

    An entry that disappears while it is looked at is left out, never reported as
    incomplete or corrupt; and since a directory listing taken while entries are
    renamed may miss both the old and the new name, the listing is taken again until
    nothing vanished and the directory did not change meanwhile. Readers that are not
    the writer should call ``snapshot`` (the same, under the commit lock when they can).
    """
    infos: list[CheckpointInfo] = []
    for _attempt in range(SCAN_ATTEMPTS):
        before = _root_mtime(root)
        infos, stable = _scan_once(root, full)
        if stable and _root_mtime(root) == before:
            break
    return infos


def snapshot(root: Path) -> list[CheckpointInfo]:
    """``scan`` (cheap mode) holding a shared lock on the commit lock file when one exists.

    No commit or retention runs while the listing is taken, so it always holds the
    newest committed checkpoint of that moment. The lock is held for the listing only
    (milliseconds), never while bytes are read.
    """
    with reader_lock(root):
        return scan(root)


def committed_newest_first(root: Path) -> Iterator[CheckpointInfo]:
    """Committed (cheaply verified) checkpoints, newest step first."""
    for info in reversed(scan(root)):
        if info.status == "committed":
            yield info


def find(root: Path, step: int | None) -> CheckpointInfo:
    infos = [i for i in snapshot(root) if i.status != "incomplete" or step is not None]
    if step is None:
        committed = [i for i in infos if i.status == "committed"]
        if not committed:
            raise NoCheckpoint(f"no committed checkpoint under {root}" + (
                f" ({len(infos)} corrupt)" if infos else ""))
        return committed[-1]
    for i in infos:
        if i.step == step and STEP_RE.match(i.path.name):
            return i
    have = ", ".join(str(i.step) for i in infos) or "none"
    raise NoCheckpoint(f"no checkpoint for step {step} under {root} (steps present: {have})")


def _stale_tmp(path: Path) -> bool:
    return older_than(path, STALE_TMP_AGE_S)


# Step directories this process found committed (or committed itself), by (root, name),
# with the inode the entry had then: retention counts them as committed from a directory
# listing, without reading their manifests again (retention trusts nothing it restores).
# Plain strings, not Paths: a prune looks up every kept name (thousands with a large keep).
# By root, then by name (a prune looks names up in its root's dict, one lookup a checkpoint).
_KNOWN_COMMITTED: dict[str, dict[str, int]] = {}
_KNOWN_LOCK = threading.Lock()
_KNOWN_MAX_ROOTS, _KNOWN_MAX_NAMES = 64, 65536


def _known(root: str) -> dict[str, int]:
    """This root's known committed names -> inode (empty when none is known); read without
    the lock (a dict lookup is atomic), changed only under it."""
    return _KNOWN_COMMITTED.get(root) or {}


def _learn(root: str, name: str, inode: int | None) -> None:
    if inode is None:
        return
    with _KNOWN_LOCK:
        names = _KNOWN_COMMITTED.get(root)
        if names is None:
            while len(_KNOWN_COMMITTED) >= _KNOWN_MAX_ROOTS:
                del _KNOWN_COMMITTED[next(iter(_KNOWN_COMMITTED))]
            names = _KNOWN_COMMITTED[root] = {}
        names[name] = inode
        while len(names) > _KNOWN_MAX_NAMES:
            del names[next(iter(names))]


class Entry:
    """A ``step-<S>`` (or a save's ``step-<S>.tmp-*``) directory entry, from a listing alone."""

    __slots__ = ("step", "root", "name", "inode", "tmp")

    def __init__(self, step: int, root: Path, name: str, inode: int, tmp: bool) -> None:
        self.step, self.root, self.name, self.inode, self.tmp = step, root, name, inode, tmp

    @property
    def path(self) -> Path:
        return self.root / self.name


def entries(root: Path) -> list[Entry]:
    """Step and temporary directories under ``root``, newest step first, from one listing
    (names and inodes only: nothing is opened)."""
    return [Entry(step, root, name, inode, not final) for step, final, name, inode in _listing(root)]


def _listing(root: Path) -> list[tuple[int, bool, str, int]]:
    """``entries`` as tuples ``(step, is the step directory, name, inode)``, newest first."""
    found: list[tuple[int, bool, str, int]] = []  # (step, committed name, name, inode): sorted as tuples
    tmp_re = STEP_TMP_RE.match
    try:
        with os.scandir(root) as it:
            for e in it:
                name = e.name
                if not name.startswith("step-"):
                    continue
                digits = name[5:]
                if digits.isascii() and digits.isdigit() and (digits[0] != "0" or digits == "0"):
                    # STEP_RE without the regex: a root keeping thousands of checkpoints lists
                    # them at every resume and prune (2,000: 1.9 ms a listing with the match, 1.6 without)
                    found.append((int(digits), True, name, e.inode()))
                elif m := tmp_re(name):
                    found.append((int(m.group(1)), False, name, e.inode()))
    except (FileNotFoundError, NotADirectoryError):
        return []
    found.sort(reverse=True)  # newest step first; its step directory before its temporary ones
    return found


def _committed(entry: Entry, known: dict[str, int]) -> tuple[bool, str | None]:
    """(committed, status) of one step directory: known from earlier, or checked cheaply now."""
    if known.get(entry.name) == entry.inode:
        return True, "committed"
    info = _inspect(entry.path, entry.step, full=False)
    if info is None:
        return False, None  # vanished
    return info.status == "committed", info.status


def newest_committed(root: Path) -> tuple[list[CheckpointInfo], Iterator[Entry]]:
    """(inspected, older): step directories checked newest first up to and including the
    newest committed one, and the older step directories, not yet opened (made into
    ``Entry`` objects as they are taken: a resume takes a few of thousands).

    A resume needs the newest checkpoint every rank can read: there is no reason to read
    hundreds of retained manifests to find it. Taken under the commit lock's shared side,
    like ``snapshot``.
    """
    with reader_lock(root):
        listing = [t for t in _listing(root) if t[1]]
        inspected: list[CheckpointInfo] = []
        for i, (step, _final, name, _inode) in enumerate(listing):
            info = _inspect(root / name, step, full=False)
            if info is None:
                continue  # vanished meanwhile
            inspected.append(info)
            if info.status == "committed":
                return inspected, (Entry(s, root, n, ino, False) for s, _f, n, ino in listing[i + 1:])
        return inspected, iter(())


def written_by_newer(inspected: list[CheckpointInfo]) -> CheckpointInfo | None:
    """The first of ``newest_committed``'s inspected step directories whose manifest a newer
    hpcckpt wrote (``manifest.NewerFormat``): newer than every committed one, so a resume
    that passed over it would rewind."""
    return next((i for i in inspected if i.status != "committed" and i.problems and NEWER in i.problems[0]), None)


def _quick_victims(root: Path, keep: int, protected: set[str], key: str, latest: str | None,
                   held: frozenset[str] | set[str] = frozenset(), stale: list[Path] | None = None
                   ) -> list[Path] | None:
    """What ``prune`` removes, from one listing, when it shows only step directories just
    committed (``protected``) or known committed by this process with the same inode (and
    saves in flight); None when anything else is there (a leftover of a discard, a stale
    temporary directory, a step directory not known committed): then the full pass decides.
    ``held``: names of trees the caller holds renamed aside (``prune``'s ``trash`` and
    ``tracked``): not leftovers, so they do not send it to the full pass, which would list the
    root again to name the same victims (with ``keep=1`` and a save at every step, the
    previous commit's pruned step is always still there, waiting for this commit's fsync).
    ``stale``: gets the spares (``SPARE_PREFIX``) no engine has touched for
    ``STALE_SPARE_AGE_S`` that the listing shows (``commit.sweep_candidates``' rule), for
    ``discard`` to sweep without listing the root again. The common case: a name and a dict
    lookup per checkpoint, no object, no second listing; the same victims as the full pass
    (every listed step is committed, newest kept first)."""
    known = _known(key)
    committed: list[tuple[int, str]] = []
    step_re = STEP_RE.match
    try:
        with os.scandir(root) as it:
            for e in it:
                name = e.name
                ino = known.get(name)
                if ino is not None and ino == e.inode():
                    committed.append((int(name[5:]), name))  # the common case: one lookup
                    continue
                if name.startswith(TRASH_PREFIX):
                    if name in held:
                        continue  # the caller's, deleted by it once durable
                    return None  # a leftover to sweep
                if not name.startswith("step-"):
                    if (stale is not None and name.startswith(SPARE_PREFIX)
                            and older_than(root / name, STALE_SPARE_AGE_S)):
                        stale.append(root / name)
                    continue
                if not step_re(name):
                    if STEP_TMP_RE.match(name) and _stale_tmp(root / name):
                        return None
                    continue  # a save in flight, or not a name the catalog lists
                if name not in protected:
                    return None  # not known committed: the full pass looks at it
                committed.append((int(name[5:]), name))
                _learn(key, name, e.inode())
    except OSError:
        return None
    return _past_keep(root, committed, keep, protected, latest)


def _past_keep(root: Path, committed: list[tuple[int, str]], keep: int, protected: set[str],
               latest: str | None) -> list[Path]:
    """The committed steps (step, name) past the newest ``keep`` (the protected ones always
    kept and counted), never the one ``latest`` names (read only when there are victims)."""
    if len(committed) <= keep:
        return []
    committed.sort(reverse=True)
    victims: list[Path] = []
    count = 0
    for _step, name in committed:
        if name in protected or count < keep:
            count += 1
            continue
        if latest is None:
            latest = read_latest(root) or ""
        if name != latest:
            victims.append(root / name)
    return victims


def prune(root: Path, keep: int, *, protect: set[Path] | None = None, trash: list[Path] | None = None,
          durable: bool = True, tracked: list[Path] | None = None, latest: str | None = None) -> list[Path]:
    """Delete old checkpoints beyond the newest ``keep`` committed ones; call under the writer lock.

    The newest checkpoint that verifies (manifest checksum and file sizes; the
    bytes were checksummed as they were written) is never deleted, nor are corrupt
    ones newer than it (evidence for a human); stale temporary directories go too.
    ``protect``: what the caller has just committed (counted as committed, never deleted).
    Deletion renames aside first (``commit.discard``): a kill mid-way never leaves a
    half-deleted directory under a checkpoint's name. ``trash``: the renamed-aside trees
    are appended there for the caller to delete later (``commit.remove_trash``, e.g. once
    the save that pruned them has been reported durable) instead of being deleted here.
    ``durable=False`` (with ``trash``): the renames aside are not fsynced here; the caller
    fsyncs the root before anything in ``trash`` is deleted. ``tracked``: trees the caller
    already holds renamed aside, never swept as leftovers (``commit.discard``). ``latest``:
    what ``LATEST`` holds, when the caller has just set it under the same lock (else it is read).

    The cost does not grow with how many are kept: the directory is listed once, step
    directories this process already knows to be committed (same inode) are not opened
    again, and those older than the ``keep``-th newest committed go without being read.
    """
    protect = protect or set()
    protected = {p.name for p in protect if p.parent == root}
    key = str(root)
    held = {p.name for p in (*(trash or ()), *(tracked or ())) if p.parent == root}
    stale: list[Path] = []
    quick = _quick_victims(root, keep, protected, key, latest, held, stale)
    if quick is not None:
        if quick or stale:  # the sweep's leftovers from the same listing: no second one
            discard(root, quick, trash=trash, durable=durable, tracked=tracked, leftovers=stale)
        return quick
    victims = _victims(root, keep, protected, key, read_latest(root) if latest is None else latest)
    discard(root, victims, trash=trash, durable=durable, tracked=tracked)
    return victims


def _victims(root: Path, keep: int, protected: set[str], key: str, latest: str | None) -> list[Path]:
    """What ``prune`` deletes, from one listing of ``root``, newest step first: stale temporary
    directories, and every step beyond the ``keep`` newest committed ones except ``latest``
    and the corrupt ones newer than every good one."""
    known = _known(key)
    victims: list[Path] = []
    committed = 0
    seen_good = False
    for e in entries(root):
        if e.tmp:
            if e.name not in protected and _stale_tmp(e.path):
                victims.append(e.path)  # a fresh one may belong to a save still in flight
            continue
        if e.name in protected:
            _learn(key, e.name, e.inode)
            committed += 1
            seen_good = True
            continue
        if committed >= keep:  # older than every checkpoint kept: goes, whatever it holds
            if e.name != latest:
                victims.append(e.path)
            continue
        ok, status = _committed(e, known)
        if status is None:
            continue
        if ok:
            if known.get(e.name) != e.inode:
                _learn(key, e.name, e.inode)
            committed += 1
            seen_good = True
            continue
        if e.name == latest or (status == "corrupt" and not seen_good):
            continue  # corrupt and newer than every good one: evidence for a human
        victims.append(e.path)
    return victims


def learn_committed(path: Path) -> None:
    """``path``, a step directory this process has just committed, is known committed: the
    next prune lists it without opening it (as it does for what ``prune(protect=...)`` saw)."""
    try:
        inode = os.stat(path).st_ino
    except OSError:
        return
    _learn(str(path.parent), path.name, inode)


__all__ = ["CheckpointInfo", "Entry", "entries", "newest_committed", "scan", "check", "verify_against", "verify_rank",
           "find", "prune", "committed_newest_first",
           "rank_entries", "step_name", "vanished", "identity", "inspect_step", "snapshot", "LATEST"]
