"""Start a job in fresh PID + mount namespaces, dump it from inside them, restore it.

Process tree, outer (host) PIDs; ``N`` inside the job's namespaces::

    supervisor ── unshare --pid --fork --mount-proc ── nsinit (1) ── CMD (2) ...

Fresh start: nsinit is PID 1, the command PID 2 in a session of its own (see nsinit).
Dump: ``nsjoin.py INIT -- criu dump -t 2`` runs criu inside the job's namespaces, so
criu dumps the tree rooted at PID 2 and neither namespace (no mount table).
Restore: ``unshare ... nsinit restore`` makes fresh namespaces again; nsinit runs
``criu restore`` there and the restored PID 2 becomes its child. Restored PIDs live
only in the new namespace, so they cannot clash with anything on the node, and the
restored job looks exactly like a fresh start (nsinit at 1, the job at 2): the same
path serves every later dump.

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
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import CriuError
from ..proc import tree as proctree
from .locate import Criu

NSINIT = Path(__file__).with_name("nsinit.py")
NSJOIN = Path(__file__).with_name("nsjoin.py")
JOB_INNER_PID = 2  # the job's root inside its namespace; nsinit is 1


@dataclass(frozen=True, kw_only=True)
class DumpOptions:
    file_locks: bool = True
    tcp_established: bool = False
    ext_unix_sk: bool = False
    ghost_limit_bytes: int = 256 << 20
    timeout_s: float = 1800.0


@dataclass(frozen=True, kw_only=True)
class Job:
    """A running job. ``init_pid``: nsinit's host PID (signals go through it; the
    namespaces to join); ``app_pid``: the job root's host PID (PID 2 inside; CUDA
    and SigCgt look at its tree); ``wait_pid``: unshare, the supervisor's child whose
    exit status is the job's; ``proc``: its Popen, kept so that nothing else (a later
    Popen's reaping of dropped children) can collect that status before we do."""

    init_pid: int
    app_pid: int
    wait_pid: int
    stdout: Path
    stderr: Path
    proc: subprocess.Popen | None = field(default=None, compare=False, repr=False)

    def poll(self) -> int | None:
        """The job's exit code once it is gone (128 + signal when killed), else None."""
        if self.proc is None:
            raise CriuError(f"job {self.wait_pid} has no process handle to wait on")
        rc = self.proc.poll()
        if rc is None:
            return None
        return 128 - rc if rc < 0 else rc


class JobExited(CriuError):
    """The job started (or was restored) and finished before the supervisor could see it;
    ``code`` is its exit status (unshare's, which is nsinit's, which is the job's)."""

    def __init__(self, code: int, what: str = "job") -> None:
        super().__init__(f"the {what} exited (status {code}) before it could be watched")
        self.code = code


class RestoredJobExited(JobExited):
    def __init__(self, code: int) -> None:
        super().__init__(code, "restored job")


STARTED_MARK = "hpcckpt nsinit: started the job as PID 2"  # nsinit writes it to the unshare log


def _find_unshare() -> str:
    path = shutil.which("unshare")
    if path is None:
        raise CriuError("`unshare` (util-linux) is not on PATH; CRIU mode runs the job in its own PID "
                        "and mount namespaces with it: apt-get install util-linux")
    return path


def unshare_argv() -> list[str]:
    """Fresh PID + mount namespaces with their own /proc; host mounts still propagate in
    (slave), so a filesystem automounted later is visible to the job."""
    return [_find_unshare(), "--pid", "--fork", "--mount-proc", "--propagation", "slave"]


def _nsinit(*args: str) -> list[str]:
    return [*unshare_argv(), sys.executable, "-I", "-S", str(NSINIT), *args]


def _child_with_inner_pid(parent: int, inner: int, *, timeout_s: float, what: str) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for kid in proctree.children(parent):
            if proctree.inner_pid(kid) == inner:
                return kid
        if not proctree.alive(parent):
            break
        time.sleep(0.005)
    raise CriuError(f"{what}: no process with PID {inner} inside the namespace of PID {parent} "
                    f"within {timeout_s:.0f} s")


def _job_of(unshare: subprocess.Popen, log: Path, *, timeout_s: float, stdout: Path, stderr: Path) -> Job:
    try:
        init = _child_with_inner_pid(unshare.pid, 1, timeout_s=timeout_s, what="unshare")
        app = _child_with_inner_pid(init, JOB_INNER_PID, timeout_s=timeout_s, what="nsinit")
    except CriuError as exc:
        raise CriuError(f"{exc}; can this user create PID and mount namespaces (CRIU mode runs as root; "
                        f"see `hpcckpt doctor`)? unshare said: {_log_tail(log)}") from None
    return Job(init_pid=init, app_pid=app, wait_pid=unshare.pid, stdout=stdout, stderr=stderr, proc=unshare)


def launch(cmd: list[str], *, stdout: Path, stderr: Path, log: Path, env: dict[str, str] | None = None,
           cwd: Path | None = None, ignore: tuple[signal.Signals, ...] = ()) -> Job:
    """Start ``cmd`` as PID 2 of fresh PID + mount namespaces with stdio to the given files.

    unshare's and nsinit's own messages go to ``log``, never to the job's files:
    anything written to those after a dump would make the image unrestorable.
    ``ignore``: signals the job starts with ignored (the dump signals: the scheduler's
    TERM reaches every process of the job, and only the supervisor may act on it).
    """
    stdout, stderr = Path(os.path.realpath(stdout)), Path(os.path.realpath(stderr))
    for p in (stdout, stderr, log):
        p.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as log_f:
        ignored = "--ignore=" + ",".join(str(int(sig)) for sig in ignore)
        proc = subprocess.Popen(_nsinit("start", ignored, str(stdout), str(stderr), "--", *cmd), stdin=subprocess.DEVNULL,
                                stdout=log_f, stderr=log_f, env=env, cwd=cwd)
    try:
        return _job_of(proc, log, timeout_s=30.0, stdout=stdout, stderr=stderr)
    except CriuError:
        rc = _gone_or_abort(proc)
        if rc is not None and STARTED_MARK in log.read_text(errors="replace"):
            raise JobExited(rc) from None  # it ran and finished: its status is the answer
        raise


def _gone_or_abort(proc: subprocess.Popen) -> int | None:
    """unshare's exit code (128 + signal) once nsinit is gone; None after ending a namespace
    that still lives (never leave one running that nobody watches)."""
    try:
        rc = proc.wait(timeout=5.0)  # a gone job's nsinit exits at once; a live one does not
    except subprocess.TimeoutExpired:
        _abort(proc)
        return None
    return 128 - rc if rc < 0 else rc


def _log_tail(path: Path, *, lines: int = 6) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return "(no log)"
    errors = [ln for ln in text if "Error" in ln and "RLIMIT_NOFILE" not in ln]
    return " | ".join((errors or text)[-lines:]) or "(nothing)"


CRIU_EXIT_WAIT_S = 30.0  # how long a killed criu gets to exit (and so let go of the job's tasks)


def end_criu(proc: subprocess.Popen, *, wait_s: float = CRIU_EXIT_WAIT_S) -> list[int]:
    """Kill nsjoin and the criu under it, and wait until they are gone: while criu lives it
    may still hold the job's tasks (traced, t), and the CUDA undo that follows a failed dump
    needs them running. Returns the PIDs still there after ``wait_s`` (none, normally)."""
    helpers = proctree.tree(proc.pid)[1:]  # criu, in the job's namespaces, and anything it started
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # its own process group: one that forks meanwhile is in it too
    except ProcessLookupError:
        pass
    proc.kill()
    proc.wait()
    signal_pids(helpers, signal.SIGKILL)  # what criu's PR_SET_PDEATHSIG does anyway, said plainly
    deadline = time.monotonic() + wait_s
    while any(proctree.alive(p) for p in helpers) and time.monotonic() < deadline:
        time.sleep(0.01)
    return [p for p in helpers if proctree.alive(p)]


def _run_criu(argv: list[str], what: str, *, log: Path, timeout_s: float) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log.with_suffix(".out"), "ab") as out:
        # A session (and process group) of its own: a timeout ends nsjoin and everything
        # under it at once, and a Ctrl-C meant for the supervisor never kills criu mid-dump.
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            left = end_criu(proc)
            still = f"; criu PIDs {left} had not exited {CRIU_EXIT_WAIT_S:.0f} s after being killed" if left else ""
            raise CriuError(f"criu {what} did not finish within {timeout_s:.0f} s (killed){still}; see {log}") from None
        except BaseException:
            end_criu(proc)
            raise
    if proc.returncode == 125:
        raise CriuError(f"cannot enter the job's namespaces for criu {what}: "
                        f"{_log_tail(log.with_suffix('.out'))}")
    if proc.returncode != 0:
        said = _log_tail(log) if log.exists() else _log_tail(log.with_suffix(".out"))
        raise CriuError(f"criu {what} failed (exit {proc.returncode}): {said}; full log: {log}")


def dump(criu: Criu, job: Job, image_dir: Path, *, log: Path, opts: DumpOptions, leave_running: bool = False,
         parent: str | None = None, track_mem: bool = False) -> None:
    """Dump the job's tree (PID 2 and below) into ``image_dir`` from inside its namespaces.

    The job is gone afterwards, unless ``leave_running`` (a periodic image). With
    ``track_mem`` (``--track-mem``: soft-dirty bits cleared; the kernel must have them), a later dump given
    ``parent`` (an image of this same run, a sibling directory of ``image_dir``) writes
    only the pages dirtied since; criu links the new image to it (``parent``), and a
    restore reads the rest from there. On failure criu resumes the tree, so the job keeps running.
    """
    argv = [sys.executable, "-I", "-S", str(NSJOIN), str(job.init_pid), "--", str(criu.path),
            "dump", "-t", str(JOB_INNER_PID), "-D", str(image_dir), "--ghost-limit", str(opts.ghost_limit_bytes),
            *(["--leave-running"] if leave_running else []), *(["--track-mem"] if track_mem else []),
            *(["--prev-images-dir", f"../{parent}"] if parent else []),
            *_shared_flags(opts), "-o", str(log), "-v4"]
    _run_criu(argv, "dump", log=log, timeout_s=opts.timeout_s)


def _shared_flags(opts: DumpOptions) -> list[str]:
    """Options that dump and restore must both be given for the same image."""
    return ([*(["--file-locks"] if opts.file_locks else []),
             *(["--tcp-established"] if opts.tcp_established else []),
             *(["--ext-unix-sk"] if opts.ext_unix_sk else [])])


def _read_status(fd: int, *, timeout_s: float) -> str:
    """nsinit's one-line report (unshare's parent also holds the pipe: read a line, not to EOF)."""
    import select

    buf = b""
    deadline = time.monotonic() + timeout_s
    while b"\n" not in buf:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            raise CriuError(f"criu restore did not report within {timeout_s:.0f} s")
        data = os.read(fd, 4096)
        if not data:
            break
        buf += data
    return buf.decode(errors="replace").strip()


def restore(criu: Criu, image_dir: Path, *, old_stdio: dict[str, str], new_stdout: Path, new_stderr: Path,
            log: Path, work_dir: Path, opts: DumpOptions, last_pid: int) -> Job:
    """Restore the image into fresh PID + mount namespaces under a new nsinit.

    ``last_pid``: the highest PID or TID inside the image; criu itself must start above it.
    """
    work_dir.mkdir(parents=True, exist_ok=True)
    new_stdout.parent.mkdir(parents=True, exist_ok=True)
    pidfile = work_dir / (log.stem + ".pid")
    pidfile.unlink(missing_ok=True)
    criu_argv = [str(criu.path), "restore", "-D", str(image_dir), "-W", str(work_dir), "--manage-cgroups=ignore",
                 *_shared_flags(opts), "-o", str(log), "-v4"]
    stdio = [old_stdio.get("stdout", ""), str(new_stdout), old_stdio.get("stderr", ""), str(new_stderr)]
    r, w = os.pipe()
    nsinit_log = log.with_suffix(".out")
    try:
        with open(nsinit_log, "ab") as log_f:
            proc = subprocess.Popen(_nsinit("restore", str(w), str(last_pid), str(pidfile), *stdio, "--", *criu_argv),
                                    stdin=subprocess.DEVNULL, stdout=log_f, stderr=log_f, pass_fds=(w,))
        os.close(w)
        w = -1
        try:
            status = _read_status(r, timeout_s=opts.timeout_s)
        except CriuError:
            _abort(proc)
            raise
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
    if not status.startswith("restored "):
        proc.wait()
        why = status[len("failed "):] if status.startswith("failed ") else f"nsinit exited ({proc.returncode})"
        raise CriuError(f"criu restore of {image_dir} failed: {why}: {_log_tail(log)}; full log: {log}, "
                        f"{nsinit_log}")
    try:
        return _job_of(proc, nsinit_log, timeout_s=30.0, stdout=new_stdout, stderr=new_stderr)
    except CriuError:
        # The restore succeeded, so the job must never be started again: either it already
        # finished (nsinit exited with its status: that is the job's exit), or it cannot be
        # watched, and then its namespace is ended before anything falls back.
        rc = _gone_or_abort(proc)
        if rc is None:
            raise
        raise RestoredJobExited(rc) from None


def _abort(unshare: subprocess.Popen) -> None:
    # unshare ignores TERM/INT; killing the namespace's init ends everything inside.
    signal_pids(proctree.children(unshare.pid), signal.SIGKILL)
    unshare.wait()


def kill_tree(job: Job, sig: signal.Signals = signal.SIGKILL) -> None:
    """Signal nsinit: it forwards a catchable signal to the job; SIGKILL to a
    namespace's init ends the whole namespace."""
    try:
        os.kill(job.init_pid, sig)
    except ProcessLookupError:
        pass


def wait_gone(job: Job, timeout_s: float = 30.0) -> None:
    """criu killed the tree (or we did): collect unshare's status so no zombie outlives us. Only
    through the job's own Popen: a waitpid(-1) here, or a dropped Popen that a later subprocess
    call reaps, would take the status and leave nothing true to report."""
    deadline = time.monotonic() + timeout_s
    while job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)


def signal_pids(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
