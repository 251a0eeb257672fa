"""What ``hpcckpt doctor`` reports about CRIU mode: which criu, its version, ``criu check``,
whether jobs can start in fresh PID + mount namespaces, and on a GPU node: the driver
against what the checkpoint API needs, whether CUDA initialises inside those
namespaces, and what running CRIU-mode jobs hold that a CUDA checkpoint cannot take
(as far as /proc shows it).

A plug-in of ``hpcckpt doctor``: ``checks()`` returns ``hpcckpt.doctor.Check`` findings.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

from ..doctor import Check
from ..errors import CudaCheckpointError, CriuError
from ..proc import tree as proctree
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
    from . import ops

    try:
        argv = [*ops.unshare_argv(), "true"]
    except CriuError as exc:
        return Check(name="pid+mount namespaces", ok=False, detail=str(exc))
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        proc = subprocess.CompletedProcess(argv, 1, "", str(exc))
    ok = proc.returncode == 0
    return Check(name="pid+mount namespaces", ok=ok,
                 detail=(f"jobs start under {' '.join(argv[:-1])}" if ok else
                         f"`{' '.join(argv)}` failed: {proc.stderr.strip()[-300:]}"),
                 fix="" if ok else "CRIU mode needs root (or CAP_SYS_ADMIN) on the compute node",
                 data={"unshare": argv[0]})


def _cuda_check() -> list[Check]:
    from ..cuda import CudaCheckpoint
    from ..cuda.driver import MIN_REMAP_TEXT

    try:
        cu = CudaCheckpoint()
    except CudaCheckpointError as exc:
        # Not a failure: CRIU mode works for CPU jobs; GPU jobs need the driver API.
        return [Check(name="cuda checkpoint api", ok=True, level="info", detail=f"unavailable, CPU jobs only: {exc}",
                      data={"available": False})]
    remap = ("restore onto other GPUs of the same model: yes" if cu.can_remap else
             f"restore only onto the same GPUs (other GPUs of the same model need {MIN_REMAP_TEXT})")
    api = Check(name="cuda checkpoint api", ok=True, level="ok" if cu.can_remap else "warn",
                detail=f"driver {_driver_version()} (CUDA {cu.info.text}) at {cu.info.path}; {remap}",
                data={"available": True, "driver_api": cu.info.text, "remap": cu.can_remap})
    return [api, _cuda_in_namespaces(), *_running_jobs()]


def _driver_version() -> str:
    try:
        text = open("/proc/driver/nvidia/version").read()
    except OSError:
        return "?"
    words = text.split()
    return next((w for w in words if w[:1].isdigit() and "." in w), "?")


# Error 304 came from creating a context (the driver reads /proc for its own PID and
# threads then), not from cuInit: the probe must create one on device 0 to see it.
_PROBE = ("import ctypes, sys\n"
          "cu = ctypes.CDLL(sys.argv[1]); n = ctypes.c_int(0); dev = ctypes.c_int(0); ctx = ctypes.c_void_p()\n"
          "rc = cu.cuInit(0) or cu.cuDeviceGetCount(ctypes.byref(n))\n"
          "if not rc and n.value:\n"
          "    rc = cu.cuDeviceGet(ctypes.byref(dev), 0) or cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)\n"
          "    if not rc:\n"
          "        cu.cuDevicePrimaryCtxRelease(dev)\n"
          "print(rc, n.value); sys.exit(1 if rc else 0)\n")


def _cuda_in_namespaces() -> Check:
    """What issue reports saw fail (error 304) when /proc did not match the PID namespace."""
    import sys

    from ..cuda.driver import LIBCUDA
    from . import ops

    lib = os.environ.get("HPCCKPT_LIBCUDA") or LIBCUDA
    argv = [*ops.unshare_argv(), sys.executable, "-I", "-S", "-c", _PROBE, lib]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        said = (proc.stdout + proc.stderr).strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        proc, said = subprocess.CompletedProcess(argv, 1), str(exc)
    ok = proc.returncode == 0
    return Check(name="cuda in job namespaces", ok=ok,
                 detail=(f"cuInit + a context on device 0 inside fresh PID + mount namespaces: "
                         f"{said.split()[-1]} device(s)" if ok else f"CUDA does not initialise inside fresh PID + mount namespaces: "
                         f"{said[-300:]}"),
                 fix="" if ok else "check that /dev/nvidia* and the driver's files are visible to the job "
                                   "(container/cgroup device rules), or use --mode app on this node")


def _criu_jobs() -> list[int]:
    """Host PIDs of the roots (PID 2) of CRIU-mode jobs running on this node."""
    roots = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(a.endswith(b"hpcckpt/criu/nsinit.py") for a in argv):
            roots += [k for k in proctree.children(int(entry.name)) if proctree.inner_pid(k) == 2]
    return roots


def unsupported(root: int) -> list[str]:
    """What a CUDA checkpoint of the tree under ``root`` cannot take, as far as /proc shows."""
    found = []
    for pid in proctree.tree(root):
        if proctree.maps_library(pid, "/libnccl.so"):
            found.append(f"PID {pid} uses NCCL (communicators hold peer and network state)")
        if not proctree.maps_library(pid, "/libcuda.so") and proctree.nvidia_handles(pid):
            found.append(f"PID {pid} ({proctree.command(pid, limit=60)}) holds GPU device files without the CUDA "
                         "driver (NVML: nvidia-smi, pynvml): a dump of the job would fail on it")
        environ = _environ(pid)
        if environ.get("CUDA_MPS_PIPE_DIRECTORY") or Path("/tmp/nvidia-mps").exists():
            found.append(f"PID {pid} may run under MPS")
    return found


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = (Path("/proc") / str(pid) / "environ").read_bytes()
    except OSError:
        return {}
    return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)


def _running_jobs() -> list[Check]:
    out = []
    for root in _criu_jobs():
        problems = unsupported(root)
        out.append(Check(name=f"criu job {root}", ok=not problems, level="ok" if not problems else "warn",
                         detail="; ".join(problems) or "no NCCL or MPS use seen in its processes",
                         fix="" if not problems else "NCCL, CUDA IPC, UVM managed memory, MIG and MPS cannot be "
                                                     "checkpointed: run such a job with --mode app"))
    return out


def checks() -> list[Check]:
    """Every CRIU-mode check, in the order a reader wants them."""
    return [*_criu_checks(), _namespace_check(), *_cuda_check()]
