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
from .locate import check, find_criu, tracks_memory


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
    tracked = tracks_memory(criu)
    dirty = Check(name="criu memory tracking", ok=True, level="ok" if tracked else "info",
                  detail=("soft-dirty tracking on: periodic images (--dump-every) after the first, and the dump at "
                          "a stop, write only the pages dirtied since the last image" if tracked else
                          "soft-dirty tracking is off in this kernel: every periodic image (--dump-every) and the "
                          "dump at a stop write the whole job's memory"),
                  data={"mem_dirty_track": tracked})
    return [found, verdict, dirty]


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
    return [api, _cuda_in_namespaces()]


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
    return [_job_check(f"criu job {root}", root) for root in _criu_jobs()]


def _job_check(name: str, root: int) -> Check:
    """What in the tree under ``root`` a dump would fail on: the CUDA limits and the
    resources criu refuses (the same look the supervisor takes soon after a job starts)."""
    from . import dumpable

    problems = unsupported(root)
    refused = dumpable.problems(root)
    detail = "; ".join(problems + [p.text() for p in refused])
    fix = dumpable.fix(refused) if refused else ("NCCL, CUDA IPC, UVM managed memory, MIG and MPS cannot be "
                                                  "checkpointed: run such a job with --mode app")
    bad = bool(problems or refused)
    return Check(name=name, ok=not bad, level="warn" if bad else "ok",
                 detail=detail or "nothing criu refuses seen in its processes (io_uring, perf events, established "
                                  "TCP, NCCL, MPS)",
                 fix=fix if bad else "", data={"problems": [p.as_dict() for p in refused]})


def trial(cmd: list[str], *, wait_s: float, run_dir: Path) -> list[Check]:
    """``hpcckpt doctor --mode criu -- CMD``: start CMD as CRIU mode would (its own PID + mount
    namespaces), give it ``wait_s`` to set itself up, look at what it holds, and end this
    trial instance (never a real job: that one is only looked at)."""
    import signal
    import time

    from . import ops

    stdio = run_dir / "doctor-trial"
    job = ops.launch(cmd, stdout=stdio.with_suffix(".out"), stderr=stdio.with_suffix(".err"),
                     log=stdio.with_suffix(".log"), ignore=(signal.SIGUSR2, signal.SIGTERM))
    try:
        deadline = time.monotonic() + wait_s
        while job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        if job.poll() is not None:
            return [Check(name="criu trial", ok=True, level="info",
                          detail=f"{' '.join(cmd)!r} ended (status {job.poll()}) within {wait_s:.0f} s, before it "
                                 f"could be looked at; its output: {stdio.with_suffix('.err')}")]
        return [_job_check("criu trial", job.app_pid)]
    finally:
        _end_launchers(job.init_pid)
        ops.kill_tree(job)
        if job.proc is not None:
            job.proc.wait(timeout=30)


# Launchers whose work runs elsewhere: killed, they leave it running there (an allocation
# and its step on every node until the time limit); sent TERM, they cancel it and return.
REMOTE_LAUNCHERS = ("srun", "salloc")
LAUNCHERS_END_S = 20.0  # srun waits for its step's tasks (KillWait, then a few seconds) before it returns


def _end_launchers(init_pid: int, *, wait_s: float = LAUNCHERS_END_S) -> list[int]:
    """TERM to every remote launcher of the trial (``srun``, ``salloc``), and wait for them to
    return (bounded) before the namespace is killed; returns the pids sent TERM. Nothing else
    of the trial is signalled: a script's own TERM handler would save and requeue."""
    import signal
    import time
    sent = []
    for pid in proctree.tree(init_pid)[1:]:
        if proctree.status_field(pid, "Name") in REMOTE_LAUNCHERS:
            try:
                os.kill(pid, signal.SIGTERM)
                sent.append(pid)
            except ProcessLookupError:
                continue
    deadline = time.monotonic() + wait_s
    while any(proctree.alive(pid) for pid in sent) and time.monotonic() < deadline:
        time.sleep(0.2)
    return sent


def checks() -> list[Check]:
    """Every CRIU-mode check, in the order a reader wants them."""
    return [*_criu_checks(), _namespace_check(), *_cuda_check(), *_running_jobs()]
