"""Can criu dump this job? Said soon after the job starts, not at its first preemption.

A cheap look at what every process of the job's tree holds open, from /proc, for the
resources criu 4 refuses: an io_uring instance (criu: "Unknown shit 600
(anon_inode:[io_uring])"; torchrun's TCPStore and libuv use one), perf events, and
established TCP connections when ``--tcp-established`` is not given (torchrun's
rendezvous, a remote logger). The job is never touched: it keeps running, and the
supervisor says at once, on stderr and in the ledger (``criu_check``), what would fail
and what to use instead. ``hpcckpt doctor`` runs the same look at running CRIU-mode jobs.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

from ..proc import tree as proctree

# anon inodes criu cannot dump, and what each is
REFUSED_ANON = {
    "anon_inode:[io_uring]": "an io_uring instance",
    "anon_inode:[perf_event]": "a perf event",
}
TCP_ESTABLISHED = "01"  # st column of /proc/net/tcp{,6}
SAID = 4  # problems named on stderr (the ledger has them all)
TORCHRUN_FIX = ("run it with hpcckpt's in-process checkpoints instead: `hpcckpt template torchrun` (torchrun, "
                "DDP), or `hpcckpt run --mode app` around a script that uses hpcckpt's Checkpointer")


@dataclass(frozen=True, kw_only=True)
class Problem:
    pid: int
    inner_pid: int | None
    command: str
    fd: int
    what: str

    def text(self) -> str:
        inner = f" (PID {self.inner_pid} in the job)" if self.inner_pid else ""
        return f"PID {self.pid}{inner} `{self.command}` holds {self.what} on fd {self.fd}"

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def _fd_targets(pid: int) -> list[tuple[int, str]]:
    fd_dir = Path("/proc") / str(pid) / "fd"
    out = []
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return []
    for name in names:
        try:
            out.append((int(name), os.readlink(fd_dir / name)))
        except (OSError, ValueError):
            continue
    return out


def established_inodes(pid: int) -> set[str]:
    """Socket inodes of established TCP connections in the network namespace of ``pid``."""
    inodes = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = (Path("/proc") / str(pid) / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) > 9 and cols[3] == TCP_ESTABLISHED:
                inodes.add(cols[9])
    return inodes


def _what(target: str, tcp: set[str], *, tcp_allowed: bool) -> str | None:
    if target in REFUSED_ANON:
        return REFUSED_ANON[target]
    if not tcp_allowed and target.startswith("socket:[") and target[8:-1] in tcp:
        return "an established TCP connection (criu needs --tcp-established and the same addresses at restore)"
    return None


def problems(root: int, *, tcp_allowed: bool = False) -> list[Problem]:
    """What in the tree under ``root`` criu would refuse (empty: nothing seen)."""
    found = []
    for pid in proctree.tree(root):
        tcp = established_inodes(pid) if not tcp_allowed else set()
        for fd, target in _fd_targets(pid):
            what = _what(target, tcp, tcp_allowed=tcp_allowed)
            if what:
                found.append(Problem(pid=pid, inner_pid=proctree.inner_pid(pid),
                                     command=proctree.command(pid, limit=80), fd=fd, what=what))
    return found


def fix(found: list[Problem]) -> str:
    if any("io_uring" in p.what or "perf" in p.what for p in found):
        return TORCHRUN_FIX
    return ("give --tcp-established (the same addresses must exist at restore) or close the connection "
            f"before the stop; or {TORCHRUN_FIX}")


def lines(found: list[Problem]) -> list[str]:
    """The loud message: what cannot be dumped, that the job runs on, and what to do."""
    named = "; ".join(p.text() for p in found[:SAID])
    more = f"; and {len(found) - SAID} more" if len(found) > SAID else ""
    return ["!" * 72,
            f"THIS JOB CANNOT BE DUMPED BY CRIU: {named}{more}",
            "It keeps running (hpcckpt never kills it), but a preemption or time limit will end it without an "
            "image: its next run restores an older image if there is one, else starts from the beginning.",
            f"What to do: {fix(found)}.",
            "!" * 72]
