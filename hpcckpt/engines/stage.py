"""How a save of the concurrent engine reaches its staging (``ConcurrentEngine``'s first part).

A full-copy slot (``_stage``): nothing on a GPU and a metadata template, all tensors in a few
native calls (``_stage_host``); else tensor by tensor by route (``routes``, ``_stage_each``), the
GPU's share copied down on a side stream and the save's native batch started by the launcher
thread once that copy is done. A ring (``_stage_ring``): views of the sources, streamed through
the ring by the finisher. Slots are taken here and freed by the finisher once durable.
"""
from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .._core import native
from ..state import Flat
from ..store import catalog
from ..store.entry import raw_bytes
from ..store.layout import Layout
from .base import Engine, SaveHandle
from .job import SaveJob
from .recycle import Recycler
from .staging import RingStream, Slot, Staging, flat_bytes

# How one tensor reaches its save's staging slot (``_routes``).
DEVICE = "device"              # CUDA, only optimizer.step() mutates it: D2H on the side stream
DEVICE_CLONE = "device_clone"  # CUDA, mutated elsewhere too: a device clone now, then D2H
HOST_NOW = "host_now"          # CPU: copied into the slot now, on the main thread
HOST_BATCH = "host_batch"      # CPU, only optimizer.step() mutates it: copied by the native writers


def routes(tensors: dict[str, torch.Tensor], is_safe: Callable[[str], bool], *,
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


class Stager(Engine):
    """The staging part of ``ConcurrentEngine`` (a mixin: the engine holds the state below)."""

    _cond: threading.Condition
    _staging: Staging | None
    _pool: Any
    direct: bool
    _recycler: Recycler | None
    _launcher: threading.Thread | None
    _launch_queue: queue.Queue[SaveJob | None]
    _stream: Any
    _safe_masks: dict[int, tuple[Layout, np.ndarray]]
    if TYPE_CHECKING:
        def _is_safe(self, name: str) -> bool: ...

    @property
    def _slots(self) -> list[Slot]:
        """The full-copy slots in use (empty with a ring)."""
        return self._staging.slots if self._staging else []

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
               slot: Slot, tensors: dict[str, torch.Tensor], started: float, *, reused: bool = False) -> SaveJob:
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
                    slot: Slot, tensors: dict[str, torch.Tensor], started: float) -> SaveJob:
        batch = native().Batch(self._pool, self.direct)
        path = str(tmp / fname)
        items: dict[str, int] = {}
        gpu: list[tuple[torch.Tensor, torch.Tensor]] = []
        clones: dict[str, Any] = {}
        for name, route in routes(tensors, self._is_safe).items():
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
        job = SaveJob(handle, step, tmp, fname, flat.meta, layout, slot, batch, items, started,
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
                    slot: Slot, tensors: dict[str, torch.Tensor], started: float) -> SaveJob:
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
        job = SaveJob(handle, step, tmp, fname, flat.meta, layout, slot, batch, {}, started, staging=self._staging,
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
                    tensors: dict[str, torch.Tensor], started: float) -> SaveJob:
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
        job = SaveJob(handle, step, tmp, fname, flat.meta, staging.layout, None, None, {},
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
