"""The Slurm adapter's contract: a ``Cluster`` is the job environment plus verbs.

Call sequence during a stop (see DESIGN.md, "Data flow"):
  1. every rank: the final checkpoint is committed and durable;
  2. coordinator only: ``requeue(cause, state_dir)``; with the Slurm CLI backend
     ``scontrol requeue`` kills the whole job at once, so nothing that matters may
     follow it; the returned outcome is for logging and for the local backend,
     whose "requeue" is the exit status ``EXIT_REQUEUE`` the caller must exit with.
``end_time()``, ``reservations()`` and ``node_state()`` ask Slurm every call: a
preemption, ``scontrol update`` or a new MAINT reservation can change the answer
while the job runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from hpcckpt.cluster.env import JobEnv

if TYPE_CHECKING:
    from hpcckpt.cluster.budget import BudgetOptions  # budget imports this module


class Cause(str, Enum):
    """Why a job stops; also the key of the per-cause requeue budgets."""

    TIME_LIMIT = "time_limit"
    PREEMPTION = "preemption"
    MAINTENANCE = "maintenance"
    NODE_FAILURE = "node_failure"
    RANK_FAILURE = "rank_failure"  # a rank died or hung; the survivors saved (JIT) and requeued
    USER_CANCEL = "user_cancel"
    SIGNAL = "signal"
    FAILURE = "failure"
    DONE = "done"
    UNKNOWN = "unknown"

    # A Cause is its value wherever a string is expected (f-strings, logs, JSON): Python
    # 3.11 formats a plain (str, Enum) member as "Cause.TIME_LIMIT" otherwise.
    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

    @classmethod
    def parse(cls, text: str) -> Cause:
        norm = text.strip().lower().replace("-", "_")
        aliases = {"timeout": cls.TIME_LIMIT, "deadline": cls.TIME_LIMIT,
                   "preempted": cls.PREEMPTION, "maint": cls.MAINTENANCE,
                   "node_fail": cls.NODE_FAILURE, "rank_fail": cls.RANK_FAILURE, "cancelled": cls.USER_CANCEL,
                   "error": cls.FAILURE, "failed": cls.FAILURE}
        if norm in aliases:
            return aliases[norm]
        try:
            return cls(norm)
        except ValueError:
            return cls.UNKNOWN


@dataclass(frozen=True, kw_only=True)
class RequeueOutcome:
    """What ``Cluster.requeue`` did.

    ``method``: "scontrol" | "pyslurm" | "successor" | "exit" (local: the caller exits
    with ``exit_code``) | "none" (refused by a budget or crash-loop guard; ``detail``
    says why and what to change).
    """

    requeued: bool
    method: str
    detail: str
    cause: str
    job_id: str | None = None
    successor_job_id: str | None = None
    exit_code: int | None = None

    def as_dict(self) -> dict[str, object]:
        return {"requeued": self.requeued, "method": self.method, "detail": self.detail,
                "cause": self.cause, "job_id": self.job_id,
                "successor_job_id": self.successor_job_id, "exit_code": self.exit_code}


@dataclass(frozen=True, kw_only=True)
class Reservation:
    """A Slurm reservation (times in epoch seconds)."""

    name: str
    start_s: float
    end_s: float
    nodes: tuple[str, ...]
    flags: tuple[str, ...]

    @property
    def is_maintenance(self) -> bool:
        return "MAINT" in self.flags

    def overlaps(self, *, nodes: list[str], start_s: float, end_s: float) -> bool:
        """True when it shares a node with ``nodes`` and a moment with [start_s, end_s)."""
        shares_node = not self.nodes or "ALL" in self.nodes or bool(set(self.nodes) & set(nodes))
        return shares_node and self.start_s < end_s and start_s < self.end_s


class ClusterBase:
    """What every backend shares: the job's environment and the requeue budget options."""

    name = "base"

    def __init__(self, env: JobEnv | None = None, *, budget: BudgetOptions | None = None) -> None:
        self.env = env or JobEnv()
        self._budget = budget

    @property
    def is_coordinator(self) -> bool:
        return self.env.is_coordinator


@runtime_checkable
class Cluster(Protocol):
    """A scheduler backend. Verbs that change the job run on the coordinator only."""

    name: str
    env: JobEnv

    @property
    def is_coordinator(self) -> bool: ...

    def requeue(self, cause: str, state_dir: Path, *, committed_step: int | None = None) -> RequeueOutcome:
        """Coordinator only, after the final checkpoint is durable."""
        ...

    def end_time(self) -> float | None:
        """Epoch seconds when the scheduler will stop the job; None when unlimited/unknown."""
        ...

    def reservations(self) -> list[Reservation]:
        """MAINT reservations that overlap this job's nodes and remaining time."""
        ...

    def node_state(self) -> str:
        """This node's scheduler state, e.g. "IDLE", "ALLOCATED", "MIXED+DRAIN"; "" if unknown."""
        ...

    def submit_successor(self, *, dependency_job_id: str | None = None) -> str:
        """Coordinator only: resubmit this job's batch script to run after this one; returns its id."""
        ...


def node_is_draining(state: str) -> bool:
    """True for DRAIN/DRAINING/DRAINED/FAIL/MAINT states: the node will not keep running jobs."""
    parts = {p.strip("*~#!%$@^-").upper() for p in state.replace("+", " ").split()}
    return bool(parts & {"DRAIN", "DRAINING", "DRAINED", "FAIL", "FAILING", "MAINT", "REBOOT_ISSUED"})
