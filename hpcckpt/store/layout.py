"""Where one rank's tensors go: HDF5 file offsets and staging offsets, planned once per shape set.

The HDF5 metadata of a planned file is cached as a template (its non-hole bytes),
so each later save rewrites a few KiB instead of re-creating the HDF5 structure.
"""
from __future__ import annotations

import operator
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import ConfigError
from .entry import ALIGN, TensorEntry
from .hdf5 import ALIGN_THRESHOLD, plan_file
from .tensortable import TensorTable

_DTYPE, _SHAPE = operator.attrgetter("dtype"), operator.attrgetter("shape")

# HDF5 metadata is ~0.5-1 KB a dataset: 256 MiB is far beyond any model's state (and held
# in memory for the run); a file with more is planned afresh at each save.
_TEMPLATE_MAX_BYTES = 256 << 20
Spec = tuple[str, torch.dtype, tuple[int, ...]]


SMALL_ALIGN = 64  # a small tensor's place in a staging slot: a cache line


def _round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def _without(start: int, end: int, data: list[tuple[int, int]], i: int) -> tuple[list[tuple[int, int]], int]:
    """The parts of ``[start, end)`` outside the sorted, disjoint ranges ``data[i:]`` (and the
    index of the first range that may still overlap a later segment)."""
    parts: list[tuple[int, int]] = []
    while i < len(data) and data[i][1] <= start:
        i += 1
    j, cur = i, start
    while j < len(data) and data[j][0] < end:
        lo, hi = data[j]
        if lo > cur:
            parts.append((cur, lo))
        cur = max(cur, hi)
        j += 1
    if cur < end:
        parts.append((cur, end))
    return parts, i


def _data_segments(path: Path, entries: dict[str, TensorEntry]) -> tuple[list[tuple[int, bytes | memoryview]], int] | None:
    """The HDF5 metadata of a freshly planned (sparse) file: its non-hole bytes outside every
    tensor's data, and the file's size.

    A planned file holds only metadata and its datasets' unwritten data; the metadata is
    all a later save needs to rewrite (far cheaper than re-creating the HDF5 structure),
    and small tensors' data, which shares file-system blocks with it, is left out: the
    save writes it. None where the file system reports no holes or the metadata is huge.
    """
    data = sorted((e.offset, e.offset + e.nbytes) for e in entries.values() if e.nbytes)
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        segments: list[tuple[int, bytes | memoryview]] = []
        total, off, i = 0, 0, 0
        while off < size:
            try:
                start = os.lseek(fd, off, os.SEEK_DATA)
            except OSError:
                break  # ENXIO: only a hole remains
            end = os.lseek(fd, start, os.SEEK_HOLE)
            parts, i = _without(start, end, data, i)
            for lo, hi in parts:
                total += hi - lo
                if total > _TEMPLATE_MAX_BYTES:
                    return None
                segments.append((lo, os.pread(fd, hi - lo, lo)))
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
    template: tuple[list[tuple[int, bytes | memoryview]], int] | None = None

    def __post_init__(self) -> None:
        # The same, as arrays over the tensors that hold bytes (in ``specs`` order), for one
        # native call per save however many tensors there are (``Batch.add_many``).
        self.names = [n for n, _, _ in self.specs if self.entries[n].nbytes]
        self.index = {n: i for i, n in enumerate(self.names)}
        self.file_offsets = np.array([self.entries[n].offset for n in self.names], dtype=np.uint64)
        self.slot_offsets = np.array([self.staging_offset[n] for n in self.names], dtype=np.uint64)
        self.lengths = np.array([self.entries[n].nbytes for n in self.names], dtype=np.uint64)
        self.complex_names = [n for n, dtype, _ in self.specs if dtype.is_complex and self.entries[n].nbytes]
        # What a capture is compared with to recognise this layout (``matches``).
        self._spec_names = [n for n, _, _ in self.specs]
        self._spec_dtypes = [d for _, d, _ in self.specs]
        self._spec_shapes = [s for _, _, s in self.specs]
        # The manifest's tensor table but for the crc32c column (``record``); never changed.
        rows = [self.entries[n] for n, _, _ in self.specs]
        self._table = (self._spec_names, [e.dtype for e in rows], [list(e.shape) for e in rows],
                       [e.nbytes for e in rows], [e.offset for e in rows])
        # The template's segments as one buffer and its index arrays (``template_items``).
        self._template_items: tuple[bytes, np.ndarray, np.ndarray, np.ndarray] | None = None
        if self.template is not None:
            segments, size = self.template
            blob = b"".join(data for _, data in segments)
            lengths = [len(d) for _, d in segments]
            starts = np.cumsum([0] + lengths[:-1], dtype=np.uint64) if segments else np.zeros(0, dtype=np.uint64)
            self._template_items = (blob, np.array([o for o, _ in segments], dtype=np.uint64), starts,
                                    np.array(lengths, dtype=np.uint64))
            # The segments as views of the one buffer: the metadata is held once (at 65,536
            # tensors, 40 MB less).
            view = memoryview(blob)
            self.template = ([(o, view[int(a):int(a) + n]) for (o, _), a, n in zip(segments, starts, lengths)], size)

    @property
    def state_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    def matches(self, tensors: Mapping[str, torch.Tensor]) -> bool:
        """Whether ``tensors`` have this layout's names, dtypes and shapes, in order (list
        comparisons: C loops, a few milliseconds for tens of thousands of tensors)."""
        if list(tensors) != self._spec_names:
            return False
        values = list(tensors.values())
        return (list(map(_DTYPE, values)) == self._spec_dtypes
                and list(map(_SHAPE, values)) == self._spec_shapes)

    def template_items(self) -> tuple[bytes, np.ndarray, np.ndarray, np.ndarray] | None:
        """The HDF5 metadata as ``(buffer, file offsets, buffer offsets, lengths)``, for writers to
        write beside the tensors (``create`` made the file); None when there is no template."""
        return self._template_items

    def record(self, crcs: Mapping[str, int]) -> TensorTable:
        """The manifest's tensor table with these crc32c (0 for a tensor without bytes); its
        other columns are this layout's own lists, shared by every save's table."""
        names, dtypes, shapes, nbytes, offsets = self._table
        return TensorTable(names, dtypes, shapes, nbytes, list(map(crcs.get, names, [0] * len(names))), offsets)

    def create(self, path: Path) -> None:
        """Create ``path`` at this layout's size, all holes: its metadata is then written by
        the save's writers (``template_items``). Only with a template."""
        assert self.template is not None
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, self.template[1])
        finally:
            os.close(fd)

    @staticmethod
    def plan(path: Path, specs: tuple[Spec, ...]) -> Layout:
        entries = plan_file(path, specs)
        offsets: dict[str, int] = {}
        cursor = 0
        for name, _, _ in specs:
            e = entries[name]
            if e.nbytes >= ALIGN_THRESHOLD:
                # The first place congruent to its file offset modulo 4 KiB: the writers' O_DIRECT
                # transfers need both sides aligned (less than 4 KiB lost, on 64 KiB or more).
                cursor += (e.offset - cursor) % ALIGN
            else:
                # A small tensor is written through the page cache anyway (it is not aligned in
                # the file either): packed, not a page each, or at 65,536 tensors the slot was
                # twice the state.
                cursor = _round_up(cursor, SMALL_ALIGN)
            offsets[name] = cursor
            cursor += e.nbytes
        return Layout(specs, entries, offsets, max(_round_up(cursor, ALIGN), ALIGN), _data_segments(path, entries))

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
