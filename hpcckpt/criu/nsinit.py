"""PID 1 of a CRIU-mode job's own PID namespace (run as a script, never imported).

A namespace's init ignores every signal it has no handler for, so an application
that is PID 1 would silently drop the SIGTERM/SIGUSR1 the supervisor forwards.
This init becomes the session leader (CRIU dumps a session only from inside the
namespace), points stdio at the job's own files, runs the command as PID 2,
forwards every catchable signal to it, reaps orphans, and exits with its status.
It imports nothing from hpcckpt: it is part of every CRIU image, so it stays small.

usage: python -I -S nsinit.py STDOUT STDERR -- CMD [ARGS...]
"""
import os
import signal
import sys

_NOT_FORWARDED = {signal.SIGCHLD, signal.SIGKILL, signal.SIGSTOP}


def _redirect(stdout_path, stderr_path):
    fd = os.open(os.devnull, os.O_RDONLY)
    os.dup2(fd, 0)
    os.close(fd)
    for target, path in ((1, stdout_path), (2, stderr_path)):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(fd, target)
        os.close(fd)


def _run(cmd):
    child = os.fork()
    if child == 0:
        try:
            os.execvp(cmd[0], cmd)
        except OSError as exc:
            os.write(2, ("hpcckpt nsinit: cannot run %r: %s\n" % (cmd[0], exc)).encode())
            os._exit(127)

    def forward(signum, _frame):
        try:
            os.kill(child, signum)
        except ProcessLookupError:
            pass

    for sig in signal.valid_signals():
        if sig not in _NOT_FORWARDED:
            try:
                signal.signal(sig, forward)
            except (OSError, ValueError):
                pass
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            os._exit(1)
        if pid == child:
            if os.WIFSIGNALED(status):
                os._exit(128 + os.WTERMSIG(status))
            os._exit(os.WEXITSTATUS(status))


def main(argv):
    if len(argv) < 4 or argv[2] != "--":
        sys.stderr.write(__doc__)
        return 2
    os.setsid()
    _redirect(argv[0], argv[1])
    _run(argv[3:])
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
