"""The concurrent engine (PCcheck-style): the snapshot overlaps the next step's compute.

Life of one save (step S)::

    save()            main thread, at the boundary after step S
      - waits for a free in-flight place or skips (on_busy="skip"): at most
        ``max_async`` saves writing their bytes, plus one whose bytes are durable
        and that only commits (the commit pipeline: a small state saved at every
        step does not wait for the previous save's commit, only for its bytes)
      - copies now every tensor that something other than optimizer.step() mutates
        (buffers, RNG, scheduler, sampler: small) into the save's staging slot
      - lays out rank-<r>.h5 in the temp dir (HDF5 metadata from a cached template)
      - starts a native Batch: writer threads copy parameters and optimizer state
        into the slot in chunks and pwrite each chunk at its dataset offset while
        later chunks are still being copied; returns a SaveHandle at once
    forward/backward of step S+1 run meanwhile
    optimizer.step()  its pre-hook blocks until every batch in flight has copied
                      its sources (the only visible stall besides save() itself)
    finisher thread   waits for the batch (pwrite + fdatasync), builds the rank
                      record with per-tensor crc32c, commits over the background
                      process group, frees the slot, finishes the handle

Staging (``staging.py``) is allocated once per layout and, when the engine can,
off the step path: an optimizer post-hook notices new shapes (the optimizer state
appears after the first step) and ``prepare()`` lays out the HDF5 file and
allocates (pins, when CUDA tensors are saved) on a background thread; ``save()``
only waits for it if it comes too soon. With ``staging_bytes="full"`` (or None, the
engine's own default) it is ``max_async`` prefaulted, 4 KiB-aligned slots, each a full
copy of the state. ``staging_bytes="auto"`` (a Checkpointer's default) decides per layout
(``staging.auto_staging_bytes``): a full copy of a state up to 64 MiB, else a ring of a
quarter of the state, within a share of the node's available memory.
PCcheck keeps ``max_async + 1`` buffers because its snapshot fills one buffer
before the persist of another may start; here the copy and the persist of one save
share its slot, so the spare would never be used. A slot is freed once its bytes
are durable, before the commit, so an admitted save never waits for one.

With ``staging_bytes`` (smaller than the state, to spare host RAM), staging is a
ring of chunks the state streams through on the finisher thread (``RingStream``):
the pre-hook then waits until the last source byte is copied, which with a small
ring means waiting for part of the persist. Pinned memory is released by
``close()``. A failed persist (ENOSPC, EIO) leaves the previous checkpoint
untouched; its handle carries the error and raises it once.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .._core import native
from .._gc import collector_paused
from ..config import ConcurrentOptions
from ..errors import CheckpointFailed, ConfigError
from ..ranks import Ranks
from ..state import Flat, TrainState
from ..store.commit import remove_trash
from ..store.layout import Layout
from ..store.names import HDF5, rank_file
from .base import SaveContext, SaveHandle
from .finisher import Finisher
from .hooks import StepHooks
from .job import SaveJob, layout_key
from .prepare import Prep, Preparer, build_staging
from .recycle import Recycler
from .stage import Stager
from .staging import EngineStats, Key, Slot, Staging

__all__ = ["ConcurrentEngine", "EngineStats", "Layout", "Slot"]

log = logging.getLogger("hpcckpt.engines.concurrent")


class ConcurrentEngine(StepHooks, Stager, Finisher):
    """Admission (``max_async``, ``on_busy``), the staging in use, and the engine's lifecycle; the
    step hooks (``hooks.StepHooks``), the staging of a save (``stage.Stager``) and the finisher
    thread (``finisher.Finisher``) are its parts, each in its own module."""

    name = "concurrent"

    def __init__(self, ctx: SaveContext, ranks: Ranks, options: ConcurrentOptions | None = None,
                 **settings: Any) -> None:
        """``options``: resolved settings (a Checkpointer's ``options.concurrent``, elsewhere
        ``config.engine_options``; default: the table's defaults). ``settings``: fields of
        ``ConcurrentOptions`` given one by one, replacing those of ``options`` (None: not given,
        except ``staging_bytes=None``, a full copy). The engine reads no environment."""
        super().__init__(ctx, ranks)
        given = {k: v for k, v in settings.items() if v is not None or k == "staging_bytes"}
        self.options = replace(options or ConcurrentOptions(), **given)  # checked by the table's rules
        self.max_async = self.options.max_async
        self._wanted_async = self.max_async  # max_async is lowered to the slots a memory budget allows
        self.on_busy = self.options.on_busy
        self.memory_budget_bytes = self.options.memory_budget_bytes
        self.staging_bytes = self.options.staging_bytes
        self.ring_chunk_bytes = self.options.ring_chunk_bytes
        self.direct = self.options.direct
        self.stats = EngineStats()
        self._pool = native().WriterPool(self.options.writer_threads, self.options.chunk_bytes)
        self._bg_ranks = ranks.background()
        self._staging: Staging | None = None
        self._preparer = Preparer(self._build_staging)
        self._state: TrainState | None = None
        self._prep_sig: tuple[int, ...] | None = None
        self._cond = threading.Condition()
        self._inflight: list[SaveJob] = []
        self._queue: queue.Queue[SaveJob | None] = queue.Queue()
        self._hooks: dict[int, list[Any]] = {}
        self._optimizers: list[torch.optim.Optimizer] = []
        self._safe: set[str] = set()
        self._safe_prefixes: tuple[str, ...] = ()
        self._safe_masks: dict[int, tuple[Layout, np.ndarray]] = {}
        self._stream: Any = None
        self._closed = False
        # A pruned checkpoint's rank file reused by the next save (one rank, no levels).
        self._recycler = (Recycler(ctx.root, rank_file(ranks.rank, HDF5))
                          if ranks.world == 1 and ctx.levels is None and ctx.keep is not None else None)
        self._finisher = threading.Thread(target=self._finish_loop, name="hpcckpt-finisher", daemon=True)
        self._finisher.start()
        # Started with the first save staged from a GPU (``_start_launcher``).
        self._launcher: threading.Thread | None = None
        self._launch_queue: queue.Queue[SaveJob | None] = queue.Queue()

    def prepare(self, tensors: dict[str, torch.Tensor]) -> None:
        """Lay out files and allocate (pin) staging for these tensors on a background thread.

        Main thread; returns at once. A later ``save()`` of the same shapes uses the
        result (waiting for it if it is still running) instead of allocating on the
        step path. Failures are left to ``save()``, which redoes the work and reports.
        """
        try:
            key = layout_key(tensors)
        except ConfigError:
            return  # save() reports it, where the user sees it
        cuda = next((t.device for t in tensors.values() if isinstance(t, torch.Tensor) and t.is_cuda), None)
        if cuda is not None:
            self._side_stream(cuda)  # the first torch.cuda.Stream builds torch's stream pool: not in save()
        if self._staging is None or self._staging.key != key:
            self._preparer.start(key)

    def wait_prepared(self, timeout: float | None = None) -> bool:
        """Block until a background preparation (if any) has finished; True if none is left running.

        Main thread. For benchmarks and tests that save right after the first step,
        where a real loop would run steps while staging is allocated.
        """
        return self._preparer.wait(timeout)

    @property
    def _prep(self) -> Prep | None:
        """The preparation under way or finished and not yet used (tests look at it)."""
        return self._preparer.current

    def save(self, flat: Flat, step: int, *, final: bool = False) -> SaveHandle:
        """Start saving ``flat`` as ``step``; main thread, at a step boundary. Returns at once."""
        if self._closed:
            raise CheckpointFailed(f"checkpoint of step {step} under {self.ctx.root}: the engine is closed")
        t0 = time.monotonic()
        handle = SaveHandle(step, final=final)
        admitted = False
        try:
            if not self._admit(step, final):
                handle.finish(error=CheckpointFailed(
                    f"checkpoint of step {step} under {self.ctx.root} skipped: {self.max_async} saves still in "
                    "flight (on_busy='skip'); raise max_async or save less often; the previous checkpoint is "
                    "untouched"))
                self.stats.skipped += 1
                return handle
            admitted = True
            self._start(flat, step, handle, t0)
        finally:
            dt = time.monotonic() - t0
            self.stats.save_call_s += dt
            self.stats.save_calls_s.append(dt)
            if admitted and self.stats.first_save_call_s is None:
                self.stats.first_save_call_s = dt
        return handle

    def _busy(self) -> bool:
        """No place for another save (under ``_cond``): ``max_async`` saves still writing their
        bytes, or one more than that in flight. A save whose bytes are durable and whose slot
        is free only waits for its commit on the finisher (commits go in step order), so the
        next save may stage and write meanwhile; it never waits for a slot (that one is free)."""
        if len(self._inflight) > self.max_async:
            return True
        return sum(1 for j in self._inflight if not j.persisted) >= self.max_async

    def _admit(self, step: int, final: bool) -> bool:
        """Wait for an in-flight place (or, with on_busy='skip', decide to skip)."""
        with self._cond:
            busy = self._busy()
        if self.on_busy == "skip" and not final:
            # Every rank must take the same decision, or the commit exchange would mismatch.
            if self.ranks.max(int(busy)):
                log.warning("hpcckpt: skipping checkpoint of step %d: %d saves in flight (on_busy=skip)",
                            step, self.max_async)
                return False
            return True
        if busy:
            log.info("hpcckpt: checkpoint of step %d waits: %d saves in flight (max_async=%d)",
                     step, self.max_async, self.max_async)
        with self._cond:
            self._cond.wait_for(lambda: not self._busy())
        return True

    def _start(self, flat: Flat, step: int, handle: SaveHandle, started: float) -> None:
        """Stage the save and queue it for the finisher.

        A failure here (file creation, staging) still queues the save, marked failed:
        every rank must take part in each commit exchange, or a rank that failed would
        leave the others waiting in it, or pair their step with its next one. The
        failure then reaches every rank through the handle; a ConfigError is also
        raised here, because the user has to fix it. With the cyclic collector paused: the
        layout check and the staging make an object or more per tensor, none in a cycle.
        """
        with collector_paused():
            self._start_paused(flat, step, handle, started)

    def _start_paused(self, flat: Flat, step: int, handle: SaveHandle, started: float) -> None:
        tensors = dict(flat.tensors)
        tmp = self.temp_path(step)
        fname = rank_file(self.ranks.rank, HDF5)
        slot: Slot | None = None
        try:
            staging = self._staging_for(tensors)
            reused = (self._recycler is not None and staging.ring is None and staging.layout.template is not None
                      and self._recycler.take(tmp, staging.layout))  # tmp and its rank file, from a pruned step
            if not reused:
                tmp.mkdir(mode=0o700, parents=True, exist_ok=True)
            if staging.ring is not None:
                staging.layout.materialise(tmp / fname)
                job = self._stage_ring(flat, step, handle, tmp, fname, staging, tensors, started)
            else:
                slot = self._take_slot()
                job = self._stage(flat, step, handle, tmp, fname, staging.layout, slot, tensors, started,
                                  reused=reused)
        except Exception as exc:
            if slot is not None:
                self._free_slot(slot)
            # The temporary directory is shared by all ranks: the coordinator removes it
            # when the exchange reports the failure.
            job = SaveJob(handle, step, tmp, fname, None, None, None, None, {}, started, error=exc)
            job.copied.set()
            self._enqueue(job)
            if isinstance(exc, ConfigError):
                raise
            log.error("hpcckpt: checkpoint of step %d could not start on rank %d: %s", step, self.ranks.rank, exc)
            return
        self._enqueue(job)

    def _enqueue(self, job: SaveJob) -> None:
        with self._cond:
            self._inflight.append(job)
        self.stats.saves += 1
        self._queue.put(job)

    def _staging_for(self, tensors: dict[str, torch.Tensor]) -> Staging:
        """The staging for these tensors' names, dtypes and shapes, prepared in the background
        if possible; main thread. The current one is recognised by comparing lists (C loops),
        not by building the layout key of tens of thousands of tensors at every save."""
        st = self._staging
        if st is not None and st.matches(tensors):  # matches() also requires a host-only staging
            return st
        key = layout_key(tensors)
        if st is None or st.key != key:
            st = self._preparer.take(key) or self._build_staging(key)
            self._install(st)
        return st

    def _build_staging(self, key: Key) -> Staging:
        """Layout and staging memory for ``key``; the preparation thread or the main thread."""
        return build_staging(key, self.write_root, staging_bytes=self.staging_bytes,
                             ring_chunk_bytes=self.ring_chunk_bytes, slot_count=self._slot_count, stats=self.stats,
                             memory_budget_bytes=self.memory_budget_bytes)

    def _install(self, staging: Staging) -> None:
        """Make ``staging`` current; the old one is released once no save in flight uses it."""
        old = self._staging
        if old is not None:
            with self._cond:
                self._cond.wait_for(lambda: not any(s.busy for s in old.slots)
                                    and not any(j.staging is old for j in self._inflight))
            old.release()
        self._staging = staging
        # A memory budget may allow fewer full slots than wanted: applied here, on the main
        # thread, never by a preparation running beside saves (it may be dropped unused).
        slots = len(staging.slots) if staging.ring is None else self._wanted_async
        if slots < self._wanted_async:
            log.warning("hpcckpt: memory budget allows %d staging slots of %d bytes, not %d; "
                        "max_async lowered to %d", slots, staging.layout.slot_bytes, self._wanted_async, slots)
        with self._cond:
            self.max_async = min(self._wanted_async, slots)
            self._cond.notify_all()
        self.stats.staging_bytes, self.stats.staging_pinned = staging.nbytes, staging.pinned
        ring = staging.ring
        self.stats.ring_chunks = len(ring.chunks) if ring else 0
        self.stats.ring_chunk_bytes = ring.chunk_bytes if ring else 0

    def _slot_count(self, slot_bytes: int) -> int:
        """How many full slots to allocate (any thread: reads only; ``_install`` applies it)."""
        wanted = self._wanted_async
        if self.memory_budget_bytes is None:
            return wanted
        fits = self.memory_budget_bytes // slot_bytes
        if fits < 1:
            raise ConfigError(
                f"memory_budget_bytes={self.memory_budget_bytes} cannot hold one staging copy of this rank's "
                f"state ({slot_bytes} bytes); raise HPCCKPT_MEMORY_BUDGET_BYTES, set HPCCKPT_STAGING_BYTES "
                "for a smaller staging ring, or use the sync engine")
        return int(min(wanted, fits))

    def _recycled(self, tmp: Path) -> bool:
        return self._recycler is not None and self._recycler.taken(tmp)

    def empty_trash(self) -> None:
        """Delete what the last commit pruned, keeping one rank file for the next save
        (``recycle``) when it has the current layout."""
        if self._recycler is None or not self._trash:
            super().empty_trash()
            return
        doomed, self._trash[:] = list(self._trash), []
        staging = self._staging
        current = staging.layout if staging is not None and staging.ring is None else None
        remove_trash(self._recycler.keep(doomed, current))

    def pending(self) -> list[SaveHandle]:
        with self._cond:
            return [j.handle for j in self._inflight]

    def drain(self) -> None:
        """Wait until no save is in flight (their errors stay with their handles)."""
        with self._cond:
            self._cond.wait_for(lambda: not self._inflight)

    def close(self) -> None:
        """Wait for saves in flight, stop the finisher, unhook optimizers, release staging. Idempotent.

        Pinned staging is unregistered here and its memory freed with the last reference.
        """
        if self._closed:
            return
        self._closed = True
        self.drain()
        self._queue.put(None)
        self._finisher.join()
        if self._launcher is not None:
            self._launch_queue.put(None)
            self._launcher.join()
        for hooks in self._hooks.values():
            for hook in hooks:
                hook.remove()
        self._hooks.clear()
        self._optimizers.clear()
        self._pool.close()
        self._preparer.close()  # nothing of this engine keeps running, or pinned, after close
        self.settle_trash()  # the finisher has stopped: this thread commits no more
        if self._recycler is not None:
            self._recycler.close()
        self.close_commit_lock()
        if self._staging is not None:
            self._staging.release()
            self._staging = None
        self.stats.staging_bytes, self.stats.staging_pinned = 0, False
