"""Start a job in its own PID namespace, dump it with criu, restore it.

Process tree of a fresh start, outer PIDs::

    supervisor ── unshare --pid --fork ── nsinit (PID 1 inside) ── CMD (PID 2) ...

The dump target is nsinit's outer PID: because it is the namespace's init and the
session leader, criu dumps the whole namespace and restores it into a NEW PID
namespace, so the job's PIDs never collide with processes on the next node.

Restore runs ``criu restore --restore-detached``: the restored init is re-parented
to the nearest child subreaper, which the supervisor makes itself, so it can wait
for the job as if it had started it.

Dump flags, and why:
- ``--file-locks``: the job may hold flock/POSIX locks (HDF5 opens files locked,
  filelock-based tools); without it criu refuses such a tree. Harmless otherwise.
- no ``--shell-job``: the job has no terminal and is its own session leader.
- ``--tcp-established`` only on request: an established connection can only be
  restored with the same addresses on both ends, which a requeue to another node
  does not give; a job with live TCP (NCCL, a remote logger) is not a CRIU-mode job.
- ``--ghost-limit``: files deleted while open are copied into the image; the
  default 1 MiB is too small for typical scratch files of training jobs.
- restore with ``--manage-cgroups=ignore``: the restored job stays in the cgroup
  of the new allocation (Slurm's limits) instead of recreating the old one.
- restore with ``--inherit-fd``: the job's stdout/stderr are re-pointed to fresh
  files for each incarnation, so nothing ever appends to a file the image records
  (criu checks the size of every open regular file at restore).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import CriuError
from . import proctree
from .locate import Criu

NSINIT = Path(__file__).with_name("nsinit.py")


@dataclass(frozen=True, kw_only=True)
class DumpOptions:
    file_locks: bool = True
    tcp_established: bool = False
    ext_unix_sk: bool = False
    ghost_limit_bytes: int = 256 << 20
    timeout_s: float = 1800.0


@dataclass(frozen=True, kw_only=True)
class Job:
    """A running job: ``init_pid`` is the namespace init's outer PID (dump and
    signal target); ``wait_pid`` is the supervisor's child whose exit ends the job."""

    init_pid: int
    wait_pid: int
    stdout: Path
    stderr: Path


def _find_unshare() -> str:
    path = shutil.which("unshare")
    if path is None:
        raise CriuError("`unshare` (util-linux) is not on PATH; CRIU mode runs the job in its own PID "
                        "namespace with it: apt-get install util-linux")
    return path


def _wait_for_child(parent: int, *, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        kids = proctree.children(parent)
        if kids:
            return kids[0]
        if not proctree.alive(parent):
            break
        time.sleep(0.005)
    raise CriuError(f"unshare (PID {parent}) did not start the job's namespace init within {timeout_s:.0f} s; "
                    "does this kernel allow PID namespaces (unshare --pid needs root or user namespaces)?")


def launch(cmd: list[str], *, stdout: Path, stderr: Path, log: Path, env: dict[str, str] | None = None,
           cwd: Path | None = None) -> Job:
    """Start ``cmd`` as PID 2 of a new PID namespace with stdio to the given files.

    unshare's own messages go to ``log``, never to the job's files: anything
    written to those after a dump would make the image unrestorable.
    """
    stdout, stderr = Path(os.path.realpath(stdout)), Path(os.path.realpath(stderr))
    for p in (stdout, stderr, log):
        p.parent.mkdir(parents=True, exist_ok=True)
    argv = [_find_unshare(), "--pid", "--fork", sys.executable, "-I", "-S", str(NSINIT),
            str(stdout), str(stderr), "--", *cmd]
    with open(log, "ab") as log_f:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log_f, stderr=log_f, env=env, cwd=cwd)
    try:
        init = _wait_for_child(proc.pid, timeout_s=30.0)
    except CriuError as exc:
        raise CriuError(f"{exc}; unshare said: {_log_tail(log)}") from None
    return Job(init_pid=init, wait_pid=proc.pid, stdout=stdout, stderr=stderr)


def _log_tail(path: Path, *, lines: int = 6) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return "(no log)"
    errors = [ln for ln in text if "Error" in ln and "RLIMIT_NOFILE" not in ln]
    return " | ".join((errors or text)[-lines:])


def _run_criu(criu: Criu, args: list[str], *, log: Path, timeout_s: float,
              pass_fds: tuple[int, ...] = ()) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    out_path = log.with_suffix(".out")
    with open(out_path, "ab") as out:
        try:
            proc = subprocess.run([str(criu.path), *args, "-o", str(log), "-v4"], stdin=subprocess.DEVNULL,
                                  stdout=out, stderr=out, timeout=timeout_s, pass_fds=pass_fds)
        except subprocess.TimeoutExpired:
            raise CriuError(f"criu {args[0]} did not finish within {timeout_s:.0f} s; see {log}") from None
    if proc.returncode != 0:
        raise CriuError(f"criu {args[0]} failed (exit {proc.returncode}): {_log_tail(log)}; full log: {log}")


def dump(criu: Criu, job: Job, image_dir: Path, *, log: Path, opts: DumpOptions) -> None:
    """Dump the job's whole namespace into ``image_dir``; the job is gone afterwards.

    On failure criu resumes the tree, so the job keeps running.
    """
    args = ["dump", "-t", str(job.init_pid), "-D", str(image_dir),
            "--ghost-limit", str(opts.ghost_limit_bytes)]
    args += _shared_flags(opts)
    _run_criu(criu, args, log=log, timeout_s=opts.timeout_s)


def _shared_flags(opts: DumpOptions) -> list[str]:
    """Options that dump and restore must both be given for the same image."""
    return ([*(["--file-locks"] if opts.file_locks else []),
             *(["--tcp-established"] if opts.tcp_established else []),
             *(["--ext-unix-sk"] if opts.ext_unix_sk else [])])


def _inherit_key(path: str) -> str:
    # criu names a regular file by its path relative to the root, without the leading "/".
    return path.lstrip("/")


def restore(criu: Criu, image_dir: Path, *, old_stdio: dict[str, str], new_stdout: Path, new_stderr: Path,
            log: Path, work_dir: Path, opts: DumpOptions) -> Job:
    """Restore the image detached; return the restored init (our child via subreaper)."""
    pidfile = work_dir / (log.stem + ".pid")
    pidfile.unlink(missing_ok=True)
    args = ["restore", "-D", str(image_dir), "-W", str(work_dir), "--restore-detached",
            "--pidfile", str(pidfile), "--manage-cgroups=ignore"]
    args += _shared_flags(opts)
    fds: list[int] = []
    try:
        for name, target in (("stdout", new_stdout), ("stderr", new_stderr)):
            if name not in old_stdio:
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            fds.append(fd)
            args += ["--inherit-fd", f"fd[{fd}]:{_inherit_key(old_stdio[name])}"]
        _run_criu(criu, args, log=log, timeout_s=opts.timeout_s, pass_fds=tuple(fds))
    finally:
        for fd in fds:
            os.close(fd)
    try:
        pid = int(pidfile.read_text().strip())
    except (FileNotFoundError, ValueError) as exc:
        raise CriuError(f"criu restore succeeded but wrote no usable pidfile {pidfile} ({exc})") from exc
    return Job(init_pid=pid, wait_pid=pid, stdout=new_stdout, stderr=new_stderr)


def set_child_subreaper() -> None:
    """Make orphaned descendants (the detached restored tree) our children."""
    import ctypes

    pr_set_child_subreaper = 36
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(pr_set_child_subreaper, 1, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise CriuError(f"prctl(PR_SET_CHILD_SUBREAPER) failed: {os.strerror(err)}")


def kill_tree(job: Job, sig: signal.Signals = signal.SIGKILL) -> None:
    """Signal the namespace init; SIGKILL to a namespace's init ends the whole namespace."""
    try:
        os.kill(job.init_pid, sig)
    except ProcessLookupError:
        pass
