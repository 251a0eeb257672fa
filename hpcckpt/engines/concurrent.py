"""The concurrent engine (PCcheck-style): the snapshot overlaps the next step's compute.

Life of one save (step S)::

    save()            main thread, at the boundary after step S
      - waits for a free in-flight place (max_async) or skips (on_busy="skip")
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

Staging is a ring of ``max_async`` prefaulted, 4 KiB-aligned host buffers (pinned
when CUDA tensors are saved) sized from the registered state, allocated once per
layout: the hot path allocates nothing. PCcheck keeps ``max_async + 1`` buffers
because its snapshot fills one buffer before the persist of another may start;
here the copy and the persist of one save share its slot, so the spare would never
be used (it would cost a full copy of the state). A slot is freed once its bytes
are durable, before the commit, so an admitted save never waits for one. A failed
persist (ENOSPC, EIO) leaves the previous checkpoint untouched; its handle carries
the error and raises it once.
"""
from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .._core import native
from ..config import check_on_busy, from_env, parse_bool
from ..errors import CheckpointFailed, ConfigError
from ..state import Flat, TrainState
from ..store.hdf5 import ALIGN, TensorEntry, plan_file, raw_bytes
from .base import Engine, SaveContext, SaveHandle
from ..ranks import Ranks

log = logging.getLogger("hpcckpt.engines.concurrent")

_TEMPLATE_MAX_BYTES = 16 << 20  # larger metadata than this: plan each file afresh
Spec = tuple[str, torch.dtype, tuple[int, ...]]


def _round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def _data_segments(path: Path) -> tuple[list[tuple[int, bytes]], int] | None:
    """The non-hole bytes of a freshly planned (sparse) HDF5 file, and its size.

    A planned file holds only metadata; its datasets are unwritten holes, so the
    metadata is all a later save needs to rewrite (far cheaper than re-creating
    the HDF5 structure). None where the file system reports no holes.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        segments: list[tuple[int, bytes]] = []
        total, off = 0, 0
        while off < size:
            try:
                start = os.lseek(fd, off, os.SEEK_DATA)
            except OSError:
                break  # ENXIO: only a hole remains
            end = os.lseek(fd, start, os.SEEK_HOLE)
            total += end - start
            if total > _TEMPLATE_MAX_BYTES:
                return None
            segments.append((start, os.pread(fd, end - start, start)))
            off = end
        return segments, size
    finally:
        os.close(fd)


@dataclass
class Layout:
    """Where every tensor of this rank goes: file offsets and staging offsets.

    Shapes do not change between saves of one run, so a layout is computed once and
    reused until the set of tensors changes (e.g. the optimizer state appears after
    the first step).
    """

    specs: tuple[Spec, ...]
    entries: dict[str, TensorEntry]
    staging_offset: dict[str, int]
    slot_bytes: int
    template: tuple[list[tuple[int, bytes]], int] | None = None

    @staticmethod
    def plan(path: Path, specs: tuple[Spec, ...]) -> Layout:
        entries = plan_file(path, specs)
        offsets: dict[str, int] = {}
        cursor = 0
        for name, _, _ in specs:
            e = entries[name]
            # Same offset modulo 4 KiB in memory as in the file: O_DIRECT needs both aligned.
            cursor = _round_up(cursor, ALIGN) + e.offset % ALIGN
            offsets[name] = cursor
            cursor += e.nbytes
        return Layout(specs, entries, offsets, max(_round_up(cursor, ALIGN), ALIGN), _data_segments(path))

    def materialise(self, path: Path) -> None:
        """Create ``path`` as this layout's HDF5 file (data regions still holes)."""
        if self.template is None:
            entries = plan_file(path, self.specs)
            if entries != self.entries:
                raise ConfigError(f"{path}: HDF5 layout changed between saves; report this as a bug")
            return
        segments, size = self.template
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for offset, data in segments:
                view = memoryview(data)
                while view:
                    n = os.pwrite(fd, view, offset)
                    view, offset = view[n:], offset + n
            os.ftruncate(fd, size)
        finally:
            os.close(fd)


class Slot:
    """One reusable staging buffer (prefaulted; pinned when CUDA tensors are saved)."""

    def __init__(self, nbytes: int, *, pin: bool) -> None:
        self.buffer = native().aligned_buffer(nbytes, ALIGN, True)
        self.bytes = np.frombuffer(self.buffer, dtype=np.uint8)
        self.tensor = torch.from_numpy(self.bytes)
        self.pinned = False
        if pin:
            rc = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), nbytes, 0)
            self.pinned = int(rc) == 0
            if not self.pinned:
                log.warning("hpcckpt: cudaHostRegister of %d staging bytes failed (%s); D2H copies will be slower",
                            nbytes, rc)
        self.busy = False

    def release(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.pinned = False


@dataclass
class EngineStats:
    """What training saw: time inside save() and blocked in the optimizer pre-hook."""

    saves: int = 0
    skipped: int = 0
    save_call_s: float = 0.0
    hook_wait_s: float = 0.0
    persist_s: list[float] = field(default_factory=list)

    @property
    def stall_s(self) -> float:
        return self.save_call_s + self.hook_wait_s


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
    error: BaseException | None = None  # failed before persisting: only the commit exchange is left


class ConcurrentEngine(Engine):
    name = "concurrent"

    def __init__(self, ctx: SaveContext, ranks: Ranks, *, max_async: int = 1, writer_threads: int = 0,
                 memory_budget_bytes: int | None = None, direct: bool | None = None, on_busy: str | None = None,
                 chunk_bytes: int | None = None) -> None:
        super().__init__(ctx, ranks)
        if max_async < 1:
            raise ConfigError(f"max_async must be >= 1, got {max_async}")
        self.max_async = max_async
        self.on_busy = check_on_busy(on_busy if on_busy is not None else from_env("ON_BUSY", "wait", str))
        self.memory_budget_bytes = memory_budget_bytes if memory_budget_bytes is not None else from_env(
            "MEMORY_BUDGET_BYTES", None, int)  # type: ignore[arg-type]
        # O_DIRECT by default: on the reference VM buffered pwrite + fdatasync of 1 GB ran at
        # 0.3-0.5 GB/s, O_DIRECT at 1.7-2.0 GB/s (the page cache copy and writeback cost more
        # than they save). File systems that refuse O_DIRECT fall back to the page cache.
        self.direct = direct if direct is not None else from_env("DIRECT", True, parse_bool)
        self.stats = EngineStats()
        self._pool = native().WriterPool(writer_threads, chunk_bytes or from_env("CHUNK_BYTES", 8 << 20, int))
        self._bg_ranks = ranks.background()
        self._layout: Layout | None = None
        self._slots: list[Slot] = []
        self._cond = threading.Condition()
        self._inflight: list[_Job] = []
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._hooks: dict[int, Any] = {}
        self._safe: set[str] = set()
        self._safe_prefixes: tuple[str, ...] = ()
        self._stream: Any = None
        self._closed = False
        self._finisher = threading.Thread(target=self._finish_loop, name="hpcckpt-finisher", daemon=True)
        self._finisher.start()

    # -- registration ----------------------------------------------------------

    def bind(self, state: TrainState) -> None:
        """Hook every registered optimizer; main thread."""
        self._safe = state.background_safe()
        self._safe_prefixes = tuple(s for s in self._safe if s.endswith("/"))
        for obj in state.objects.values():
            if isinstance(obj, torch.optim.Optimizer) and id(obj) not in self._hooks:
                self._hooks[id(obj)] = obj.register_step_pre_hook(self._before_step)

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """optimizer.step() may overwrite parameters and state only once they are staged."""
        self.wait_copied()

    def wait_copied(self) -> float:
        """Block until every save in flight has copied its sources; returns the seconds blocked."""
        with self._cond:
            pending = [j for j in self._inflight if not j.copied.is_set()]
        if not pending:
            return 0.0
        t0 = time.monotonic()
        for job in pending:
            if job.cuda_event is not None:
                # The GPU orders optimizer.step() after the D2H copy; the host does not wait.
                torch.cuda.current_stream().wait_event(job.cuda_event)
            else:
                job.batch.wait_copied()
                job.copied.set()
        waited = time.monotonic() - t0
        self.stats.hook_wait_s += waited
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
        handle = SaveHandle(step)
        try:
            if not self._admit(step, final):
                handle.finish(error=CheckpointFailed(
                    f"checkpoint of step {step} under {self.ctx.root} skipped: {self.max_async} saves still in "
                    "flight (on_busy='skip'); raise max_async or save less often; the previous checkpoint is "
                    "untouched"))
                self.stats.skipped += 1
                return handle
            self._start(flat, step, handle, t0)
        finally:
            self.stats.save_call_s += time.monotonic() - t0
        return handle

    def _admit(self, step: int, final: bool) -> bool:
        """Wait for an in-flight place (or, with on_busy='skip', decide to skip)."""
        with self._cond:
            busy = len(self._inflight) >= self.max_async
        if self.on_busy == "skip" and not final:
            # Every rank must take the same decision, or the commit exchange would mismatch.
            if self.ranks.any(int(busy)):
                log.warning("hpcckpt: skipping checkpoint of step %d: %d saves in flight (on_busy=skip)",
                            step, self.max_async)
                return False
            return True
        if busy:
            log.info("hpcckpt: checkpoint of step %d waits: %d saves in flight (max_async=%d)",
                     step, self.max_async, self.max_async)
        with self._cond:
            self._cond.wait_for(lambda: len(self._inflight) < self.max_async)
        return True

    def _start(self, flat: Flat, step: int, handle: SaveHandle, started: float) -> None:
        """Stage the save and queue it for the finisher.

        A failure here (file creation, staging) still queues the save, marked failed:
        every rank must take part in each commit exchange, or a rank that failed would
        leave the others waiting in it, or pair their step with its next one. The
        failure then reaches every rank through the handle; a ConfigError is also
        raised here, because the user has to fix it.
        """
        tensors = dict(flat.tensors)
        specs = tuple((n, t.dtype, tuple(t.shape)) for n, t in tensors.items())
        tmp = self.temp_path(step)
        fname = f"rank-{self.ranks.rank}.h5"
        slot: Slot | None = None
        try:
            tmp.mkdir(mode=0o700, parents=True, exist_ok=True)
            layout = self._ensure_layout(tmp / fname, specs, tensors)
            slot = self._take_slot()
            job = self._stage(flat, step, handle, tmp, fname, layout, slot, tensors, started)
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

    def _ensure_layout(self, path: Path, specs: tuple[Spec, ...], tensors: dict[str, torch.Tensor]) -> Layout:
        if self._layout is not None and self._layout.specs == specs:
            self._layout.materialise(path)
            return self._layout
        # New tensors (first save, or optimizer state appeared): wait until no batch uses the old slots.
        with self._cond:
            self._cond.wait_for(lambda: not any(s.busy for s in self._slots))
        for s in self._slots:
            s.release()
        self._slots = []
        layout = Layout.plan(path, specs)
        pin = any(t.is_cuda for t in tensors.values()) and torch.cuda.is_available()
        n = self._slot_count(layout.slot_bytes)
        self._slots = [Slot(layout.slot_bytes, pin=pin) for _ in range(n)]
        self._layout = layout
        log.info("hpcckpt: staging %d slots x %d bytes (%s)", n, layout.slot_bytes, "pinned" if pin else "pageable")
        return layout

    def _slot_count(self, slot_bytes: int) -> int:
        wanted = self.max_async
        if self.memory_budget_bytes is None:
            return wanted
        fits = self.memory_budget_bytes // slot_bytes
        if fits < 1:
            raise ConfigError(
                f"memory_budget_bytes={self.memory_budget_bytes} cannot hold one staging copy of this rank's "
                f"state ({slot_bytes} bytes); raise HPCCKPT_MEMORY_BUDGET_BYTES or use the sync engine")
        if fits < wanted:
            log.warning("hpcckpt: memory budget allows %d staging slots of %d bytes, not %d; "
                        "max_async lowered to %d", fits, slot_bytes, wanted, fits)
            self.max_async = fits
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
               slot: Slot, tensors: dict[str, torch.Tensor], started: float) -> _Job:
        batch = native().Batch(self._pool, self.direct)
        path = str(tmp / fname)
        items: dict[str, int] = {}
        gpu: list[tuple[torch.Tensor, torch.Tensor]] = []
        for name, t in tensors.items():
            e = layout.entries[name]
            if not e.nbytes:
                continue
            off = layout.staging_offset[name]
            dst = slot.bytes[off:off + e.nbytes]
            if self._is_safe(name) and t.is_contiguous():
                if t.is_cuda:
                    gpu.append((slot.tensor[off:off + e.nbytes], t))
                    items[name] = batch.add(path, e.offset, dst)
                else:
                    items[name] = batch.add(path, e.offset, dst, raw_bytes(t))
            else:
                # Mutated outside optimizer.step() (or not contiguous): copy now.
                slot.tensor[off:off + e.nbytes].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
                items[name] = batch.add(path, e.offset, dst)
        job = _Job(handle, step, tmp, fname, json.loads(json.dumps(flat.meta)), layout, slot, batch, items, started)
        if gpu:
            job.cuda_event = self._copy_to_host(gpu)
        else:
            batch.start()
        return job

    def _copy_to_host(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        """D2H copies on a side stream into pinned staging; returns the event that marks them done."""
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            for dst, src in pairs:
                dst.copy_(src.detach().reshape(-1).view(torch.uint8), non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        return event

    # -- background ------------------------------------------------------------

    def _finish_loop(self) -> None:
        """The finisher thread: persist, commit (background group), finish handles in order."""
        while True:
            job = self._queue.get()
            if job is None:
                return
            self._finish(job)

    def _finish(self, job: _Job) -> None:
        error: BaseException | None = job.error
        record: dict[str, Any] | None = None
        if error is None:
            assert job.slot is not None
            try:
                if job.cuda_event is not None:
                    job.cuda_event.synchronize()
                    job.batch.start()
                job.batch.wait()
                job.copied.set()
                record = self._record(job)
                self.stats.persist_s.append(time.monotonic() - job.started)
            except Exception as exc:  # every rank must still take part in the commit exchange
                error = exc
                job.copied.set()
            finally:
                self._free_slot(job.slot)
        try:
            path = self.commit_step(job.step, job.tmp, record, error, job.started, ranks=self._bg_ranks)
        except Exception as exc:
            job.handle.finish(error=exc)
        else:
            job.handle.finish(path=path, save_s=time.monotonic() - job.started)
        with self._cond:
            self._inflight.remove(job)
            self._cond.notify_all()

    def _record(self, job: _Job) -> dict[str, Any]:
        assert job.layout is not None
        tensors: dict[str, Any] = {}
        for name, e in job.layout.entries.items():
            crc = job.batch.crc(job.items[name]) if name in job.items else 0
            tensors[name] = TensorEntry(e.name, e.dtype, e.shape, e.offset, e.nbytes, crc).to_json()
        return {"file": job.fname, "format": "hdf5", "meta": job.meta, "tensors": tensors}

    # -- lifecycle ---------------------------------------------------------------

    def pending(self) -> list[SaveHandle]:
        with self._cond:
            return [j.handle for j in self._inflight]

    def drain(self) -> None:
        """Wait until no save is in flight (their errors stay with their handles)."""
        with self._cond:
            self._cond.wait_for(lambda: not self._inflight)

    def close(self) -> None:
        """Wait for saves in flight, stop the finisher, unhook optimizers. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.drain()
        self._queue.put(None)
        self._finisher.join()
        for hook in self._hooks.values():
            hook.remove()
        self._hooks.clear()
        self._pool.close()
        for s in self._slots:
            s.release()

