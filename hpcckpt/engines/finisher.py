"""The concurrent engine's finisher thread (``ConcurrentEngine``'s background part): each save in
step order waits for its bytes (the launcher's D2H and native batch, or the ring's stream), is
made durable, gets its rank record with per-tensor crc32c, frees its slot, takes part in the
commit exchange over the background process group, and finishes its handle; then the steps the
commit pruned are deleted.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..ranks import Ranks
from ..store.names import HDF5, rank_record
from .base import Engine
from .job import SaveJob
from .staging import EngineStats, Slot

log = logging.getLogger("hpcckpt.engines.concurrent")


def _fsync(path: Path) -> None:
    """Make a file written without the native writers durable (before its commit)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Finisher(Engine):
    """The finisher part of ``ConcurrentEngine`` (a mixin: the engine holds the state below)."""

    stats: EngineStats
    _cond: threading.Condition
    _inflight: list[SaveJob]
    _queue: queue.Queue[SaveJob | None]
    _bg_ranks: Ranks
    if TYPE_CHECKING:
        def _free_slot(self, slot: Slot) -> None: ...

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

    def _finish(self, job: SaveJob) -> None:
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

    def _persist_slot(self, job: SaveJob) -> dict[str, int]:
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

    def _persist_ring(self, job: SaveJob) -> dict[str, int]:
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

    def _record(self, job: SaveJob, crcs: dict[str, int]) -> dict[str, Any]:
        assert job.layout is not None
        return rank_record(file=job.fname, fmt=HDF5, meta=job.meta, tensors=job.layout.record(crcs), **job.placement)
