"""When a test's wait on a process runs out, the failure carries that process's stacks.

``install()`` (from tests/conftest.py) wraps ``subprocess.Popen.communicate`` and ``.wait``:
a wait with a timeout of ``MIN_TIMEOUT_S`` or more that expires dumps, before anything kills
the process, the Python and native stacks of it and every process below it (``py-spy dump
--native``; the kernel's wait channel for what is not Python), and the ``TimeoutExpired`` it
raises says them. ``subprocess.run(..., timeout=...)`` waits through ``communicate``, so every
test that runs a command with a timeout is covered. Short timeouts (polling loops that expect
to time out) are left alone. ``tree_stacks(pids)`` serves the waits on Slurm jobs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

MIN_TIMEOUT_S = 20.0  # a wait this long that expires is a hang worth explaining
MAX_PROCESSES = 16
DUMP_TIMEOUT_S = 20.0  # py-spy per process


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rpartition(")")[2].split()[1])
        kids.setdefault(ppid, []).append(int(entry.name))
    return kids


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it, parents first."""
    kids, out, todo = _children(), [], [pid]
    while todo and len(out) < MAX_PROCESSES:
        p = todo.pop(0)
        out.append(p)
        todo.extend(sorted(kids.get(p, [])))
    return out


def _py_spy() -> str | None:
    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if beside.exists() else shutil.which("py-spy")


def _describe(pid: int, spy: str | None) -> str:
    try:
        cmd = (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        wchan = (Path("/proc") / str(pid) / "wchan").read_text()
    except OSError:
        return f"--- pid {pid}: gone"
    head = f"--- pid {pid}: {cmd.strip()[:300]} (kernel wait: {wchan or '-'})"
    if spy is None or "python" not in cmd:
        return head
    try:
        proc = subprocess.run([spy, "dump", "--native", "--pid", str(pid)], capture_output=True, text=True,
                              timeout=DUMP_TIMEOUT_S, check=False)
        body = (proc.stdout or proc.stderr).strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        body = f"(py-spy: {exc})"
    return f"{head}\n{body}"


def tree_stacks(pids: Iterable[int]) -> str:
    """The stacks of ``pids`` and of every process below them."""
    spy = _py_spy()
    seen: list[int] = []
    for pid in pids:
        seen += [p for p in descendants(pid) if p not in seen]
    lines = [_describe(p, spy) for p in seen[:MAX_PROCESSES]]
    note = "" if spy else " (py-spy not installed: Python stacks missing)"
    return f"stacks at the timeout, {time.strftime('%H:%M:%S')}{note}:\n" + "\n".join(lines)


def job_pids(job_id: str) -> list[int]:
    """The processes of a Slurm job on this machine (the local cluster's nodes all run here):
    those whose environment says ``SLURM_JOB_ID=job_id``."""
    mark = f"SLURM_JOB_ID={job_id}\0".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if mark in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return sorted(found)


def job_stacks(job_id: str) -> str:
    """The stacks of a Slurm job's processes, for a test's failure message."""
    pids = job_pids(job_id)
    return tree_stacks(pids) if pids else f"(no process of job {job_id} runs here)"


class TimeoutWithStacks(subprocess.TimeoutExpired):
    """``TimeoutExpired`` whose message ends with the stacks of the process that overstayed."""

    def __init__(self, cmd: Any, timeout: float, output: Any, stderr: Any, stacks: str) -> None:
        super().__init__(cmd, timeout, output=output, stderr=stderr)
        self.stacks = stacks

    def __str__(self) -> str:
        return f"{super().__str__()}\n{self.stacks}"


_ORIGINAL_COMMUNICATE = subprocess.Popen.communicate
_ORIGINAL_WAIT = subprocess.Popen.wait


def _explained(proc: subprocess.Popen[Any], exc: subprocess.TimeoutExpired,
               timeout: float | None) -> subprocess.TimeoutExpired:
    if timeout is None or timeout < MIN_TIMEOUT_S or isinstance(exc, TimeoutWithStacks) or proc.poll() is not None:
        return exc
    try:
        stacks = tree_stacks([proc.pid])
    except Exception as err:  # noqa: BLE001 - the timeout stays the failure, whatever the dump does
        stacks = f"(stacks could not be taken: {err})"
    return TimeoutWithStacks(exc.cmd, exc.timeout, exc.output, exc.stderr, stacks)


def _communicate(self: subprocess.Popen[Any], input: Any = None, timeout: float | None = None) -> Any:
    try:
        return _ORIGINAL_COMMUNICATE(self, input, timeout)
    except subprocess.TimeoutExpired as exc:
        raise _explained(self, exc, timeout) from None


def _wait(self: subprocess.Popen[Any], timeout: float | None = None) -> int:
    try:
        return _ORIGINAL_WAIT(self, timeout)
    except subprocess.TimeoutExpired as exc:
        raise _explained(self, exc, timeout) from None


def install() -> None:
    """Wrap the waits of every ``Popen`` in this process (idempotent)."""
    if os.environ.get("HPCCKPT_TEST_NO_STACKS"):
        return
    subprocess.Popen.communicate = _communicate  # type: ignore[method-assign]
    subprocess.Popen.wait = _wait  # type: ignore[method-assign]
