"""The ground of the store: where one tensor lives in a rank file, the alignment, and a
tensor's raw bytes.

Every module that lays out, places, writes, reads or stages rank files shares these; this
module imports nothing of hpcckpt but its errors, so it sits below all of them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from ..errors import ConfigError

if TYPE_CHECKING:  # torch is imported by the code that holds tensors, not by readers of manifests
    import torch

ALIGN = 4096  # byte alignment of large tensors in a rank file (O_DIRECT, page size)


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
