"""Host memory for moving tensor bytes between files and devices: staging buffers and round plans.

Shared by the concurrent engine's staging ring (device -> host -> file) and the
staged restore (file -> host -> device): both cut tensors into pieces that fit in
fixed-size chunks of 4 KiB-aligned host memory, each piece at the same offset
modulo 4 KiB in its chunk as in the file, so the native core can use O_DIRECT
without bounce buffers.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from .._core import native
from ..errors import ConfigError
from .entry import ALIGN, TensorEntry

log = logging.getLogger("hpcckpt.store.hostmem")


def round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


class Slot:
    """One reusable, prefaulted, 4 KiB-aligned host buffer (pinned when CUDA tensors are saved).

    Pinning uses ``cudaHostRegister`` on memory the native core allocated (torch's
    pinned allocator rounds sizes up to a power of two: up to twice the memory).
    Torch's binding releases the GIL, so a background thread may pin gigabytes
    while training runs. ``release()`` unregisters; the memory itself is freed when
    the last reference (this object, a numpy or torch view) is gone.
    """

    def __init__(self, nbytes: int, *, pin: bool, prefault: bool | None = None) -> None:
        # Pinning faults every page in (the driver pins them writable), so a prefault pass
        # first would touch the memory twice. ``prefault`` False: neither (a slot pinned
        # later with ``pin()``, or one whose pages the first read faults in).
        self.buffer = native().aligned_buffer(nbytes, ALIGN, (not pin) if prefault is None else prefault)
        self.bytes = np.frombuffer(self.buffer, dtype=np.uint8)
        self.tensor = torch.from_numpy(self.bytes)
        self.pinned = False
        if pin:
            self.pin()
        self.busy = False

    @property
    def nbytes(self) -> int:
        return int(self.bytes.nbytes)

    def pin(self) -> bool:
        """``cudaHostRegister`` the buffer on the current device's context; False (and a
        warning) if the driver refuses: copies from it are then slower, not wrong."""
        if not self.pinned:
            rc = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), self.nbytes, 0)
            self.pinned = int(rc) == 0
            if not self.pinned:
                log.warning("hpcckpt: cudaHostRegister of %d staging bytes failed (%s); copies will be slower",
                            self.nbytes, rc)
        return self.pinned

    def release(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.pinned = False


def make_slots(count: int, nbytes: int, *, pin: bool, prefault: bool | None = None) -> list[Slot]:
    """``count`` slots of ``nbytes``; if one cannot be built, those already built are released
    (unpinned) before the error propagates, so a failed allocation leaks no pinned memory."""
    slots: list[Slot] = []
    try:
        for _ in range(count):
            slots.append(Slot(nbytes, pin=pin, prefault=prefault))
    except BaseException:
        for s in slots:
            s.release()
        raise
    return slots


def one_cuda_device(devices: Iterable[torch.device], what: str) -> torch.device | None:
    """The single CUDA device among ``devices`` (None if none); ConfigError if more than one.

    Staging and restore use one side stream, pinned for one device's context: tensors
    spread over several GPUs in one process are not supported (run one process per GPU).
    """
    found: dict[str, torch.device] = {}
    for d in devices:
        if d.type == "cuda":
            index = d.index if d.index is not None else torch.cuda.current_device()
            found.setdefault(f"cuda:{index}", torch.device("cuda", index))
    if len(found) > 1:
        raise ConfigError(
            f"{what}: tensors are on several CUDA devices ({', '.join(sorted(found))}) in one process; "
            "hpcckpt supports one GPU per process: run one rank per GPU (e.g. torchrun --nproc-per-node, "
            "srun --gpus-per-task=1) and keep each rank's model and optimizer on its own device")
    return next(iter(found.values()), None)


@dataclass(frozen=True)
class Piece:
    """A byte range of one tensor: where it comes from, goes to in the file and sits in its chunk."""

    name: str
    src_off: int
    nbytes: int
    file_off: int
    chunk_off: int


def plan_rounds(entries: Iterable[TensorEntry], chunk_bytes: int) -> list[list[Piece]]:
    """Cut tensors into pieces, packed into rounds of at most ``chunk_bytes`` each.

    A piece sits at its file offset modulo 4 KiB inside the chunk; a tensor split
    across rounds is cut where the chunk ends, which is then 4 KiB aligned in the
    file too, so every piece's middle can go to disk with O_DIRECT.
    """
    if chunk_bytes < 2 * ALIGN or chunk_bytes % ALIGN:
        raise ConfigError(f"ring chunk of {chunk_bytes} bytes: use a multiple of {ALIGN} of at least {2 * ALIGN}")
    rounds: list[list[Piece]] = [[]]
    cursor = 0
    for e in entries:
        done = 0
        while done < e.nbytes:
            f = e.offset + done
            at = cursor + (f - cursor) % ALIGN  # the first place at or after cursor congruent to f
            if at >= chunk_bytes:
                rounds.append([])
                cursor, at = 0, f % ALIGN
            n = min(e.nbytes - done, chunk_bytes - at)
            rounds[-1].append(Piece(e.name, done, n, f, at))
            cursor = at + n
            done += n
    return [r for r in rounds if r]


