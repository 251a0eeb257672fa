"""Every name the store gives a file or directory, and the formats a rank record names.

Engines, levels and the JIT path write their files under these names and build their rank
records with ``rank_record``; readers (``store.read``, ``store.rankfile``, ``store.manifest``)
recognise the same names and formats. Nothing outside the store spells one.

A checkpoint directory (the root)::

    LATEST                   the name of the newest committed step (a hint)
    .hpcckpt.lock            the commit lock
    .hpcckpt.writer          the writer lease (one live job writes here)
    .hpcckpt-lineage         the run lineage its node-local copies carry (multi-level)
    step-<S>/                a committed step: manifest.json and the rank files
        manifest.json
        rank-<r>.h5          the concurrent engine's (format "hdf5")
        rank-<r>.pt          the sync engine's (format "torch")
        jit.pt               a just-in-time checkpoint: every rank's tensors (format "torch")
    step-<S>.tmp-<token>/    a save being written (never read as a step)
    .trash-*, .spare-*       pruned steps being deleted, or kept for reuse

A node-local root also holds ``.hpcckpt-level.json`` (the pointer the scavenge reads).
"""
from __future__ import annotations

from typing import Any

HDF5 = "hdf5"  # a rank file laid out by store.layout (HDF5 datasets at fixed offsets)
TORCH = "torch"  # a torch archive (store.torchfile)
RANK_FORMATS = (HDF5, TORCH)
_SUFFIX = {HDF5: ".h5", TORCH: ".pt"}

MANIFEST = "manifest.json"
LATEST = "LATEST"
TRASH_PREFIX = ".trash-"  # directories being deleted: never listed (``commit.discard``)
SPARE_PREFIX = ".spare-"  # a pruned step kept for the next save to reuse (``engines.recycle``)
LOCK_NAME = ".hpcckpt.lock"
LEASE_NAME = ".hpcckpt.writer"
LINEAGE = ".hpcckpt-lineage"
POINTER = ".hpcckpt-level.json"
JIT_FILE = "jit.pt"
LAYOUT_SCRATCH = (".hpcckpt-layout-", ".h5")  # (prefix, suffix) of a layout planned in a scratch file


def step_name(step: int) -> str:
    """``step-<S>``: the directory of a committed step."""
    return f"step-{step}"


def rank_file(rank: int, fmt: str) -> str:
    """The file of rank ``rank`` in a step, in format ``fmt`` (``HDF5`` or ``TORCH``)."""
    return f"rank-{rank}{_SUFFIX[fmt]}"


def jit_local_file(rank: int) -> str:
    """A rank's own tensors, written beside ``JIT_FILE`` while a JIT checkpoint is gathered."""
    return f"local-{rank}{_SUFFIX[TORCH]}"


def partial(name: str) -> str:
    """A file being received under ``name`` (renamed to ``name`` once whole)."""
    return f".{name}.part"


def rank_record(*, file: str, fmt: str, meta: Any, tensors: Any, **fields: Any) -> dict[str, Any]:
    """One rank's record for the commit exchange: its file, the file's format, the state's
    structure (``meta``) and its tensors' table; ``fields``: the rest (``file_info``, the
    distributed tensors' placement fields)."""
    if fmt not in RANK_FORMATS:
        raise ValueError(f"unknown rank file format {fmt!r}; known: {', '.join(RANK_FORMATS)}")
    return {"file": file, "format": fmt, "meta": meta, "tensors": tensors, **fields}
