"""Where one rank's tensors go: HDF5 file offsets and staging offsets, planned once per shape set.

The HDF5 metadata of a planned file is cached as a template (its non-hole bytes),
so each later save rewrites a few KiB instead of re-creating the HDF5 structure.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import ConfigError
from .entry import ALIGN, TensorEntry
from .hdf5 import plan_file

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

    @property
    def state_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

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
