"""Reading a process tree from /proc (host PIDs, as the supervisor sees them)."""
from __future__ import annotations

import os
from pathlib import Path

PROC = Path("/proc")


def children(pid: int) -> list[int]:
    """Direct children of every thread of ``pid`` (empty when it is gone)."""
    out: list[int] = []
    try:
        tasks = list((PROC / str(pid) / "task").iterdir())
    except (FileNotFoundError, ProcessLookupError):
        return out
    for task in tasks:
        try:
            out.extend(int(tok) for tok in (task / "children").read_text().split())
        except (FileNotFoundError, ProcessLookupError):
            continue
    return sorted(set(out))


def tree(root: int) -> list[int]:
    """``root`` and all its descendants, parents before children."""
    order = [root]
    i = 0
    while i < len(order):
        order.extend(c for c in children(order[i]) if c not in order)
        i += 1
    return order


def status_field(pid: int, name: str, *, task: int | None = None) -> str | None:
    """One ``Name:`` line of /proc/PID/status (or of one of its threads); None when gone."""
    path = PROC / str(pid) / ("status" if task is None else f"task/{task}/status")
    try:
        for line in path.read_text().splitlines():
            if line.startswith(name + ":"):
                return line.split(":", 1)[1].strip()
    except (FileNotFoundError, ProcessLookupError):
        pass
    return None


def ns_pids(pid: int, *, task: int | None = None) -> list[int]:
    """The NSpid line: the PID in each namespace, outermost first (empty when gone)."""
    value = status_field(pid, "NSpid", task=task)
    return [int(tok) for tok in value.split()] if value else []


def tasks(pid: int) -> list[int]:
    """Thread ids of ``pid`` (host view)."""
    try:
        return sorted(int(t.name) for t in (PROC / str(pid) / "task").iterdir())
    except (FileNotFoundError, ProcessLookupError):
        return []


def max_inner_id(root: int) -> int:
    """The highest PID or TID, inside its own namespace, of any thread in ``root``'s tree.

    A restore must start criu above it: criu gives every restored thread its old TID."""
    top = 0
    for pid in tree(root):
        for tid in tasks(pid):
            ids = ns_pids(pid, task=tid)
            top = max(top, ids[-1] if ids else 0)
    return top


def signal_masks(pid: int) -> tuple[int, int] | None:
    """``pid``'s (SigIgn, SigCgt) masks, from one read of /proc/PID/status; None when gone."""
    try:
        text = (PROC / str(pid) / "status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = dict(line.split(":", 1) for line in text.splitlines() if line.startswith(("SigIgn:", "SigCgt:")))
    if len(fields) < 2:
        return None
    return int(fields["SigIgn"], 16), int(fields["SigCgt"], 16)


def handling(masks: tuple[int, int], sig: int) -> str:
    """What a process with these (SigIgn, SigCgt) masks does with ``sig``: "ignored", "caught"
    (a handler of its own) or "default" (the kernel's action: TERM ends it)."""
    bit = 1 << (sig - 1)
    return "ignored" if masks[0] & bit else "caught" if masks[1] & bit else "default"


def disposition(pid: int, sig: int) -> str | None:
    """What ``pid`` does with ``sig`` (``handling``); None when it is gone."""
    masks = signal_masks(pid)
    return None if masks is None else handling(masks, sig)


def catches(pid: int, sig: int) -> bool:
    """True when ``pid`` has a handler installed for ``sig`` (SigCgt in /proc/PID/status)."""
    return disposition(pid, sig) == "caught"


def nvidia_files(pid: int) -> tuple[set[str], set[str]]:
    """(mapped, open) /dev/nvidia* files of ``pid`` (both empty when it is gone)."""
    mapped: set[str] = set()
    opened: set[str] = set()
    try:
        for fd in (PROC / str(pid) / "fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("/dev/nvidia"):
                opened.add(target)
        with open(PROC / str(pid) / "maps", encoding="utf-8", errors="replace") as f:
            mapped.update(line.split()[-1] for line in f if " /dev/nvidia" in line)
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return mapped, opened


def nvidia_handles(pid: int) -> list[str]:
    """/dev/nvidia* files ``pid`` holds open or mapped (a CUDA context or its leftovers)."""
    mapped, opened = nvidia_files(pid)
    return sorted(mapped | opened)


def command(pid: int, *, limit: int = 120) -> str:
    """``pid``'s command line, shortened for messages ("" when gone)."""
    try:
        raw = (PROC / str(pid) / "cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return ""
    text = " ".join(raw.replace(b"\0", b" ").decode(errors="replace").split())  # one line
    return text if len(text) <= limit else text[: limit - 3] + "..."


def inner_pid(pid: int) -> int | None:
    """The PID ``pid`` has inside its own (innermost) PID namespace."""
    pids = ns_pids(pid)
    return pids[-1] if pids else None


def maps_library(pid: int, needle: str) -> bool:
    """True when ``pid`` has a file whose name contains ``needle`` mapped."""
    try:
        with open(PROC / str(pid) / "maps", encoding="utf-8", errors="replace") as f:
            return any(needle in line for line in f)
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return False


def _state(stat: Path) -> str:
    """The one-letter state of a /proc stat file (after the command, which may hold ')')."""
    return stat.read_text().rsplit(")", 1)[1].split()[0]


def task_states(pid: int) -> dict[int, str]:
    """Each task's one-letter state (R, S, D, T stopped, t traced, Z...); empty when gone."""
    out: dict[int, str] = {}
    for tid in tasks(pid):
        try:
            out[tid] = _state(PROC / str(pid) / "task" / str(tid) / "stat")
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
    return out


def alive(pid: int) -> bool:
    try:
        state = _state(PROC / str(pid) / "stat")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")
