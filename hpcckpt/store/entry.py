"""The ground of the store: where one tensor lives in a rank file, the alignment, and a
tensor's raw bytes.

Every module that lays out, places, writes, reads or stages rank files shares these; this
module imports nothing of hpcckpt but its errors, so it sits below all of them.
"""
from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import ConfigError

if TYPE_CHECKING:  # torch is imported by the code that holds tensors, not by readers of manifests
    import torch

ALIGN = 4096  # byte alignment of large tensors in a rank file (O_DIRECT, page size)

# Bytes per element of the dtypes checkpoints hold (the names torch prints), so that reading a
# manifest (``ls``, ``verify``, the epilog's ``scavenge``) does not import torch (2 CPU-seconds);
# any other name is asked of torch. tests/unit/test_manifest_dtypes.py holds it to torch's.
ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "complex128": 16, "complex64": 8,
            "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1,
            "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1}


@functools.cache
def _plain_dtype(name: str) -> torch.dtype | None:
    """The torch dtype called ``name`` if raw bytes can be viewed as it (not quantized etc.)."""
    import torch

    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        return None
    try:
        torch.zeros(16, dtype=torch.uint8).view(dt).clone()  # raises for quantized, sub-byte...
    except (RuntimeError, TypeError):
        return None
    return dt


def dtype_itemsize(name: Any) -> int | None:
    """Bytes per element of the plain torch dtype called ``name`` (None for any other name)."""
    if isinstance(name, str) and name in ITEMSIZE:
        return ITEMSIZE[name]
    dt = _plain_dtype(name) if isinstance(name, str) and name.isidentifier() else None
    return None if dt is None else int(dt.itemsize)


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives in a rank file, as the manifest records it."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    crc32c: int = 0

    def to_json(self) -> dict[str, object]:
        return {"dtype": self.dtype, "shape": list(self.shape), "offset": self.offset,
                "nbytes": self.nbytes, "crc32c": self.crc32c}

    @staticmethod
    def from_json(name: str, d: Mapping[str, Any]) -> TensorEntry:
        return TensorEntry(name, str(d["dtype"]), tuple(int(x) for x in d["shape"]),
                           int(d.get("offset", 0)), int(d["nbytes"]), int(d.get("crc32c", 0)))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def raw_bytes(t: torch.Tensor) -> np.ndarray:
    """A flat uint8 NumPy view of a contiguous CPU tensor's bytes (no copy)."""
    if t.device.type != "cpu":
        raise ConfigError(f"raw_bytes needs a CPU tensor, got one on {t.device}")
    t = t.contiguous().reshape(-1)
    if t.numel() == 0:
        return np.empty(0, dtype=np.uint8)
    import torch  # already imported by whoever holds a tensor: a lookup

    return t.view(torch.uint8).numpy()
