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

import contextlib
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from .._core import native
from .._gc import collector_paused
from ..config import ConcurrentOptions
from ..errors import CheckpointFailed, ConfigError
from ..state import Flat, TrainState, stepping_optimizer
from ..ranks import Ranks
from ..store import catalog
from ..store.commit import remove_trash
from ..store.entry import raw_bytes
from ..store.hostmem import one_cuda_device
from .base import Engine, SaveContext, SaveHandle
from ..store.layout import Layout
from .prepare import Prep, Preparer, build_staging
from .recycle import Recycler
from .staging import EngineStats, Key, RingStream, Slot, Staging, flat_bytes

__all__ = ["ConcurrentEngine", "EngineStats", "Layout", "Slot"]

log = logging.getLogger("hpcckpt.engines.concurrent")

@dataclass
class _Job:
    handle: SaveHandle
    step: int
    tmp: Path
    fname: str
    meta: Any
    layout: Layout | None
    slot: Slot | None
    batch: Any
    items: dict[str, int]
    started: float
    copied: threading.Event = field(default_factory=threading.Event)
    cuda_event: Any = None
    device: Any = None  # the CUDA device of cuda_event's copies
    d2h_events: tuple[Any, Any, int] | None = None  # (begin, end, bytes) of a slot's D2H copy
    staging: Staging | None = None
    ring: RingStream | None = None
    sources: dict[str, Any] | None = None  # ring: source byte views; CUDA slot: device clones; until copied
    error: BaseException | None = None  # failed before persisting: only the commit exchange is left
    placement: dict[str, Any] = field(default_factory=dict)  # the record's distributed-tensor fields
    # Items added in bulk (``_stage_host``): (first item id, indices into layout.names), in order.
    groups: list[tuple[int, np.ndarray]] = field(default_factory=list)
    # Its slot's bytes are durable and the slot is free: only its commit is left (``_busy``).
    persisted: bool = False
    # A slot filled by a D2H copy: set once the launcher thread saw the copy done and started
    # the batch (or failed to: ``launch_error``).
    launched: threading.Event = field(default_factory=threading.Event)
    launch_error: BaseException | None = None


def _specs(tensors: dict[str, torch.Tensor]) -> Key:
    """The layout key of a capture: (name, dtype, shape) of each tensor, and the CUDA device
    whose copies the staging serves (pinned then), None when nothing is on a GPU.

    ConfigError when tensors are on several CUDA devices: one side stream, one pinned
    context (run one process per GPU).
    """
    specs = tuple((n, t.dtype, tuple(t.shape)) for n, t in tensors.items())
    device = one_cuda_device((t.device for t in tensors.values()), "checkpoint")
    return specs, None if device is None else device.index


def _fsync(path: Path) -> None:
    """Make a file written without the native writers durable (before its commit)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# How one tensor reaches its save's staging slot (``_routes``).
DEVICE = "device"              # CUDA, only optimizer.step() mutates it: D2H on the side stream
DEVICE_CLONE = "device_clone"  # CUDA, mutated elsewhere too: a device clone now, then D2H
HOST_NOW = "host_now"          # CPU: copied into the slot now, on the main thread
HOST_BATCH = "host_batch"      # CPU, only optimizer.step() mutates it: copied by the native writers


def _routes(tensors: dict[str, torch.Tensor], is_safe: Callable[[str], bool], *,
            gpu_pending: bool | None = None) -> dict[str, str]:
    """Decide how each tensor is staged; ``gpu_pending``: whether a D2H copy will be pending
    (default: any tensor is on a GPU).

    With a D2H copy pending the optimizer pre-hook only orders the GPU after it
    (``wait_event``) and returns at once on the host, so the native batch starts
    (after the D2H) while ``optimizer.step()`` already runs. A CPU tensor that the
    step mutates on the host (Adam's ``step`` counters of CUDA parameters) must then
    be in the slot before ``save()`` returns, or the checkpoint would pair step S's
    parameters with step S+1's counters. Without a GPU the pre-hook waits for the
    batch's copies on the host, so the writers may copy CPU sources themselves.
    """
    if gpu_pending is None:
        gpu_pending = any(t.is_cuda for t in tensors.values())
    out: dict[str, str] = {}
    for name, t in tensors.items():
        safe = is_safe(name) and t.is_contiguous()
        if t.is_cuda:
            out[name] = DEVICE if safe else DEVICE_CLONE
        else:
            out[name] = HOST_BATCH if safe and not gpu_pending else HOST_NOW
    return out


class ConcurrentEngine(Engine):
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
        self._inflight: list[_Job] = []
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._hooks: dict[int, list[Any]] = {}
        self._optimizers: list[torch.optim.Optimizer] = []
        self._safe: set[str] = set()
        self._safe_prefixes: tuple[str, ...] = ()
        self._safe_masks: dict[int, tuple[Layout, np.ndarray]] = {}
        self._stream: Any = None
        self._closed = False
        # A pruned checkpoint's rank file reused by the next save (one rank, no levels).
        self._recycler = (Recycler(ctx.root, f"rank-{ranks.rank}.h5")
                          if ranks.world == 1 and ctx.levels is None and ctx.keep is not None else None)
        self._finisher = threading.Thread(target=self._finish_loop, name="hpcckpt-finisher", daemon=True)
        self._finisher.start()
        # Started with the first save staged from a GPU (``_start_launcher``).
        self._launcher: threading.Thread | None = None
        self._launch_queue: queue.Queue[_Job | None] = queue.Queue()

    @property
    def _slots(self) -> list[Slot]:
        """The full-copy slots in use (empty with a ring)."""
        return self._staging.slots if self._staging else []

    # -- registration ----------------------------------------------------------

    def bind(self, state: TrainState) -> None:
        """Hook every registered optimizer; main thread.

        The pre-hook keeps ``optimizer.step()`` from overwriting un-staged sources;
        the post-hook starts laying out staging in the background once the state's
        shapes are known (optimizer state appears only after the first step).
        """
        self._state = state
        self._safe = state.background_safe()
        self._safe_masks.clear()
        for name, obj in state.objects.items():
            if not isinstance(obj, torch.optim.Optimizer):
                continue
            try:
                stepping = stepping_optimizer(obj, name)  # a wrapper's (Accelerate's) inner optimizer
            except ConfigError as exc:
                # No hook tells when its step() may overwrite what a save still copies: every
                # parameter and optimizer state is then copied inside save(), as the rest is
                # (the write still runs in the background). Correct, only a longer stall.
                if "rng/" in self._safe and len(self._safe) > 1:
                    log.warning("hpcckpt: %s; the concurrent engine copies the whole state inside save()", exc)
                self._safe = {"rng/"}
                continue
            if id(stepping) not in self._hooks:
                self._hooks[id(stepping)] = [stepping.register_step_pre_hook(self._before_step),
                                             stepping.register_step_post_hook(self._after_step)]
                self._optimizers.append(stepping)
        self._safe_prefixes = tuple(s for s in self._safe if s.endswith("/"))
        self._prepare_if_new_shapes(at_bind=True)

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """optimizer.step() may overwrite parameters and state only once they are staged."""
        self.wait_copied()

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Main thread, after each step: prepare staging when the optimizer state's shape changed."""
        self._prepare_if_new_shapes(at_bind=False)

    def _prepare_if_new_shapes(self, *, at_bind: bool) -> None:
        """Costs a tuple of lengths per step; a capture (no copy) only when it changed.

        At bind time only when the shapes are already final: no optimizer, or one that
        already holds state (a fresh optimizer's state appears with its first step).
        """
        sig = tuple(len(o.state) for o in self._optimizers)
        if sig == self._prep_sig or self._state is None or self._closed:
            return
        if at_bind and self._optimizers and not any(sig):
            return
        self._prep_sig = sig
        self.prepare(self._state.capture(step=0).tensors)

    def prepare(self, tensors: dict[str, torch.Tensor]) -> None:
        """Lay out files and allocate (pin) staging for these tensors on a background thread.

        Main thread; returns at once. A later ``save()`` of the same shapes uses the
        result (waiting for it if it is still running) instead of allocating on the
        step path. Failures are left to ``save()``, which redoes the work and reports.
        """
        try:
            key = _specs(tensors)
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

    def wait_copied(self) -> float:
        """Block until every save in flight has copied its sources; returns the seconds blocked.

        The seconds are added to the blocked saves' ``handle.stall_s`` (the policy's
        measured overhead) and to ``stats.hook_wait_s``.
        """
        with self._cond:
            pending = [j for j in self._inflight if not j.copied.is_set()]
        if not pending:
            return 0.0
        t0 = time.monotonic()
        for job in pending:
            if job.cuda_event is not None:
                # The GPU orders optimizer.step() after the D2H copy; the host does not wait
                # (CPU sources were copied by save(): ``_routes``). The training device's
                # stream, which need not be the current device's.
                torch.cuda.current_stream(job.device).wait_event(job.cuda_event)
            elif job.ring is None and job.batch is not None:
                job.batch.wait_copied()
                job.copied.set()
            else:
                job.copied.wait()  # the finisher streams the ring and sets it
        waited = time.monotonic() - t0
        self.stats.hook_wait_s += waited
        for job in pending:
            job.handle.stall_s = (job.handle.stall_s or 0.0) + waited
        return waited

    def _is_safe(self, name: str) -> bool:
        if name in self._safe:  # a parameter: exact name (O(1); states have hundreds of tensors)
            return True
        return any(name.startswith(s) for s in self._safe_prefixes)  # optimizer state: one prefix each

    # -- save ------------------------------------------------------------------

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
        fname = f"rank-{self.ranks.rank}.h5"
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
            job = _Job(handle, step, tmp, fname, None, None, None, None, {}, started, error=exc)
            job.copied.set()
            self._enqueue(job)
            if isinstance(exc, ConfigError):
                raise
            log.error("hpcckpt: checkpoint of step %d could not start on rank %d: %s", step, self.ranks.rank, exc)
            return
        self._enqueue(job)

    def _enqueue(self, job: _Job) -> None:
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
        key = _specs(tensors)
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

    def _take_slot(self) -> Slot:
        with self._cond:
            self._cond.wait_for(lambda: any(not s.busy for s in self._slots))
            slot = next(s for s in self._slots if not s.busy)
            slot.busy = True
            return slot

    def _free_slot(self, slot: Slot) -> None:
        with self._cond:
            slot.busy = False
            self._cond.notify_all()

    def _stage(self, flat: Flat, step: int, handle: SaveHandle, tmp: Path, fname: str, layout: Layout,
               slot: Slot, tensors: dict[str, torch.Tensor], started: float, *, reused: bool = False) -> _Job:
        """Make the rank file (``reused``: it is there, of this layout) and stage the save into
        ``slot``: all at once when nothing is on a GPU (``_stage_host``), else tensor by tensor
        by route (``_stage_each``). With a metadata template the file is made at its size and
        the save's writers write the metadata with the tensors; without one (a layout too big
        for a template) h5py lays the file out here."""
        if layout.template is None:
            layout.materialise(tmp / fname)
            return self._stage_each(flat, step, handle, tmp, fname, layout, slot, tensors, started)
        if not reused:
            layout.create(tmp / fname)
        if self._recycler is not None:
            self._recycler.written(catalog.step_name(step), layout)
        if self._all_at_once(layout):
            return self._stage_host(flat, step, handle, tmp, fname, layout, slot, tensors, started)
        return self._stage_each(flat, step, handle, tmp, fname, layout, slot, tensors, started)

    def _all_at_once(self, layout: Layout) -> bool:
        """Whether this save is staged by ``_stage_host`` (nothing on a GPU, a metadata template)."""
        return self._staging is not None and self._staging.key[1] is None and layout.template is not None

    def _stage_each(self, flat: Flat, step: int, handle: SaveHandle, tmp: Path, fname: str, layout: Layout,
                    slot: Slot, tensors: dict[str, torch.Tensor], started: float) -> _Job:
        batch = native().Batch(self._pool, self.direct)
        path = str(tmp / fname)
        items: dict[str, int] = {}
        gpu: list[tuple[torch.Tensor, torch.Tensor]] = []
        clones: dict[str, Any] = {}
        for name, route in _routes(tensors, self._is_safe).items():
            t = tensors[name]
            e = layout.entries[name]
            if not e.nbytes:
                continue
            off = layout.staging_offset[name]
            dst = slot.bytes[off:off + e.nbytes]
            if route == DEVICE:
                gpu.append((slot.tensor[off:off + e.nbytes], t))
                items[name] = batch.add(path, e.offset, dst)
            elif route == HOST_BATCH:
                items[name] = batch.add(path, e.offset, dst, raw_bytes(t))
            elif route == DEVICE_CLONE:
                # Mutated outside optimizer.step() (the next forward may): a device copy queued on
                # the training stream now, copied down with the rest (no host sync here).
                clones[name] = t.detach().clone(memory_format=torch.contiguous_format)
                gpu.append((slot.tensor[off:off + e.nbytes], clones[name]))
                items[name] = batch.add(path, e.offset, dst)
            else:
                # HOST_NOW: mutated outside optimizer.step(), not contiguous, or a D2H is pending.
                slot.tensor[off:off + e.nbytes].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
                items[name] = batch.add(path, e.offset, dst)
        template = layout.template_items()
        if template is not None:  # ``_stage`` made the file without its metadata
            batch.add_many(path, *template)
        job = _Job(handle, step, tmp, fname, flat.meta, layout, slot, batch, items, started,
                   staging=self._staging, sources=clones or None,  # clones live until their copy is done
                   placement=self.placement_fields(flat))
        if gpu:
            self._start_launcher()  # before the copy: a failure here leaves no copy running into the slot
            job.cuda_event, job.d2h_events = self._copy_to_host(gpu)
            job.device = gpu[0][1].device
            self._launch_queue.put(job)
        else:
            batch.start()
        return job

    def _start_launcher(self) -> None:
        """The thread that starts each GPU save's batch once its D2H copy is done (once).

        Not the finisher: it commits the previous save meanwhile, and a save's writes
        started only after that commit made the finisher's cycle (write + fdatasync +
        commit) the bound on how often a GPU state can be saved: on an H200 node, a
        3.2 MB state saved at every 5.6 ms step waited ~4.8 ms in each ``save()``.
        """
        if self._launcher is None:
            thread = threading.Thread(target=self._launch_loop, name="hpcckpt-d2h", daemon=True)
            thread.start()
            self._launcher = thread  # only once it runs: a failed start is tried again next time

    def _launch_loop(self) -> None:
        """The launcher thread: jobs in save order (their copies share one side stream)."""
        while True:
            job = self._launch_queue.get()
            if job is None:
                return
            try:
                # Under the training GPU's device guard: its context, never device 0's.
                guard = torch.cuda.device(job.device) if job.device.type == "cuda" else contextlib.nullcontext()
                with guard:
                    job.cuda_event.synchronize()  # a blocking-sync event: the thread sleeps
                job.batch.start()
            except BaseException as exc:  # noqa: BLE001 - the finisher reports it with the save
                job.launch_error = exc
            finally:
                job.launched.set()

    def _stage_host(self, flat: Flat, step: int, handle: SaveHandle, tmp: Path, fname: str, layout: Layout,
                    slot: Slot, tensors: dict[str, torch.Tensor], started: float) -> _Job:
        """``_stage`` when nothing is on a GPU, in a few native calls whatever the tensor count.

        A tensor that only ``optimizer.step()`` mutates and is contiguous is copied into the
        slot by the writers from its address (the job holds the tensor until its bytes are
        copied; the optimizer pre-hook waits for that); any other is copied now (HOST_NOW).
        The HDF5 metadata (the layout's template) is written by the same writers.
        """
        batch = native().Batch(self._pool, self.direct)
        path = str(tmp / fname)
        names = layout.names
        sources = list(map(tensors.__getitem__, names))
        # Each source's address, 0 where it is not contiguous: two C-level passes, no Python per tensor.
        addresses = np.fromiter(map(torch.Tensor.data_ptr, sources), dtype=np.uint64, count=len(names))
        addresses[~np.fromiter(map(torch.Tensor.is_contiguous, sources), dtype=bool, count=len(names))] = 0
        later = self._safe_mask(layout) & (addresses != 0)
        if layout.complex_names:  # a conjugate or negative view's bytes are not its values: copy now
            for name in layout.complex_names:
                t = tensors[name]
                if t.is_conj() or t.is_neg():
                    later[layout.index[name]] = False
        groups: list[tuple[int, np.ndarray]] = []
        if later.all():
            idx = np.arange(len(names))
        else:
            now = np.flatnonzero(~later)
            for i in now.tolist():
                off, n = int(layout.slot_offsets[i]), int(layout.lengths[i])
                t = sources[i].detach().resolve_conj().resolve_neg().contiguous()
                slot.tensor[off:off + n].copy_(t.reshape(-1).view(torch.uint8))
            groups.append((batch.add_many(path, slot.bytes, layout.file_offsets[now], layout.slot_offsets[now],
                                          layout.lengths[now]), now))
            idx = np.flatnonzero(later)
        if len(idx):
            groups.append((batch.add_many(path, slot.bytes, layout.file_offsets[idx], layout.slot_offsets[idx],
                                          layout.lengths[idx], addresses[idx]), idx))
        template = layout.template_items()
        assert template is not None
        batch.add_many(path, *template)
        job = _Job(handle, step, tmp, fname, flat.meta, layout, slot, batch, {}, started, staging=self._staging,
                   sources={"tensors": sources}, placement=self.placement_fields(flat), groups=groups)
        batch.start()
        return job

    def _safe_mask(self, layout: Layout) -> np.ndarray:
        """Which of ``layout.names`` only ``optimizer.step()`` mutates (cached per layout)."""
        cached = self._safe_masks.get(id(layout))
        if cached is None or cached[0] is not layout:
            cached = self._safe_masks[id(layout)] = (layout, np.array([self._is_safe(n) for n in layout.names],
                                                                      dtype=bool))
        return cached[1]

    def _stage_ring(self, flat: Flat, step: int, handle: SaveHandle, tmp: Path, fname: str, staging: Staging,
                    tensors: dict[str, torch.Tensor], started: float) -> _Job:
        """Ring: keep views of the sources; the finisher streams them through the ring."""
        assert staging.ring is not None
        sources: dict[str, Any] = {}
        cuda_device: torch.device | None = None
        for name, t in tensors.items():
            if not staging.layout.entries[name].nbytes:
                continue
            if not (self._is_safe(name) and t.is_contiguous()):
                # Mutated outside optimizer.step() (small) or not contiguous: a private copy now
                # (on the device for CUDA tensors, queued on the training stream, no host sync).
                t = t.detach().clone(memory_format=torch.contiguous_format)
            if t.is_cuda:
                cuda_device = t.device
            sources[name] = flat_bytes(t)
        stream = ready = None
        if cuda_device is not None:
            stream = self._side_stream(cuda_device)
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(cuda_device))
        job = _Job(handle, step, tmp, fname, flat.meta, staging.layout, None, None, {},
                   started, staging=staging, sources=sources, placement=self.placement_fields(flat),
                   ring=RingStream(staging.ring, self._pool, direct=self.direct, stream=stream, ready=ready))
        return job

    def _side_stream(self, device: torch.device) -> Any:
        if self._stream is None or self._stream.device != device:
            self._stream = torch.cuda.Stream(device=device)
        return self._stream

    def _copy_to_host(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[Any, tuple[Any, Any, int]]:
        """D2H copies on a side stream into pinned staging; returns the done event and timing events."""
        stream = self._side_stream(pairs[0][1].device)
        stream.wait_stream(torch.cuda.current_stream(pairs[0][1].device))
        begin, end = (torch.cuda.Event(enable_timing=True),
                      torch.cuda.Event(enable_timing=True, blocking=True))  # the launcher sleeps on it
        with torch.cuda.stream(stream):
            begin.record(stream)
            for dst, src in pairs:
                dst.copy_(src.detach().reshape(-1).view(torch.uint8), non_blocking=True)
            end.record(stream)
        return end, (begin, end, sum(d.numel() for d, _ in pairs))

    # -- background ------------------------------------------------------------

    def _finish_loop(self) -> None:
        """The finisher thread: persist, commit (background group), finish handles in order."""
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                self._finish(job)
            finally:
                self._queue.task_done()  # ``_queue.join()``: every queued save finished, its trash too

    def _finish(self, job: _Job) -> None:
        error: BaseException | None = job.error
        record: dict[str, Any] | None = None
        if error is None:
            try:
                crcs = self._persist_ring(job) if job.ring is not None else self._persist_slot(job)
                if job.layout is not None and not job.layout.state_bytes:
                    _fsync(job.tmp / job.fname)  # no data item: no writer synced the HDF5 metadata
                record = self._record(job, crcs)
                self.stats.persist_s.append(time.monotonic() - job.started)
            except Exception as exc:  # every rank must still take part in the commit exchange
                error = exc
            finally:
                job.copied.set()
                job.sources = None
                if job.slot is not None:
                    job.persisted = error is None  # only its commit is left (``_busy``)
                    self._free_slot(job.slot)  # notifies under _cond
        try:
            path = self.commit_step(job.step, job.tmp, record, error, job.started, ranks=self._bg_ranks,
                                    final=job.handle.final)
        except Exception as exc:
            job.handle.finish(error=exc)
        else:
            job.handle.finish(path=path, save_s=time.monotonic() - job.started)
        with self._cond:
            self._inflight.remove(job)
            self._cond.notify_all()
        try:
            self.empty_trash()  # after the handle: a save is durable without old files unlinked
        except Exception as exc:  # noqa: BLE001 - never the finisher's end; a later discard sweeps
            log.warning("hpcckpt: could not delete pruned checkpoints: %s", exc)

    def _persist_slot(self, job: _Job) -> dict[str, int]:
        """Finisher thread: wait for the D2H (if any), then for the batch; crcs by name."""
        if job.cuda_event is not None:
            job.launched.wait()  # the launcher started the batch once the D2H was done
            if job.launch_error is not None:
                raise job.launch_error
            if job.d2h_events is not None:
                begin, end, nbytes = job.d2h_events
                self.stats.d2h_bytes += nbytes
                self.stats.d2h_s += begin.elapsed_time(end) / 1000.0
        job.batch.wait()
        job.copied.set()
        crcs = {name: job.batch.crc(i) for name, i in job.items.items()}
        assert job.layout is not None
        names = job.layout.names
        for first, idx in job.groups:
            got = np.frombuffer(job.batch.crcs(first, len(idx)), dtype=np.uint32).tolist()
            crcs.update(zip(names, got) if len(idx) == len(names) else ((names[i], c) for i, c in zip(idx.tolist(), got)))
        return crcs

    def _persist_ring(self, job: _Job) -> dict[str, int]:
        """Finisher thread: stream the sources through the ring; crcs by name."""
        assert job.ring is not None and job.sources is not None
        stream = job.ring
        try:
            stream.copy_all(str(job.tmp / job.fname), job.sources)
            job.sources = None
            job.copied.set()  # optimizer.step() may go on
            crcs = stream.finish()
        except BaseException:
            stream.abandon()
            raise
        self.stats.d2h_bytes += stream.result.d2h_bytes
        self.stats.d2h_s += stream.result.d2h_s
        return crcs

    def _record(self, job: _Job, crcs: dict[str, int]) -> dict[str, Any]:
        assert job.layout is not None
        return {"file": job.fname, "format": "hdf5", "meta": job.meta, "tensors": job.layout.record(crcs),
                **job.placement}

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

    # -- lifecycle ---------------------------------------------------------------

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
