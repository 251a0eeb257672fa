"""PID 1 of a CRIU-mode job's own PID + mount namespace (run as a script, never imported).

``unshare --pid --fork --mount-proc`` starts this as PID 1 of fresh namespaces with
a /proc of their own (libcuda builds /proc paths from its own getpid()/gettid(), so
the /proc must match the PID namespace). It imports nothing from hpcckpt and is never
part of a CRIU image: images hold only the job's tree, rooted at PID 2.

``start [--ignore=SIGNUM,...] STDOUT STDERR -- CMD...``: closes every inherited fd above 2 (an fd opened in
the parent's mount namespace names a mount criu cannot find in this one: "Can't lookup
mount=N for fd=..."), and forks CMD as PID 2 in a session of its own (criu dumps a tree
whose session leader is inside it), opening the job's stdio in that child only: our
own stdout/stderr stay unshare's log, never the job's files. ``--ignore`` sets those
signals to SIG_IGN in the job before exec (kept across exec, inherited by its children,
recorded in its images): the dump signals, above all TERM, which Slurm sends to every
process of a job at a preemption's end or the time limit; the job must still be there
when the supervisor dumps it. A job that installs its own handler still gets them.

``restore STATUS_FD LAST_PID PIDFILE OLD_OUT NEW_OUT OLD_ERR NEW_ERR -- CRIU restore ARGS...``:
opens the new stdio files here (same reason), moves the PID counter past every PID
and TID in the image (``ns_last_pid``) so criu itself cannot take one of them, runs
``criu restore --restore-detached --pidfile F``; the restored root, orphaned when criu
exits, becomes our child. Writes ``restored <pid>`` or ``failed <why>`` to STATUS_FD.

Either way we then stay PID 1 for the job: forward every catchable signal to the job's
root (an init drops signals it has no handler for, so the job must not be PID 1), reap
orphans, and exit with the job's status once it is gone and no dump holder is left
(a process named ``hpcckpt-hold`` that the dump helper parks here: criu kills the job
at the end of a dump while it still runs inside this namespace, and must not die with it).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from types import FrameType

HOLD_NAME = "hpcckpt-hold"
_NOT_FORWARDED = {signal.SIGCHLD, signal.SIGKILL, signal.SIGSTOP}


def _close_inherited(keep: tuple[int, ...] = ()) -> None:
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass


def _open_append(path: str) -> int:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.set_inheritable(fd, True)
    return fd


def _redirect(stdout_path: str, stderr_path: str) -> None:
    fd = os.open(os.devnull, os.O_RDONLY)
    os.dup2(fd, 0)
    os.close(fd)
    for target, path in ((1, stdout_path), (2, stderr_path)):
        fd = _open_append(path)
        os.dup2(fd, target)
        os.close(fd)


def _spawn_job(cmd: list[str], stdout_path: str, stderr_path: str, ignore: Sequence[int] = ()) -> int:
    # The job's stdio is set up in the child only: our own fds 1/2 stay unshare's log, so
    # nothing we write (after a dump, say) can change a file the job's image records.
    child = os.fork()
    if child == 0:
        try:
            _redirect(stdout_path, stderr_path)
        except OSError as exc:
            os.write(2, (f"hpcckpt nsinit: cannot open the job's stdio: {exc}\n").encode())
            os._exit(127)
        try:
            for signum in ignore:
                signal.signal(signum, signal.SIG_IGN)
            os.setsid()
            os.execvp(cmd[0], cmd)
        except OSError as exc:
            os.write(2, (f"hpcckpt nsinit: cannot run {cmd[0]!r}: {exc}\n").encode())
        os._exit(127)
    return child


class Init:
    """Signal forwarding and reaping for one job root."""

    def __init__(self) -> None:
        self.job: int | None = None
        self.pending: list[int] = []
        self.statuses: dict[int, int] = {}
        for sig in signal.valid_signals():
            if sig not in _NOT_FORWARDED:
                try:
                    signal.signal(sig, self._on_signal)
                except (OSError, ValueError):
                    pass
        # A mask blocked by whatever started us would hold every forwarded signal pending
        # for ever (and the job inherits the mask): PID 1 must see them, SIGCHLD included.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, signal.valid_signals())

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        if self.job is None:
            self.pending.append(signum)  # restore still running: deliver once the job is back
            return
        try:
            os.kill(self.job, signum)
        except ProcessLookupError:
            pass

    def adopt(self, pid: int) -> None:
        self.job = pid
        for signum in self.pending:
            self._on_signal(signum, None)
        self.pending = []

    def _holders(self) -> bool:
        try:
            kids = open(f"/proc/self/task/{os.getpid()}/children").read().split()
        except OSError:
            return False
        for kid in kids:
            try:
                if open(f"/proc/{kid}/comm").read().strip() == HOLD_NAME:
                    return True
            except OSError:
                continue
        return False

    def wait_job(self) -> int:
        """Reap until the job is gone and no dump holder remains; return its exit code."""
        while self.job not in self.statuses or self._holders():
            try:
                pid, status = os.wait()
            except ChildProcessError:
                break
            except InterruptedError:
                continue
            self.statuses[pid] = status
        code = self.statuses.get(self.job) if self.job is not None else None
        if code is None:
            return 1
        return 128 + os.WTERMSIG(code) if os.WIFSIGNALED(code) else os.WEXITSTATUS(code)


def _ignored(argv: list[str]) -> tuple[list[int], list[str]]:
    """``--ignore=15,12`` at the head of argv: those signal numbers, and the rest of argv."""
    if argv and argv[0].startswith("--ignore="):
        return [int(n) for n in argv[0][len("--ignore="):].split(",") if n], argv[1:]
    return [], argv


def start(argv: list[str]) -> int:
    ignore, argv = _ignored(argv)
    if len(argv) < 4 or argv[2] != "--":
        sys.stderr.write(__doc__)
        return 2
    _close_inherited()
    fd = os.open(os.devnull, os.O_RDONLY)
    os.dup2(fd, 0)
    os.close(fd)
    init = Init()
    init.adopt(_spawn_job(argv[3:], argv[0], argv[1], ignore))
    # To unshare's log (our fd 1): proof for the supervisor that a job which is gone
    # before it was seen did run, rather than the namespaces failing.
    try:
        os.write(1, b"hpcckpt nsinit: started the job as PID 2\n")
    except OSError:
        pass  # never let a log write cost the job its init
    return init.wait_job()


def _set_last_pid(last: int) -> None:
    # Only for this namespace: the next fork (criu) gets last + 1.
    with open("/proc/sys/kernel/ns_last_pid", "w") as f:
        f.write(str(last))


def _report(fd: int, text: str) -> None:
    os.write(fd, (text + "\n").encode())
    os.close(fd)


def _restore_job(last_pid: int, pidfile: str, stdio: list[tuple[str, str]],
                 criu_args: list[str]) -> tuple[int | None, str]:
    fds: list[int] = []
    for old, new in stdio:
        if old and new:
            fd = _open_append(new)
            fds.append(fd)
            criu_args += ["--inherit-fd", f"fd[{fd:d}]:{old.lstrip('/')}"]
    _set_last_pid(last_pid)
    criu_args += ["--restore-detached", "--pidfile", pidfile]
    proc = subprocess.Popen(criu_args, stdin=subprocess.DEVNULL, pass_fds=fds)
    rc = proc.wait()
    for fd in fds:
        os.close(fd)
    if rc != 0:
        return None, f"criu restore exited with status {rc:d}"
    try:
        with open(pidfile) as f:
            pid = int(f.read().strip())
        os.unlink(pidfile)
    except (OSError, ValueError) as exc:
        return None, f"criu restore wrote no usable pidfile {pidfile} ({exc})"
    return pid, ""


def restore(argv: list[str]) -> int:
    if len(argv) < 9 or argv[7] != "--":
        sys.stderr.write(__doc__)
        return 2
    status_fd, last_pid, pidfile = int(argv[0]), int(argv[1]), argv[2]
    stdio = [(argv[3], argv[4]), (argv[5], argv[6])]
    _close_inherited(keep=(status_fd,))
    init = Init()
    try:
        pid, why = _restore_job(last_pid, pidfile, stdio, list(argv[8:]))
    except OSError as exc:
        pid, why = None, f"restore setup failed: {exc}"
    if pid is None:
        _report(status_fd, "failed " + why)
        return 1
    init.adopt(pid)
    _report(status_fd, f"restored {pid:d}")
    return init.wait_job()


def main(argv: list[str]) -> int:
    if argv and argv[0] == "start":
        return start(argv[1:])
    if argv and argv[0] == "restore":
        return restore(argv[1:])
    sys.stderr.write(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
