"""Run a command inside the PID + mount namespaces of a job (a script, never imported).

usage: python -I -S nsjoin.py HOST_PID -- CMD [ARGS...]

How ``criu dump`` runs for a CRIU-mode job: from inside the job's namespaces criu
sees them as its own, so it serialises neither (no mount table: a squashfs driver
mount, Lustre, GPFS, NFS or autofs cannot make the dump fail; files reopen by path
on the next node) and names the job by its inner PID. CRIU's scripts/criu-ns has
this shape; this is a small reimplementation, since Debian's criu does not ship it.

setns(CLONE_NEWPID) takes effect for children only, so CMD is forked. Before that a
holder process named ``hpcckpt-hold`` is parked under the namespace's init: criu
kills the dumped job at the end of a dump, and the init (nsinit) must not exit, and
take criu down with its namespace, until criu has finished. The holder lives until
this helper exits (it waits for EOF on a pipe whose write end only we hold).
This helper, the holder and CMD run with TERM, INT and HUP ignored: Slurm sends TERM to every process of the job
(criu included) at a preemption's end or the time limit, and a criu killed mid-dump
would lose the dump that signal asks for; the supervisor ends criu with SIGKILL.
Exit status: CMD's (128 + signal when killed), 125 when the namespaces cannot be joined.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWPID = 0x20000000
HOLD_NAME = "hpcckpt-hold"
PR_SET_PDEATHSIG = 1


def _setns(path: str, nstype: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(fd, nstype) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


def _park_holder() -> int:
    r, w = os.pipe()
    os.set_inheritable(w, False)
    first = os.fork()
    if first == 0:
        if os.fork() == 0:
            os.close(w)
            try:
                with open("/proc/self/comm", "w") as f:
                    f.write(HOLD_NAME)
                os.read(r, 1)
            finally:
                os._exit(0)
        os._exit(0)
    os.close(r)
    os.waitpid(first, 0)
    return w


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        sys.stderr.write(__doc__)
        return 2
    host_pid, cmd = argv[0], argv[2:]
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # inherited by the holder and criu (see above)
    try:
        _setns(f"/proc/{host_pid}/ns/pid", CLONE_NEWPID)
        _setns(f"/proc/{host_pid}/ns/mnt", CLONE_NEWNS)
        os.chdir("/")
    except OSError as exc:
        sys.stderr.write(f"hpcckpt nsjoin: cannot join the namespaces of PID {host_pid}: {exc}\n")
        return 125
    _park_holder()
    child = os.fork()
    if child == 0:
        try:
            # If the supervisor gives up on us (timeout), criu must not run on: killed,
            # it detaches from the job, which resumes.
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            os.execv(cmd[0], cmd)
        except OSError as exc:
            sys.stderr.write(f"hpcckpt nsjoin: cannot run {cmd[0]!r}: {exc}\n")
        os._exit(127)
    _, status = os.waitpid(child, 0)
    return 128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
