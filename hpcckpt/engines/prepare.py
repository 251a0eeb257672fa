"""Staging built off the step path: a layout and its host memory, on a background thread.

``Preparer`` owns at most one preparation that is wanted (``current``) and any that
were superseded and are still running (they release what they build). Call sequence
(the engine's main thread)::

    start(key)          new shapes known (after an optimizer step, or at bind)
    take(key)           at the save: the staging if it is for these shapes (joins the
                        thread if still running), else None (the save builds it)
    wait(timeout)       optional: benchmarks that save right after the first step
    close()             joins every thread; nothing stays pinned

``build_staging`` runs on the preparation thread, or on the main thread when a save
finds nothing prepared.
"""
from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..store.hostmem import make_slots
from ..store.layout import Layout
from ..store.names import LAYOUT_SCRATCH
from ..store.prefetch import mem_available
from .staging import EngineStats, Key, Ring, Staging, auto_staging_bytes, local_ranks, ring_shape

log = logging.getLogger("hpcckpt.engines.prepare")


def build_staging(key: Key, root: Path, *, staging_bytes: int | str | None, ring_chunk_bytes: int | None,
                  slot_count: Callable[[int], int], stats: EngineStats,
                  memory_budget_bytes: int | None = None) -> Staging:
    """Plan the HDF5 layout (in a scratch file under ``root``) and allocate staging. Any thread.

    ``staging_bytes``: a ring's byte count, None or "full" (full slots), or "auto" (chosen
    now from the state's size and the node's available memory: ``auto_staging_bytes``).
    """
    t0 = time.monotonic()
    specs, device = key
    pin = device is not None
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, scratch = tempfile.mkstemp(dir=root, prefix=LAYOUT_SCRATCH[0], suffix=LAYOUT_SCRATCH[1])
    os.close(fd)
    try:
        layout = Layout.plan(Path(scratch), specs)
    finally:
        os.unlink(scratch)
    # Pinning on this (maybe background) thread must use the training device's context,
    # not create one on device 0.
    if staging_bytes == "auto":
        staging_bytes = auto_staging_bytes(layout.state_bytes, available=mem_available(), ranks_here=local_ranks(),
                                           budget=memory_budget_bytes)
        stats.staging_auto = True
    elif staging_bytes == "full":
        staging_bytes = None
    with torch.cuda.device(device) if pin else contextlib.nullcontext():
        if not isinstance(staging_bytes, int):
            n = slot_count(layout.slot_bytes)
            staging = Staging(key, layout, make_slots(n, layout.slot_bytes, pin=pin), None)
        else:
            chunks, size = ring_shape(staging_bytes, layout.state_bytes, ring_chunk_bytes)
            staging = Staging(key, layout, [], Ring(chunks, size, [layout.entries[n] for n, _, _ in specs], pin=pin))
    kind = "pinned" if pin else "pageable"
    ring = staging.ring
    if ring is None:
        log.info("hpcckpt: staging %d slots x %d bytes (%s)", len(staging.slots), layout.slot_bytes, kind)
    else:
        log.info("hpcckpt: staging ring %d x %d bytes for %d bytes of state in %d rounds (%s)",
                 len(ring.chunks), ring.chunk_bytes, layout.state_bytes, len(ring.rounds), kind)
    stats.prepare_s += time.monotonic() - t0
    return staging


@dataclass
class Prep:
    """One staging being built on a background thread."""

    key: Key
    thread: threading.Thread | None = None
    staging: Staging | None = None
    error: BaseException | None = None
    abandoned: bool = False  # no longer wanted: the thread releases what it built
    lock: threading.Lock = field(default_factory=threading.Lock)


class Preparer:
    """Background preparations of staging; main thread except ``_run``."""

    def __init__(self, build: Callable[[Key], Staging]) -> None:
        self._build = build
        self.current: Prep | None = None
        self._abandoned: list[Prep] = []

    def start(self, key: Key) -> None:
        """Build staging for ``key`` on a new thread (unless already under way); returns at once."""
        if self.current is not None and self.current.key == key:
            return
        self.drop()
        prep = Prep(key)
        prep.thread = threading.Thread(target=self._run, args=(prep,), name="hpcckpt-prepare", daemon=True)
        self.current = prep
        prep.thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the current preparation (if any) finished; True if none is left running."""
        prep = self.current
        if prep is None or prep.thread is None:
            return True
        prep.thread.join(timeout)
        return not prep.thread.is_alive()

    def take(self, key: Key) -> Staging | None:
        """The prepared staging for ``key`` (waiting for it if still running), or None.

        None also after the preparation failed: the caller builds again, which raises
        the error where the user sees it. A preparation for other shapes is dropped.
        """
        prep = self.current
        if prep is None:
            return None
        if prep.key != key:
            self.drop()
            return None
        self.current = None
        assert prep.thread is not None
        prep.thread.join()  # usually long finished; otherwise the save came too soon
        return prep.staging

    def drop(self, *, wait: bool = False) -> None:
        """Forget the current preparation; never blocks unless ``wait``."""
        prep, self.current = self.current, None
        if prep is None:
            return
        with prep.lock:
            prep.abandoned = True
            staging, prep.staging = prep.staging, None
        if staging is not None:
            staging.release()
        if prep.thread is not None:
            if wait:
                prep.thread.join()
            else:
                self._abandoned = [p for p in self._abandoned if p.thread and p.thread.is_alive()] + [prep]

    def close(self) -> None:
        """Drop everything and join every thread: nothing runs or stays pinned afterwards."""
        self.drop(wait=True)
        for prep in self._abandoned:
            if prep.thread is not None:
                prep.thread.join()
        self._abandoned = []

    def _run(self, prep: Prep) -> None:
        """The preparation thread."""
        try:
            staging = self._build(prep.key)
        except BaseException as exc:  # reported by the save, which builds again on the main thread
            prep.error = exc
            log.debug("hpcckpt: background staging preparation failed: %s", exc)
            return
        with prep.lock:
            if not prep.abandoned:
                prep.staging = staging
                return
        staging.release()
