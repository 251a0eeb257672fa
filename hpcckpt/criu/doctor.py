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

from ..doctor import REMOTE_LAUNCHERS, Check, Trial, TrialRefused, _who, dispositions
from ..errors import CriuError, CudaCheckpointError
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
    resources criu refuses (the same look the supervisor takes soon after a job starts).
    A remote launcher's (srun's) own sockets are left to ``_launcher_check``: its tasks are
    not in the tree at all, and no criu option changes that."""
    from . import dumpable

    problems = unsupported(root)
    refused = [p for p in dumpable.problems(root) if proctree.status_field(p.pid, "Name") not in REMOTE_LAUNCHERS]
    detail = "; ".join(problems + [p.text() for p in refused])
    fix = dumpable.fix(refused) if refused else ("NCCL, CUDA IPC, UVM managed memory, MIG and MPS cannot be "
                                                  "checkpointed: run such a job with --mode app")
    bad = bool(problems or refused)
    return Check(name=name, ok=not bad, level="warn" if bad else "ok",
                 detail=detail or "nothing criu refuses seen in its processes (io_uring, perf events, established "
                                  "TCP, NCCL, MPS)",
                 fix=fix if bad else "", data={"problems": [p.as_dict() for p in refused]})


def _launcher_check(pids: list[int]) -> list[Check]:
    """srun/salloc in the job: their tasks run under slurmstepd, outside the tree CRIU mode dumps."""
    launchers = [p for p in pids if proctree.status_field(p, "Name") in REMOTE_LAUNCHERS]
    if not launchers:
        return []
    return [Check(name="criu trial: launcher", ok=False, level="warn",
                  detail=f"{', '.join(_who(p) for p in launchers)} starts a job step: its tasks run under slurmstepd, "
                         "outside the process tree CRIU mode dumps, so no image holds them (and across nodes CRIU "
                         "mode refuses the job)",
                  fix="run the training command itself under hpcckpt run --mode criu (no srun), or use the "
                      "in-process templates (hpcckpt template ddp / torchrun) with hpcckpt's Checkpointer")]


def _term_check(pids: list[int]) -> tuple[Check, list[int]]:
    """What the job's processes do with TERM, which Slurm sends to every one of them at a
    stop's deadline, and what CRIU mode then does; returns the check and the PIDs that hear it."""
    import signal

    own = [p for p in pids if proctree.status_field(p, "Name") not in REMOTE_LAUNCHERS]
    how = dispositions(own, signal.SIGTERM)
    heard = [p for p, d in how.items() if d != "ignored"]
    if not heard:
        return Check(name="criu trial: TERM", ok=True,
                     detail="every process of the job ignores TERM (as CRIU mode starts it): a stop's TERM is the "
                            "supervisor's alone, and it dumps the job",
                     data={"term": how}), []
    root = pids[0] if pids else None

    def what(pid: int) -> str:
        if how[pid] == "default":
            return "dies of it"
        return "catches it (a handler of its own)" if pid == root else (
            "catches it (a child's own handler: torch's DataLoader workers exit on TERM, and the loader then "
            "fails the job)")

    said = "; ".join(f"{_who(p)} {what(p)}" for p in heard)
    workers = [p for p in heard if p != root]  # below the root: their end may end the job
    return Check(name="criu trial: TERM", ok=not workers, level="warn" if workers else "info",
                 detail=f"{said}. Slurm's TERM (a GraceTime=0 preemption, the end of a grace, scancel, the time "
                        "limit) reaches every process of the job: CRIU mode then makes no image (it would be of a "
                        "process that is ending) and waits for the job's own end: exit 75 after its own save "
                        "requeues, and the next allocation starts the command afresh to resume from that save; any "
                        "other end requeues from the newest committed image (periodic ones: --dump-every; without "
                        "one the command starts over). A stop noticed before that TERM (the --signal=B:USR2 "
                        "warning, a GraceTime preemption read on the end time) is dumped as usual",
                 fix="" if not workers else "take periodic images (--dump-every SECONDS) so such an end loses little; "
                                         "or let those processes ignore TERM (DataLoader workers: have the main "
                                         "process handle it and exit 75 after its own save)",
                 data={"term": how}), heard


def _rehearse(job: Trial, heard: list[int], *, stop_wait_s: float) -> Check:
    """Slurm's TERM to every process of the job (those that ignore it ignore it), and what
    its end then says: what CRIU mode would do with it."""
    import signal
    import time

    for pid in heard:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    t0 = time.monotonic()
    code = job.wait(stop_wait_s)
    took = time.monotonic() - t0
    if code is None:
        return Check(name="criu trial: stop", ok=False, level="warn",
                     detail=f"sent TERM to the processes that hear it; the job had not ended {stop_wait_s:.0f} s later: "
                            "under Slurm KILL follows KillWait after TERM, and the job is requeued from the newest "
                            "committed image",
                     fix="exit 75 soon after the save your TERM handler starts, or take periodic images "
                         "(--dump-every)", data={"exit_code": None})
    if code == 75:
        return Check(name="criu trial: stop", ok=True,
                     detail=f"sent TERM to the processes that hear it; the job exited 75 {took:.1f} s later: CRIU mode "
                            "requeues it, makes no image of that exit, and the next allocation starts the command "
                            "afresh to resume from its own save",
                     data={"exit_code": 75, "exit_after_term_s": round(took, 3)})
    if code == 0:
        return Check(name="criu trial: stop", ok=False, level="warn",
                     detail=f"sent TERM to the processes that hear it; the job exited 0 {took:.1f} s later: that is its "
                            "natural end to CRIU mode, so a stop would end the job for good with its training cut short",
                     fix="exit 75 after the save on TERM (hpcckpt's 'requeue me')", data={"exit_code": 0})
    return Check(name="criu trial: stop", ok=False, level="warn",
                 detail=f"sent TERM to the processes that hear it; the job ended with status {code} {took:.1f} s later: "
                        "CRIU mode requeues it from the newest committed image (what ran since is lost; without "
                        "periodic images it starts over)",
                 fix="take periodic images (--dump-every SECONDS), or let the job save and exit 75 on TERM",
                 data={"exit_code": code})


def trial(cmd: list[str], *, wait_s: float, run_dir: Path | None = None, stop_wait_s: float = 0.0,
          cwd: Path | None = None) -> list[Check]:
    """``hpcckpt doctor --mode criu -- CMD``: start CMD as CRIU mode would (its own PID + mount
    namespaces, USR2 and TERM ignored), without side effects (``hpcckpt.doctor.Trial``: its
    writes go to a scratch overlay, Slurm's acting commands are blocked), give it ``wait_s``
    to set itself up, look at what it holds and what its processes do with TERM, then (when
    ``stop_wait_s`` > 0 and some process hears TERM) send TERM as Slurm would and see how
    it ends, and end every process of the trial (never a real job: that one is only looked at).
    ``run_dir``: where the trial's scratch goes (default: TMPDIR)."""
    import signal
    import time

    try:
        job = Trial(cmd, cwd=cwd, ignore=(signal.SIGUSR2, signal.SIGTERM), scratch_base=run_dir)
    except TrialRefused as exc:
        return [Check(name="criu trial", ok=False, level="warn", detail=f"not run: {exc}")]
    try:
        try:
            job.start()
        except TrialRefused as exc:
            return [Check(name="criu trial", ok=False, level="warn", detail=f"not run: {exc}",
                          fix="CRIU mode needs root on the compute node; run doctor there (TMPDIR on a local disk)")]
        deadline = time.monotonic() + wait_s
        while job.running() and time.monotonic() < deadline:
            time.sleep(0.2)
        if not job.running():
            code = job.wait(0)
            job.end()
            return [Check(name="criu trial", ok=True, level="info",
                          detail=f"{' '.join(cmd)!r} ended (status {code}) within {wait_s:.0f} s, before it could be "
                                 f"looked at; its last output: {job.stderr_tail() or '(none)'}",
                          fix="give it longer: --trial-s"),
                    job.sandbox_check("criu trial sandbox")]
        assert job.app_pid is not None
        pids = job.tree()
        out = [_job_check("criu trial", job.app_pid), *_launcher_check(pids)]
        term, heard = _term_check(pids)
        out.append(term)
        if heard and stop_wait_s > 0:
            out.append(_rehearse(job, heard, stop_wait_s=stop_wait_s))
        job.end()
        out.append(job.sandbox_check("criu trial sandbox"))
        return out
    finally:
        job.close()


def checks() -> list[Check]:
    """Every CRIU-mode check, in the order a reader wants them."""
    return [*_criu_checks(), _namespace_check(), *_cuda_check(), *_running_jobs()]
