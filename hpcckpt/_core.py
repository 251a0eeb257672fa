"""Import of the compiled core with an actionable error when it is missing."""
from __future__ import annotations

from types import ModuleType

from .errors import NativeMissing

_native: ModuleType | None = None


def native() -> ModuleType:
    """Return ``hpcckpt._native``, importing it on first use."""
    global _native
    if _native is None:
        try:
            from . import _native as mod
        except ImportError as exc:  # pragma: no cover - depends on the build
            raise NativeMissing(
                "the compiled core hpcckpt._native is missing or failed to load "
                f"({exc}). Did you forget to compile it? Run `pip install -e .` "
                "(or `scripts/bootstrap`) from the repository root; it builds native/ "
                "with scikit-build-core."
            ) from exc
        _native = mod
    return _native


def crc32c(data: object, crc: int = 0) -> int:
    """CRC-32C of a buffer (hardware accelerated in the native core)."""
    return int(native().crc32c(data, crc))


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32C of A followed by B, from crc32c(A), crc32c(B) and B's length."""
    return int(native().crc32c_combine(crc1, crc2, len2))
