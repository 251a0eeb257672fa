"""Multi-level checkpoints: node-local storage (and a partner node's copy) often, the shared
directory less often, restart inside the allocation from the fastest level that holds the
newest complete step.

Each level holds checkpoints in the store's one format (``step-N/`` with a manifest), so every
reader, verifier and tool works on any of them:

- **node-local**: ``<local>/<key>/`` on each node (``Levels.local``; the prolog-made staging
  directory of the job, ``$HPCCKPT_LOCAL_DIR`` or ``/dev/shm``), written by the engine itself.
  Its step directories carry the full manifest but only the rank files of the node's own ranks
  and, with ``partner``, those of the ranks whose partner it is (``Topology.partner``).
- **shared**: the checkpoint directory (``Levels.shared``), drained from the node-local copy
  (never from the device again) every ``every_steps`` and at every stop, committed only after
  each copied file reads back with the checksum of its source (``levels.save.drain``).
- At the end of an allocation the epilog's ``hpcckpt scavenge`` commits a node-local step the
  shared level lacks (``store.scavenge``).

A guest on a shared node (DESIGN.md, "A guest, not an owner"):

- **Private roots.** A node-local root and the directory holding it are used only when they
  are this user's, with the rule of ``JobEnv.staging_dir`` (``fsio.owned_private``,
  ``fsio.safe_parent``): made 0700 when missing and checked again (``lstat``) once made;
  anything else (another user's directory, a group- or world-writable one, a symlink) is a
  ConfigError naming the path and the fix. The pointer file is written relative to the
  checked root's descriptor, ``O_CREAT|O_EXCL|O_NOFOLLOW``: nothing is written through a link.
- **Run lineage.** The shared directory holds a random id (``.hpcckpt-lineage``, made the first
  time levels use it) that every node-local step carries in its manifest (``job.lineage``).
  A node-local step of another lineage (the checkpoint directory was deleted and made anew,
  or the step was not written by this run's lineage at all) is never restored and is removed
  when the levels start: deleting the checkpoint directory starts afresh.
- **Degrade, never fail together.** A node-local save that fails on any node (ENOSPC, EROFS,
  EACCES...) makes the levels *degraded* on every rank, with one warning: that checkpoint goes
  to the shared level from the files the ranks wrote when it can, and every later one (the
  final save of a stop above all) is written straight to the shared level
  (``Levels.write_root``). A node-local step that fails its read is completed from its partner
  copy (``restore.prepare(verify=step)``) before an older level is tried.

``save.commit`` is the engines' commit when levels are on; ``restore.prepare`` picks the step
all ranks restore from and completes each node's copy of it from the others.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import re
import secrets
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import CheckpointOptions
from ..errors import CheckpointCorrupt, ConfigError
from ..fsio import owned_private, safe_parent, write_all
from ..ranks import Ranks
from ..store import catalog
from ..store.commit import atomic_write, discard, fsync_path, read_manifest, read_regular, write_new_durable
from ..store.names import (
    LINEAGE,  # in the shared directory: the run lineage its node-local copies must carry
    POINTER,  # in each node-local root: read by the scavenge
)
from ..store.scavenge import level_key
from .topology import Topology

__all__ = ["Levels", "Topology", "POINTER", "LINEAGE", "local_root", "shared_lineage", "step_lineage"]

log = logging.getLogger("hpcckpt.levels")

_LINEAGE_RE = re.compile(r"[0-9a-f]{32}")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# A node-local level that fails with these is given up for the shared level (``Levels.degraded``),
# not refused: the storage is full, read-only or failing, not misconfigured.
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EFBIG})
SHM = Path("/dev/shm")  # the default node-local base: SHM/hpcckpt-<uid>
FIX = "name a node-local directory of your own: local_dir=... or HPCCKPT_LOCAL_DIR=/local/$USER/hpcckpt"


@dataclass
class Levels:
    shared: Path  # the checkpoint directory (shared file system)
    local: Path  # this node's node-local root for it
    topo: Topology
    shared_every: int | None  # the shared level every this many steps (None: only at stops)
    keep: int  # shared level retention
    local_keep: int
    partner: bool
    lineage: str = ""  # the shared directory's run lineage (``shared_lineage``), carried by every node-local step
    # Why the node-local level was given up (the same on every rank, set at a collective): then
    # every checkpoint is written straight to the shared level (``write_root``).
    degraded: str | None = None

    def shared_due(self, step: int, final: bool) -> bool:
        """Whether the checkpoint of ``step`` also goes to the shared level."""
        return final or (self.shared_every is not None and step % self.shared_every == 0)

    @property
    def with_partner(self) -> bool:
        return self.partner and len(self.topo.nodes) > 1

    @property
    def write_root(self) -> Path:
        """Where the engines write a save: this node's node-local root, or the shared level once
        the node-local level failed (``degraded``)."""
        return self.shared if self.degraded is not None else self.local

    def degrade(self, why: str) -> bool:
        """Give up the node-local level (every rank alike, at a collective); True the first time."""
        if self.degraded is not None:
            return False
        self.degraded = why
        return True

    @staticmethod
    def make(options: CheckpointOptions, ranks: Ranks, node: str, staging: Path | None) -> Levels:
        """The levels of this job (collective: the ranks learn each other's nodes, the shared
        directory's lineage, and whether every node's root is usable)."""
        assert options.local_every_steps is not None
        topo = Topology.gather(ranks, node)
        found: dict[str, Any] = {}
        if ranks.is_coordinator:
            try:
                found["lineage"] = shared_lineage(options.dir)
            except OSError as exc:
                found["error"] = (f"the checkpoint directory {options.dir} cannot record its run lineage "
                                  f"({exc.strerror or exc}); give the job a directory it can create files in")
        found = ranks.broadcast_json(found)
        mine: dict[str, Any] = {}
        local = root_path(options.dir, options.local_dir, node, staging)
        try:
            make_private_root(local)
            if "lineage" in found and topo.is_leader:
                _point(local, options.dir)
                forget_other_lineages(local, found["lineage"])
        except ConfigError as exc:
            mine["config"] = str(exc)
        except OSError as exc:
            if exc.errno in STORAGE_ERRNOS:  # full, read-only, failing: the shared level is written directly
                mine["degraded"] = f"the node-local level {local} on {node} cannot be written ({exc.strerror or exc})"
            else:
                mine["config"] = _cannot_make(local, exc)
        everyone = ranks.gather_json(mine)  # every node's root exists before any rank writes in it
        if "error" in found:
            raise ConfigError(found["error"])
        problems = [m["config"] for m in everyone if "config" in m]
        if problems:
            raise ConfigError(mine.get("config") or problems[0])
        levels = Levels(shared=options.dir, local=local, topo=topo, shared_every=options.every_steps,
                        keep=options.keep, local_keep=options.local_keep, partner=options.partner,
                        lineage=str(found["lineage"]))
        degraded = [m["degraded"] for m in everyone if "degraded" in m]
        if degraded:
            levels.degrade(degraded[0])
            log.warning("hpcckpt: %s; every checkpoint of this run goes straight to the shared level %s",
                        degraded[0], options.dir)
        return levels


def local_root(shared: Path, local_dir: str | None, node: str, staging: Path | None) -> Path:
    """This node's node-local root for the checkpoint directory ``shared``: one directory per
    checkpoint directory (named by a hash of its path) under ``local_dir`` (``%n``: the node
    name), else the job's staging directory (slurm/prolog), else ``/dev/shm/hpcckpt-<uid>``.

    The root must be a private directory of this user (``fsio.owned_private``) in a directory
    no other user may write in (``fsio.safe_parent``): made so when missing (0700, checked
    again once made), a ConfigError naming the path and the fix otherwise."""
    root = root_path(shared, local_dir, node, staging)
    try:
        make_private_root(root)
    except OSError as exc:
        raise ConfigError(_cannot_make(root, exc)) from None
    return root


def root_path(shared: Path, local_dir: str | None, node: str, staging: Path | None) -> Path:
    """``local_root``'s path, made or checked by nothing."""
    if local_dir is not None:  # the user's own name for it: links in it are the user's to follow
        base = Path(os.path.realpath(Path(local_dir.replace("%n", node)).expanduser()))
    elif staging is not None:
        base = staging / "levels"
    else:
        base = SHM / f"hpcckpt-{os.geteuid()}"
    return base / level_key(shared)


def make_private_root(root: Path) -> None:
    """Make ``root`` and the directory holding it as ``local_root`` says, or check them:
    ConfigError for a directory that is not the user's own, OSError where one cannot be made."""
    root.parent.parent.mkdir(parents=True, exist_ok=True)
    _private_dir(root.parent, parent=True)
    _private_dir(root, parent=False)


def _cannot_make(root: Path, exc: OSError) -> str:
    return f"the node-local checkpoint level {root} cannot be made ({exc.strerror or exc}); {FIX}"


def _private_dir(path: Path, *, parent: bool) -> None:
    """Make ``path`` (0700) unless it exists; then it must pass the rule (``lstat``: never a
    link's target): ``safe_parent`` for the directory holding a root, ``owned_private`` for a
    root. ConfigError naming what is wrong and the fix."""
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if (safe_parent if parent else owned_private)(st):
        return
    if stat.S_ISLNK(st.st_mode):
        what = "a symbolic link"
    elif not stat.S_ISDIR(st.st_mode):
        what = "not a directory"
    elif st.st_uid not in ((0, os.geteuid()) if parent else (os.geteuid(),)):
        what = f"owned by uid {st.st_uid}, not by you (uid {os.geteuid()}): another user made it"
    else:
        what = f"mode {stat.S_IMODE(st.st_mode):04o}: other users may {'write' if parent else 'read or write'} in it"
    raise ConfigError(f"the node-local checkpoint level cannot use {path}: it is {what}. hpcckpt keeps "
                      f"node-local checkpoints only in a private directory of yours that no other user can write "
                      f"in; remove it{' or chmod 700 it' if 'mode' in what else ''}, or {FIX}")


def _point(local: Path, shared: Path) -> None:
    """Write what the epilog's scavenge needs in ``local``: the shared directory and this Python.

    Written relative to the root's descriptor (opened ``O_NOFOLLOW`` and checked again), into a
    new file (``O_CREAT|O_EXCL|O_NOFOLLOW``) renamed over the pointer: a name planted there is
    replaced, never written through."""
    doc = json.dumps({"shared": str(Path(shared).absolute()), "python": sys.executable}).encode()
    dfd = os.open(local, _DIR_FLAGS)
    try:
        if not owned_private(os.fstat(dfd)):
            raise ConfigError(f"the node-local checkpoint level {local} changed owner or mode while in use; {FIX}")
        tmp = f"{POINTER}.{os.getpid()}.{secrets.token_hex(4)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
        try:
            write_all(fd, doc)
        finally:
            os.close(fd)
        try:
            os.replace(tmp, POINTER, src_dir_fd=dfd, dst_dir_fd=dfd)
        except OSError:
            os.unlink(tmp, dir_fd=dfd)
            raise
    finally:
        os.close(dfd)


def shared_lineage(shared: Path) -> str:
    """The run lineage of the checkpoint directory ``shared``: a random id kept in
    ``<shared>/.hpcckpt-lineage``, made the first time levels use the directory (a directory
    deleted and made anew gets a new one). A damaged one (or a link, a FIFO) is replaced by a
    new id: node-local copies of the old one are then not trusted, which costs speed only."""
    path = Path(shared) / LINEAGE
    for _ in range(3):
        try:
            text = read_regular(path, 256).decode("ascii", "replace").strip()
        except FileNotFoundError:
            new = secrets.token_hex(16)
            try:
                write_new_durable(path, f"{new}\n".encode())  # O_CREAT|O_EXCL: a link there is EEXIST
            except FileExistsError:
                continue  # made meanwhile: read it
            fsync_path(Path(shared))
            return new
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.EINVAL, errno.ENXIO):
                raise
            text = ""
        if _LINEAGE_RE.fullmatch(text):
            return text
        new = secrets.token_hex(16)
        log.warning("hpcckpt: %s does not hold a run lineage hpcckpt wrote; a new one replaces it (node-local "
                    "copies made before are not restored)", path)
        atomic_write(path, f"{new}\n".encode())
        return new
    raise OSError(errno.EAGAIN, "it keeps appearing and vanishing", str(path))


def step_lineage(manifest: dict[str, Any]) -> str | None:
    """The run lineage a node-local step's manifest carries (None: none)."""
    job = manifest.get("job")
    value = job.get("lineage") if isinstance(job, dict) else None
    return value if isinstance(value, str) else None


def forget_other_lineages(local: Path, lineage: str) -> list[int]:
    """Remove the committed node-local steps of ``local`` that do not carry ``lineage`` (the
    leader, as the levels start): a checkpoint directory deleted and made anew, or a step this
    run's lineage never wrote, is never restored nor scavenged. Returns the steps removed."""
    doomed: list[Path] = []
    steps: list[int] = []
    for entry in catalog.entries(local):
        if entry.tmp:
            continue
        try:
            doc = read_manifest(local / entry.name)
        except CheckpointCorrupt:
            continue  # damaged: never restored (``restore.node_view``) nor scavenged
        if step_lineage(doc) != lineage:
            log.warning("hpcckpt: node-local step %d in %s belongs to another run lineage (%s, this checkpoint "
                        "directory's is %s: it was made anew since); not restoring it, removing it", entry.step,
                        local, step_lineage(doc) or "none", lineage)
            doomed.append(local / entry.name)
            steps.append(entry.step)
    if doomed:
        discard(local, doomed)
    return steps
