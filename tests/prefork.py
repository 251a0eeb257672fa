"""Worker processes for tests, forked from a server that has already imported torch.

A test that starts training ranks as ``python -m tests.unit.some_worker ...`` pays about
3.5 CPU-seconds per process before the first step (importing torch, and torch._dynamo,
which every optimizer's first use imports). The suite starts hundreds of them on a 2-core
machine, where that start-up was most of the non-Slurm time. ``Child`` runs the same
module, arguments, working directory and environment in a process forked from
multiprocessing's fork server (one per test worker, started on first use), which imported
those modules once. The child is a real process with its own pid: it can be signalled,
killed, and it exits with the module's exit code; it runs the interpreter's exit steps
(non-daemon threads joined, atexit handlers) as ``python -m`` would.

What differs from ``subprocess.Popen``: the child is not this process's child (its
parent is the fork server), its command line in /proc is the fork server's, and variables
read by torch while it is imported keep the values the server started with. Use it for
ranks and workers a test starts, not for what the test is about: processes that CRIU
dumps, that Slurm starts, or whose command line is looked up stay ``subprocess.Popen``.
"""
from __future__ import annotations

import atexit
import io
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
from pathlib import Path
from typing import Any

PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "torch.optim", "torch.utils.data"]
_context: Any = None


def _server() -> Any:
    global _context
    if _context is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        _context = ctx
    return _context


def _exit_code(exc: SystemExit) -> int:
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _run(argv: list[str], cwd: str, env: dict[str, str], output: str | None, errors: str | None,
         new_session: bool) -> None:
    """The child: become ``python ARGV`` (``-m MODULE ARGS``, ``-c CODE ARGS`` or ``SCRIPT
    ARGS``) and exit as it would."""
    if new_session:
        os.setsid()
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for fd, path in ((1, output), (2, errors or output)):
        opened = os.open(path or os.devnull, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115  (the process's stdin, for its whole life)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True, line_buffering=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True, line_buffering=True)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    torch = sys.modules.get("torch")
    threads = env.get("OMP_NUM_THREADS", "")
    if torch is not None and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))  # a fresh process reads it when torch starts its pool
    code = 0
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path.insert(0, cwd)
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path.insert(0, "")
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)  # noqa: S102  (what python -c does)
        else:
            sys.argv = list(argv)
            sys.path.insert(0, str(Path(argv[0]).resolve().parent))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException:  # noqa: BLE001  (as the interpreter does: print it, exit 1)
        traceback.print_exc()
        code = 1
    finally:
        threading._shutdown()  # type: ignore[attr-defined]  # what interpreter exit does first: join non-daemon threads
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
    os._exit(code)


class Child:
    """``python ARGV`` (without the interpreter: ``["-m", "tests.unit.worker", ...]``,
    ``["-c", CODE, ...]`` or ``["script.py", ...]``) forked from the preloaded server. Its stdout is appended to
    ``output`` when given, else discarded; its stderr to ``errors``, else where stdout goes."""

    def __init__(self, argv: list[str], *, cwd: str | Path | None = None, env: dict[str, str] | None = None,
                 output: str | Path | None = None, errors: str | Path | None = None,
                 new_session: bool = False) -> None:
        if argv and argv[0] == sys.executable:
            argv = argv[1:]
        self.args = list(argv)
        self.output = Path(output) if output is not None else None
        self._proc = _server().Process(
            target=_run, args=(self.args, str(cwd or os.getcwd()), dict(os.environ if env is None else env),
                               str(output) if output is not None else None,
                               str(errors) if errors is not None else None, new_session), daemon=False)
        self._proc.start()
        self.pid: int = self._proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self._proc.exitcode

    def send_signal(self, sig: int) -> None:
        if self._proc.exitcode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def read_output(self) -> str:
        return _text(self.output) if self.output else ""

    def first_line(self, timeout: float) -> str:
        """The first whole line of output (the child's "ready"); ``AssertionError`` if the child
        ends first or nothing comes within ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            text = self.read_output()
            if "\n" in text:
                return text.split("\n", 1)[0]
            assert self.poll() is None, f"{self.args} ended ({self.returncode}) before its first line: {text!r}"
            assert time.monotonic() < deadline, f"{self.args} printed no line within {timeout:.0f}s"
            time.sleep(0.01)

    def communicate(self, timeout: float | None = None) -> str:
        """Wait for the end (``TimeoutExpired`` past ``timeout``) and return the output."""
        self.wait(timeout)
        return self.read_output()

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.poll() is None:
            self.kill()
            self.wait(30)


def _text(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def run(argv: list[str], *, cwd: str | Path | None = None, env: dict[str, str] | None = None,
        timeout: float | None = None) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(argv, capture_output=True, text=True, timeout=...)`` for a forked
    child: stdout and stderr apart; past ``timeout`` the child is killed and
    ``TimeoutExpired`` raised."""
    with tempfile.TemporaryDirectory(prefix="prefork-") as tmp:
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        with Child(argv, cwd=cwd, env=env, output=out, errors=err) as child:  # killed if it overruns
            code = child.wait(timeout)
        return subprocess.CompletedProcess(child.args, code, _text(out), _text(err))


def wait_all(children: list[Child], timeout_s: float, *, kill_late: bool = False) -> list[int]:
    """Every child's exit code (a world of ranks). Past ``timeout_s`` the ones still running
    are killed; then ``TimeoutExpired`` is raised, or with ``kill_late`` their codes are
    returned (-SIGKILL: survivors of a killed peer, which a scheduler would end)."""
    deadline = time.monotonic() + timeout_s
    try:
        return [c.wait(max(0.0, deadline - time.monotonic())) for c in children]
    except subprocess.TimeoutExpired:
        for c in children:
            c.kill()
        codes = [c.wait(30) for c in children]
        if kill_late:
            return codes
        raise
