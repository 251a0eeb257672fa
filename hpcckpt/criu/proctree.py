"""Reading a process tree from /proc (outer PIDs, as the supervisor sees them)."""
from __future__ import annotations

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


def ns_pids(pid: int) -> list[int]:
    """The NSpid line: the PID in each namespace, outermost first (empty when gone)."""
    try:
        for line in (PROC / str(pid) / "status").read_text().splitlines():
            if line.startswith("NSpid:"):
                return [int(tok) for tok in line.split()[1:]]
    except (FileNotFoundError, ProcessLookupError):
        pass
    return []


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


def alive(pid: int) -> bool:
    try:
        state = (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")
