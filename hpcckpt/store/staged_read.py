"""Restore onto the GPU: file -> pinned host chunks -> device tensors, reads overlapped with copies.

A CUDA tensor cannot be a target of ``pread``, so its bytes pass through host
memory. Reading the whole state into fresh host tensors and letting
``load_state_dict`` copy it up costs a first touch of every page and a second
full copy; instead the tensors are cut into rounds (``hostmem.plan_rounds``) that
stream through a few pinned chunks::

    reader threads  read rounds r, r+1 into chunks r % n, (r+1) % n (native
                    read_items: parallel preads, O_DIRECT, crc32c of every piece
                    as it lands; two calls at once so neither's tail idles the disk)
    calling thread  H2D copies of round r on a side stream, straight into the
                    live tensors; the chunk is reused once its copies are done

so the copies of round r overlap the reads of rounds r+1 .. r+n-1. Checksums are
verified per tensor (pieces combined) by the caller. CPU targets work too (a
plain copy instead of the H2D), which is how the pipeline is tested without a GPU.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

import torch

from .._core import native
from ..config import TUNABLES, env_value
from .entry import ALIGN, TensorEntry
from .hostmem import Piece, Slot, make_slots, one_cuda_device, plan_rounds

log = logging.getLogger("hpcckpt.store.staged_read")

# one read_items call: enough pieces to keep every reader thread busy (HPCCKPT_RESTORE_CHUNK_BYTES)
ROUND_BYTES: int = TUNABLES["restore_chunk_bytes"].default
ROUND_CHUNKS = 3  # two being read, one being copied up
ROUND_READERS = 2  # rounds read at once: the disk stays busy while one call waits for its slowest thread


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


class StagedReader:
    """Reads ``(entry, live tensor)`` targets of one file through pinned chunks.

    ``read()`` returns each target's crc32c (its pieces combined) and fills
    ``info`` with the reader's byte counts plus ``staged_bytes`` and ``rounds``.
    """

    def __init__(self, path: str | os.PathLike[str], targets: Sequence[tuple[TensorEntry, torch.Tensor]], *,
                 direct: bool, threads: int = 0, chunk_bytes: int | None = None,
                 chunks: int | None = None, pin: bool | None = None, fd: int = -1) -> None:
        self.path = str(path)
        self.fd = fd  # the checked descriptor every read goes through (-1: the reader opens path)
        self.targets = {e.name: (e, _flat(t)) for e, t in targets if e.nbytes}
        self.direct, self.threads = direct, threads
        size = chunk_bytes or env_value("restore_chunk_bytes")
        size = max(2 * ALIGN, size // ALIGN * ALIGN)
        # Each round is one read_items call: pieces small enough that every reader thread has
        # some (its default 16 MiB would leave most of 16 threads idle on a 128 MiB round).
        self.read_chunk = max(1 << 20, min(16 << 20, size // 16))
        self.rounds = plan_rounds([e for e, _ in self.targets.values()], size)
        self.device = one_cuda_device((t.device for _, t in self.targets.values()), f"restore of {self.path}")
        n = max(1, min(chunks or ROUND_CHUNKS, len(self.rounds)))
        # Unpinned, untouched memory: the first reads fault it in while a thread pins the
        # chunks in turn (cudaHostRegister of a few hundred MiB is tens of milliseconds,
        # about a round's read), and a round's H2D copies wait for its chunk's pinning.
        self.chunks = make_slots(n, size, pin=False, prefault=False) if self.rounds else []
        self._pinned = [threading.Event() for _ in self.chunks]
        self._pinner: threading.Thread | None = None
        if (self.device is not None if pin is None else pin) and self.chunks:
            self._pinner = threading.Thread(target=self._pin_chunks, name="hpcckpt-pin", daemon=True)
            self._pinner.start()
        else:
            for e in self._pinned:
                e.set()
        self.info: dict[str, int] = {"staged_bytes": 0, "rounds": len(self.rounds)}
        self._info_lock = threading.Lock()

    def _pin_chunks(self) -> None:
        """Pinning thread: register each chunk on the device's context, in the order rounds use them."""
        try:
            with torch.cuda.device(self.device) if self.device is not None else contextlib.nullcontext():
                for chunk, pinned in zip(self.chunks, self._pinned):
                    try:
                        chunk.pin()
                    finally:
                        pinned.set()
        except BaseException:
            log.warning("hpcckpt: pinning the restore chunks failed; copies go from pageable memory", exc_info=True)
        finally:
            for e in self._pinned:
                e.set()

    def read(self) -> dict[str, int]:
        """Read every round; returns crc32c by tensor name. Calling thread, blocks until done."""
        pieces: dict[str, list[tuple[int, int, int]]] = {}
        stream = torch.cuda.Stream(device=self.device) if self.device is not None else None
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))  # pending work on the targets first
        n = len(self.chunks)
        done: list[Any] = [None] * n  # per chunk: the event after its last copies
        readers = max(1, min(ROUND_READERS, n - 1))
        with concurrent.futures.ThreadPoolExecutor(readers, thread_name_prefix="hpcckpt-read") as pool:
            futures: dict[int, concurrent.futures.Future[list[int]]] = {}

            def submit(r: int) -> None:
                if r < len(self.rounds):
                    if done[r % n] is not None:
                        done[r % n].synchronize()  # the chunk's previous copies are finished
                    futures[r] = pool.submit(self._read_round, r)
            try:
                for r in range(n):
                    submit(r)
                for r, round_pieces in enumerate(self.rounds):
                    crcs = futures.pop(r).result()
                    for p, crc in zip(round_pieces, crcs):
                        pieces.setdefault(p.name, []).append((p.src_off, crc, p.nbytes))
                    self._pinned[r % n].wait()  # pinned (or given up on): an async copy may read it
                    done[r % n] = self._copy_up(self.chunks[r % n], round_pieces, stream)
                    submit(r + n)
            finally:
                for f in futures.values():
                    f.cancel()
                concurrent.futures.wait(list(futures.values()))
                if stream is not None:
                    stream.synchronize()
        return _combine(pieces)

    def release(self) -> None:
        """Unpin and drop the chunks. CUDA: on a thread of its own (unregistering takes about as
        long as registering), after every copy from them is done (``read`` synchronises)."""
        chunks, self.chunks = self.chunks, []
        if self._pinner is not None:
            self._pinner.join()
            self._pinner = None
        if not any(c.pinned for c in chunks):
            return

        device = self.device

        def unpin() -> None:  # on the context that registered them
            with torch.cuda.device(device) if device is not None else contextlib.nullcontext():
                for c in chunks:
                    c.release()
        threading.Thread(target=unpin, name="hpcckpt-unpin").start()

    def _read_round(self, r: int) -> list[int]:
        """Reader thread: one native read_items call for round r into its chunk."""
        chunk = self.chunks[r % len(self.chunks)]
        items = [(chunk.bytes[p.chunk_off:p.chunk_off + p.nbytes], p.file_off, False) for p in self.rounds[r]]
        crcs, info = native().read_items(self.path, items, threads=self.threads, chunk_bytes=self.read_chunk,
                                         direct=self.direct, fd=self.fd)
        with self._info_lock:  # two reader threads
            for key in ("direct_bytes", "buffered_bytes", "bounced_bytes"):
                self.info[key] = self.info.get(key, 0) + int(info.get(key, 0))
            self.info["threads"] = int(info.get("threads", 0))
            self.info["staged_bytes"] += sum(p.nbytes for p in self.rounds[r])
        return [int(c) for c in crcs]

    def _copy_up(self, chunk: Slot, pieces: list[Piece], stream: Any) -> Any:
        """Copy one round from its chunk into the targets; an event marking the copies done (CUDA)."""
        if stream is None:
            for p in pieces:
                self.targets[p.name][1][p.src_off:p.src_off + p.nbytes].copy_(
                    chunk.tensor[p.chunk_off:p.chunk_off + p.nbytes])
            return None
        with torch.cuda.stream(stream):
            for p in pieces:
                self.targets[p.name][1][p.src_off:p.src_off + p.nbytes].copy_(
                    chunk.tensor[p.chunk_off:p.chunk_off + p.nbytes], non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return event


def _combine(pieces: dict[str, list[tuple[int, int, int]]]) -> dict[str, int]:
    combine = native().crc32c_combine
    out: dict[str, int] = {}
    for name, parts in pieces.items():
        crc = 0
        for i, (_, c, n) in enumerate(sorted(parts)):
            crc = c if i == 0 else int(combine(crc, c, n))
        out[name] = crc
    return out


def read_staged(path: str | os.PathLike[str], targets: Sequence[tuple[TensorEntry, torch.Tensor]], *,
                direct: bool, threads: int = 0, chunk_bytes: int | None = None, chunks: int | None = None,
                info: dict[str, int] | None = None, fd: int = -1) -> dict[str, int]:
    """Read ``targets`` in place through pinned chunks; returns crc32c by name (not yet verified).

    ``fd``: the file's checked descriptor (``commit.open_checked``); every read goes through
    it, never by name (-1: the native reader opens ``path`` itself, O_NOFOLLOW|O_NONBLOCK).

    For CUDA targets the chunks are pinned by a thread while the first rounds are read, and
    unpinned (then freed) by another once every copy from them is done.
    """
    reader = StagedReader(path, targets, direct=direct, threads=threads, chunk_bytes=chunk_bytes, chunks=chunks,
                          fd=fd)
    try:
        crcs = reader.read()
    finally:
        reader.release()
    if info is not None:
        info.update(reader.info)
    return crcs
