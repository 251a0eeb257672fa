"""Host <-> GPU copy limits (``hpcckpt bench --device cuda``).

``pinned_d2h_gbps`` / ``pinned_h2d_gbps``: one large ``copy_`` between device memory
and page-locked host memory, the ceiling of any snapshot or restore over PCIe/NVLink-C2C;
``pageable_d2h_gbps``: the same into ordinary (prefaulted) host memory, what a plain
``tensor.cpu()`` gets. Best of a few repeats, timed with the device synchronised.
"""
from __future__ import annotations

import time

import torch

from .limits import GB


def _best_s(dst: torch.Tensor, src: torch.Tensor, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def copy_limits(nbytes: int, *, repeats: int = 3) -> dict[str, float]:
    """Pinned D2H/H2D and pageable D2H bandwidth (GB/s) with ``nbytes`` (at most 1 GiB)."""
    n = max(1 << 20, min(nbytes, 1 << 30))
    dev = torch.ones(n, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    pageable = torch.zeros(n, dtype=torch.uint8)  # zeros: every page touched before timing
    try:
        _best_s(pinned, dev, 1)  # warm-up: context, copy engines
        return {
            "pinned_d2h_gbps": n / _best_s(pinned, dev, repeats) / GB,
            "pinned_h2d_gbps": n / _best_s(dev, pinned, repeats) / GB,
            "pageable_d2h_gbps": n / _best_s(pageable, dev, repeats) / GB,
            "copy_bytes": float(n),
        }
    finally:
        del dev, pinned, pageable
        torch.cuda.empty_cache()
        # empty_cache frees device memory only; torch's caching host allocator would keep the
        # pinned GiB for the rest of the run (where the phases that follow measure host memory)
        getattr(torch._C, "_host_emptyCache", lambda: None)()


def device_name() -> str:
    return str(torch.cuda.get_device_name(torch.cuda.current_device()))
