"""Reuse a pruned checkpoint's rank file for the next save (concurrent engine).

With retention, every commit prunes the oldest kept checkpoint; for a small state saved
at every step, deleting its rank file was most of what a save cost besides the copy
(on the reference VM's ext4, mounted ``discard``: ~0.7 ms of kernel time a 3 MB unlink,
plus the directory), and the next save then allocated the same blocks again. Instead
the finisher keeps one pruned step directory aside (``.spare-<hex>`` in the checkpoint
root: hidden, never listed) and the next save renames it into place as its temporary
directory: its rank file already has the size and the HDF5 layout of the new one, so
the writers overwrite its blocks in place (O_DIRECT, fdatasync; no allocation) and
nothing is unlinked. Its manifest is kept too, and the commit rewrites it in place
(``Transaction(recycled=True)``): the directory then gains no entry, so the commit neither
creates an inode nor fsyncs the directory (both entries were made durable by the commit
that first wrote them; renames of the directory itself are the root's, covered by the
root's fsync). The stale manifest in between is only ever in a hidden spare or a
temporary directory, neither of which is ever read as a checkpoint.

Only a file of exactly the current layout is reused (the layout object the pruned save
was written with, and its size): every byte a reader looks at, HDF5 metadata and each
tensor's range, is written again by the save, and bytes outside them were written by
the same layout (holes or padding). The commit protocol is otherwise unchanged (the rank file is
fdatasync'ed by the writers, the manifest before the rename, the root after it), and so is
what a crash leaves: a temporary directory, never loaded; a spare left by a killed process is
swept like a discard's leftover once it is older than ``commit.STALE_SPARE_AGE_S``.
One rank, no levels: the temporary directory of a multi-rank save is shared.
"""
from __future__ import annotations

import os
import secrets
import stat
import threading
from collections import OrderedDict
from pathlib import Path

from ..store.commit import MANIFEST, SPARE_PREFIX, remove_trash, trashed_name
from ..store.layout import Layout

_REMEMBERED = 64  # layouts of the most recent saves (retention prunes the oldest kept)
_TAKEN_MAX = 1024  # far above the saves in flight: only those that failed before committing are dropped


class Recycler:
    """One spare step directory at a time, held by the committing thread for the next save."""

    def __init__(self, root: Path, fname: str) -> None:
        self.root = root
        self.fname = fname
        self._lock = threading.Lock()
        self._spare: tuple[Path, Layout] | None = None
        self._written: OrderedDict[str, Layout] = OrderedDict()  # step name -> layout of its file
        self.reused = 0  # saves that overwrote a spare (tests, stats)
        self._taken: dict[Path, None] = {}  # temporary directories made of a spare, not yet committed

    def written(self, name: str, layout: Layout) -> None:
        """The save of step directory ``name`` lays its rank file out as ``layout``."""
        with self._lock:
            self._written[name] = layout
            self._written.move_to_end(name)
            while len(self._written) > _REMEMBERED:
                self._written.popitem(last=False)

    def keep(self, doomed: list[Path], current: Layout | None) -> list[Path]:
        """The committing thread, before deleting pruned trees: hold one as the spare when
        its rank file fits ``current``; returns the trees still to delete (a held spare
        that no longer fits among them)."""
        with self._lock:
            held = self._spare
            if held is not None and held[1] is not current:  # the state's shapes changed: of no use now
                self._spare = None
                doomed = [*doomed, held[0]]
                held = None
        if held is not None or current is None or current.template is None:
            return doomed
        for i, tree in enumerate(doomed):
            name = trashed_name(tree.name)
            if name is None:
                continue
            with self._lock:
                layout = self._written.pop(name, None)
            if layout is not current:
                continue
            spare = self._adopt(tree, current)
            if spare is None:
                continue
            with self._lock:
                self._spare = (spare, current)
            return doomed[:i] + doomed[i + 1:]
        return doomed

    def _adopt(self, tree: Path, layout: Layout) -> Path | None:
        """``tree`` (a pruned step renamed aside) renamed to a spare name, its rank file and
        manifest kept (the next commit rewrites that manifest in place: ``Transaction``'s
        ``recycled``); None when it does not hold exactly the files expected."""
        assert layout.template is not None
        try:
            names = set(os.listdir(tree))
            if self.fname not in names or names - {self.fname, MANIFEST}:
                return None
            st = os.lstat(tree / self.fname)
            if not stat.S_ISREG(st.st_mode) or st.st_size != layout.template[1]:
                return None
            spare = self.root / f"{SPARE_PREFIX}{secrets.token_hex(6)}"
            os.rename(tree, spare)
            os.utime(spare)  # its age is how a sweep tells a live engine's spare from a crash's
        except OSError:
            return None
        return spare

    def take(self, tmp: Path, layout: Layout) -> bool:
        """The saving thread: rename the spare to ``tmp`` (the save's temporary directory,
        not yet made) when it fits ``layout``; False: make ``tmp`` and the file afresh."""
        with self._lock:
            held = self._spare
            if held is None or held[1] is not layout:
                return False
            self._spare = None
        try:
            os.rename(held[0], tmp)  # gone (swept, removed by hand): a fresh file instead
        except OSError:
            return False
        with self._lock:
            self._taken[tmp] = None
            while len(self._taken) > _TAKEN_MAX:  # saves that failed before their commit asked
                del self._taken[next(iter(self._taken))]
        self.reused += 1
        return True

    def taken(self, tmp: Path) -> bool:
        """The committing thread: whether ``tmp`` was made of a spare (asked once per save)."""
        with self._lock:
            return self._taken.pop(tmp, False) is None

    def close(self) -> None:
        """Delete the spare (the engine is closing)."""
        with self._lock:
            held, self._spare = self._spare, None
            self._written.clear()
            self._taken.clear()
        if held is not None:
            remove_trash([held[0]])
