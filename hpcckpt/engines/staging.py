"""Host staging for the concurrent engine: full slots, or a ring of chunks under a budget.

Two shapes of staging, both allocated once per layout and off the step path when
the engine can (``ConcurrentEngine.prepare``):

- ``Slot``: one buffer holding a whole copy of the rank's state; one per save in
  flight (``max_async``). The copy and the persist of one save share it.
- ``Ring``: ``staging_bytes`` split into chunks that the state streams through.
  The state is cut into *rounds*, one chunk each (``plan_rounds``); a round's
  pieces are copied into its chunk (native memcpy for CPU sources, D2H on a side
  stream for CUDA ones), then written by one native Batch; the chunk is reused
  once that batch is durable. Sources are fully copied only once the last round
  is copied, so with a ring smaller than the state, ``optimizer.step()`` waits
  for part of the persist: that wait is the price of the smaller budget.

State machine of one round (``RingStream``)::

    wait chunk free (the batch of round r - chunks is durable)
      -> copy pieces into the chunk (CPU: inside the batch; CUDA: D2H + event sync)
      -> batch.start(): pwrite + fdatasync on the writer pool
      -> retired: per-piece crc32c collected, chunk free

Memory stays 4 KiB aligned and each piece sits at the same offset modulo 4 KiB in
the chunk as in the file, so the writers can use O_DIRECT without a bounce buffer.
"""
from __future__ import annotations

import logging
import operator
import os
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .._core import native
from ..errors import ConfigError
from ..store.entry import ALIGN, TensorEntry
from ..store.hostmem import Piece, Slot, make_slots, plan_rounds, round_up
from ..store.layout import Layout, Spec

__all__ = ["ALIGN", "EngineStats", "Key", "Piece", "Ring", "RingStream", "Slot", "Staging", "auto_staging_bytes",
           "flat_bytes", "plan_rounds", "ring_shape"]

# A staging's identity: (name, dtype, shape) of each tensor, and the CUDA device whose
# copies it serves (pinned then), or None when nothing is on a GPU.
Key = tuple[tuple[Spec, ...], int | None]

log = logging.getLogger("hpcckpt.engines.staging")

RING_CHUNK_BYTES = 64 << 20  # default size of one ring chunk: big enough for full-speed pwrite
MIN_RING_CHUNKS = 2  # one chunk being written while the next is filled

# staging_bytes="auto" (the default through a Checkpointer): a ring of a quarter of the state,
# so the engine never holds a second copy of the job's state; a full copy up to AUTO_FULL_BYTES
# (a small state's copy costs little memory, and a ring would make each save wait for its
# persist); never more than a share of the memory the node has available now.
AUTO_STAGING_FRACTION = 0.25
AUTO_FULL_BYTES = 64 << 20
AUTO_NODE_SHARE = 0.25  # of MemAvailable, split between the node's ranks


def local_ranks() -> int:
    """Ranks on this node as the launcher says (torchrun, Slurm); 1 when it does not."""
    for var in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        raw = os.environ.get(var, "").split("(")[0].split(",")[0].strip()
        if raw.isdigit() and int(raw) > 0:
            return int(raw)
    return 1


def auto_staging_bytes(state_bytes: int, *, available: int | None, ranks_here: int = 1,
                       budget: int | None = None) -> int | None:
    """The staging ``staging_bytes="auto"`` gives a state of ``state_bytes``: None for a full copy,
    else a ring's byte count.

    ``available``: the node's ``MemAvailable`` (None: unknown, not a limit); ``ranks_here``:
    the ranks sharing it; ``budget``: ``memory_budget_bytes`` when set (a cap as well).
    """
    want = max(min(state_bytes, AUTO_FULL_BYTES), int(state_bytes * AUTO_STAGING_FRACTION))
    if available is not None:  # never below 2 chunks of 4 MiB: the least ring worth streaming through
        want = min(want, max(MIN_RING_CHUNKS * (4 << 20), int(available * AUTO_NODE_SHARE) // max(1, ranks_here)))
    if budget is not None:
        want = min(want, budget)
    return None if want >= state_bytes else want


def ring_shape(staging_bytes: int, state_bytes: int, chunk_bytes: int | None = None) -> tuple[int, int]:
    """``(chunks, chunk_bytes)`` for a ring within ``staging_bytes``.

    Never more than the state needs (plus alignment slack), at least
    ``MIN_RING_CHUNKS`` chunks so the copy of one round overlaps the write of another.
    """
    if staging_bytes < MIN_RING_CHUNKS * 2 * ALIGN:
        raise ConfigError(
            f"staging_bytes={staging_bytes} is too small for a staging ring (at least "
            f"{MIN_RING_CHUNKS * 2 * ALIGN} bytes); raise HPCCKPT_STAGING_BYTES or leave it unset "
            "for a full copy per save in flight")
    budget = min(staging_bytes, round_up(state_bytes, ALIGN) + MIN_RING_CHUNKS * 2 * ALIGN)
    size = chunk_bytes or RING_CHUNK_BYTES
    size = min(size, budget // MIN_RING_CHUNKS) // ALIGN * ALIGN
    size = max(size, 2 * ALIGN)
    return max(MIN_RING_CHUNKS, budget // size), size


class Ring:
    """``chunks`` staging chunks of ``chunk_bytes`` and the rounds of one layout."""

    def __init__(self, chunks: int, chunk_bytes: int, entries: Iterable[TensorEntry], *, pin: bool) -> None:
        self.chunk_bytes = chunk_bytes
        self.rounds = plan_rounds(entries, chunk_bytes)
        # No more chunks than rounds: a state smaller than the budget needs no spare memory.
        self.chunks = make_slots(max(1, min(chunks, len(self.rounds))), chunk_bytes, pin=pin)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.chunks)

    @property
    def pinned(self) -> bool:
        return any(c.pinned for c in self.chunks)

    def release(self) -> None:
        for c in self.chunks:
            c.release()


@dataclass
class StreamResult:
    """What one pass of the state through the ring produced."""

    crcs: dict[str, int] = field(default_factory=dict)
    d2h_bytes: int = 0
    d2h_s: float = 0.0


class RingStream:
    """Stream one save's sources through a ``Ring``; runs on the finisher thread.

    ``sources``: flat uint8 views by tensor name, a NumPy array (CPU, copied by the
    native writers) or a CUDA tensor (copied on ``stream`` after ``ready``, an
    event recorded on the training stream when the save began).
    """

    def __init__(self, ring: Ring, pool: Any, *, direct: bool, stream: Any = None, ready: Any = None) -> None:
        self.ring, self.pool, self.direct = ring, pool, direct
        self.stream, self.ready = stream, ready
        self._inflight: deque[tuple[Any, list[tuple[Piece, int]]]] = deque()
        self._pieces: dict[str, list[tuple[int, int, int]]] = {}
        self.result = StreamResult()

    def copy_all(self, path: str, sources: Mapping[str, np.ndarray | torch.Tensor]) -> None:
        """Issue every round; returns once every source byte is in host staging.

        With a ring smaller than the state this waits for earlier rounds to be
        durable (their chunks are reused). Raises the first I/O error.
        """
        if self.stream is not None and self.ready is not None:
            self.stream.wait_event(self.ready)
        n = len(self.ring.chunks)
        for r, pieces in enumerate(self.ring.rounds):
            if len(self._inflight) >= n:
                self._retire()
            self._issue(path, self.ring.chunks[r % n], pieces, sources)
        for batch, _ in self._inflight:
            batch.wait_copied()

    def finish(self) -> dict[str, int]:
        """Wait until every round is durable; return each tensor's crc32c (pieces combined)."""
        while self._inflight:
            self._retire()
        combine = native().crc32c_combine
        for name, parts in self._pieces.items():
            crc = 0
            for i, (_, c, n) in enumerate(sorted(parts)):
                crc = c if i == 0 else combine(crc, c, n)
            self.result.crcs[name] = crc
        return self.result.crcs

    def abandon(self) -> None:
        """After a failure: wait for the batches in flight so no chunk is written while reused."""
        while self._inflight:
            batch, _ = self._inflight.popleft()
            try:
                batch.wait()
            except OSError:
                pass  # the first error is already on its way to the handle

    def _issue(self, path: str, chunk: Slot, pieces: list[Piece],
               sources: Mapping[str, np.ndarray | torch.Tensor]) -> None:
        batch = native().Batch(self.pool, self.direct)
        items: list[tuple[Piece, int]] = []
        gpu: list[tuple[torch.Tensor, torch.Tensor]] = []
        for p in pieces:
            dst = chunk.bytes[p.chunk_off:p.chunk_off + p.nbytes]
            src = sources[p.name]
            if isinstance(src, torch.Tensor):
                gpu.append((chunk.tensor[p.chunk_off:p.chunk_off + p.nbytes], src[p.src_off:p.src_off + p.nbytes]))
                items.append((p, batch.add(path, p.file_off, dst)))
            else:
                items.append((p, batch.add(path, p.file_off, dst, src[p.src_off:p.src_off + p.nbytes])))
        if gpu:
            self._copy_to_host(gpu)
        batch.start()
        self._inflight.append((batch, items))

    def _copy_to_host(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """D2H of one round on the side stream; waits for it (the batch reads the chunk next)."""
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            begin.record(self.stream)
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            end.record(self.stream)
        end.synchronize()
        self.result.d2h_bytes += sum(d.numel() for d, _ in pairs)
        self.result.d2h_s += begin.elapsed_time(end) / 1000.0

    def _retire(self) -> None:
        batch, items = self._inflight.popleft()
        batch.wait()
        for p, item in items:
            self._pieces.setdefault(p.name, []).append((p.src_off, batch.crc(item), p.nbytes))


def flat_bytes(t: torch.Tensor) -> np.ndarray | torch.Tensor:
    """A flat uint8 view of a contiguous tensor: NumPy for CPU, a CUDA tensor otherwise."""
    flat = t.detach().reshape(-1).view(torch.uint8)
    return flat if flat.is_cuda else flat.numpy()


@dataclass
class EngineStats:
    """What training saw and what the copies and writes cost; read by ``hpcckpt bench``.

    Names are stable (the bench reads them):

    - ``saves`` / ``skipped``: saves started / skipped with ``on_busy="skip"``.
    - ``save_call_s``: total seconds inside ``save()``; ``save_calls_s``: each call's
      seconds, in order; ``first_save_call_s``: the first admitted call (it includes
      staging allocation when ``prepare`` had not finished it in the background).
    - ``hook_wait_s``: total seconds the optimizer pre-hook blocked training until
      sources were staged (with a ring smaller than the state this includes waiting
      for part of the persist). ``stall_s`` = ``save_call_s + hook_wait_s``.
    - ``d2h_bytes`` / ``d2h_s``: bytes copied device-to-host and the seconds the
      copies took on the side stream (CUDA events); 0 when nothing is on a GPU.
    - ``persist_s``: per save, seconds from ``save()`` to every byte durable (before
      the commit).
    - ``prepare_s``: seconds spent laying out files and allocating (and pinning)
      staging, in the background or, when it was not ready, inside ``save()``.
    - ``staging_bytes`` / ``staging_pinned``: host staging held now (0 after close);
      ``ring_chunks`` / ``ring_chunk_bytes``: its ring shape (0 without a budget);
      ``staging_auto``: the shape was chosen by ``staging_bytes="auto"``.
    """

    saves: int = 0
    skipped: int = 0
    save_call_s: float = 0.0
    save_calls_s: list[float] = field(default_factory=list)
    first_save_call_s: float | None = None
    hook_wait_s: float = 0.0
    d2h_bytes: int = 0
    d2h_s: float = 0.0
    persist_s: list[float] = field(default_factory=list)
    prepare_s: float = 0.0
    staging_bytes: int = 0
    staging_auto: bool = False  # the staging's shape was chosen by staging_bytes="auto"
    staging_pinned: bool = False
    ring_chunks: int = 0
    ring_chunk_bytes: int = 0

    @property
    def stall_s(self) -> float:
        return self.save_call_s + self.hook_wait_s


@dataclass
class Staging:
    """A layout and the host memory that stages it: full slots, or one ring."""

    key: Key
    layout: Layout
    slots: list[Slot]
    ring: Ring | None

    @property
    def nbytes(self) -> int:
        return self.ring.nbytes if self.ring else sum(s.nbytes for s in self.slots)

    def matches(self, tensors: Mapping[str, torch.Tensor]) -> bool:
        """Whether ``tensors`` are what this staging was laid out for (all on the host)."""
        return (self.key[1] is None and self.layout.matches(tensors)
                and not any(map(operator.attrgetter("is_cuda"), tensors.values())))

    @property
    def pinned(self) -> bool:
        return self.ring.pinned if self.ring else any(s.pinned for s in self.slots)

    def release(self) -> None:
        if self.ring:
            self.ring.release()
        for s in self.slots:
            s.release()
