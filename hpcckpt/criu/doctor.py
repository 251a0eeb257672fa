"""What ``hpcckpt doctor`` reports about CRIU mode: which criu, its version, ``criu check``,
PID namespaces, and whether the CUDA checkpoint API is at hand.

A plug-in of ``hpcckpt doctor``: ``checks()`` returns ``hpcckpt.doctor.Check`` findings.
"""
from __future__ import annotations

import shutil

from ..doctor import Check
from ..errors import CudaCheckpointError, CriuError
from .locate import check, find_criu


def _criu_checks() -> list[Check]:
    try:
        criu = find_criu()
    except CriuError as exc:
        return [Check(name="criu", ok=False, detail=str(exc), data={"path": None, "version": None,
                                                                     "check": None})]
    result = check(criu)
    data = {"path": str(criu.path), "version": criu.version, "source": criu.source}
    found = Check(name="criu", ok=True, detail=f"criu {criu.version} at {criu.path} ({criu.source})", data=data)
    last = result.output.strip().splitlines()[-1] if result.output.strip() else ""
    verdict = Check(name="criu check", ok=result.ok,
                    detail=("Looks good" if result.ok else
                            f"`{criu.path} check` failed: {last} (kernel too old, missing CONFIG_CHECKPOINT_RESTORE, "
                            "or not root)"),
                    data={**data, "check": result.ok, "check_output": result.output[-2000:]})
    return [found, verdict]


def _namespace_check() -> Check:
    path = shutil.which("unshare")
    if path is None:
        return Check(name="pid namespace", ok=False, detail="`unshare` not found: apt-get install util-linux")
    return Check(name="pid namespace", ok=True, detail=f"jobs start under {path} --pid --fork",
                 data={"unshare": path})


def _cuda_check() -> Check:
    from ..cuda import CudaCheckpoint

    try:
        cu = CudaCheckpoint()
    except CudaCheckpointError as exc:
        # Not a failure: CRIU mode works for CPU jobs; GPU jobs need the driver API.
        return Check(name="cuda checkpoint api", ok=True, detail=f"unavailable, CPU jobs only: {exc}",
                     data={"available": False})
    return Check(name="cuda checkpoint api", ok=True, detail=f"driver API {cu.info.text} at {cu.info.path}",
                 data={"available": True, "driver_api": cu.info.text})


def checks() -> list[Check]:
    """Every CRIU-mode check, in the order a reader wants them."""
    return [*_criu_checks(), _namespace_check(), _cuda_check()]
