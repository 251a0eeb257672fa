"""The Slurm adapter's contract: a ``Cluster`` is the job environment plus verbs.

Call sequence during a stop (see DESIGN.md, "Data flow"):
  1. every rank: the final checkpoint is committed and durable;
  2. coordinator only, through ``hpcckpt.lifecycle.requeue`` (which charges the budget
     and records the outcome): ``stop_cause(cause)`` then ``requeue_job(cause)``. With
     Slurm the job is requeued and the requeue confirmed from Slurm's record (pending
     again), or a successor is submitted; ``scontrol requeue`` ends the job within
     KillWait, so nothing that matters may follow the record. The local backend's
     "requeue" is the exit status ``EXIT_REQUEUE`` the caller must exit with.
The adapter reads the environment and runs scheduler verbs; it records nothing.
``end_time()``, ``reservations()`` and ``node_state()`` ask Slurm every call: a
preemption, ``scontrol update`` or a new MAINT reservation can change the answer
while the job runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Protocol, runtime_checkable

from hpcckpt.cluster.env import JobEnv


class Cause(str, Enum):
    """Why a job stops; also the key of the per-cause requeue budgets."""

    TIME_LIMIT = "time_limit"
    PREEMPTION = "preemption"
    MAINTENANCE = "maintenance"
    NODE_FAILURE = "node_failure"
    RANK_FAILURE = "rank_failure"  # a rank died or hung; the survivors saved (JIT) and requeued
    USER_CANCEL = "user_cancel"
    OPERATOR_REQUEUE = "operator_requeue"  # `scontrol requeue` by someone else (an admin, a script)
    SUPERSEDED = "superseded"  # another job (a successor, a duplicate) had taken over the directory
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
                   "node_fail": cls.NODE_FAILURE, "requeue": cls.OPERATOR_REQUEUE, "rank_fail": cls.RANK_FAILURE, "cancelled": cls.USER_CANCEL,
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

    ``method``: "scontrol" (requeued by hpcckpt) | "slurm" (Slurm had requeued it
    already) | "successor" (a new job continues this one) | "exit" (local: the caller
    exits with ``exit_code``) | "none" (refused by a budget or crash-loop guard, or
    Slurm refused and no successor could be submitted; ``detail`` says why and what to
    change) | "error". ``requeued`` is True only when confirmed: ``evidence`` is what
    Slurm said (``JobState=PENDING``, ``Restarts=2``, the successor's record).
    """

    requeued: bool
    method: str
    detail: str
    cause: str
    job_id: str | None = None
    successor_job_id: str | None = None
    exit_code: int | None = None
    evidence: str | None = None

    def as_dict(self) -> dict[str, object]:
        return {"requeued": self.requeued, "method": self.method, "detail": self.detail,
                "cause": self.cause, "job_id": self.job_id, "successor_job_id": self.successor_job_id,
                "exit_code": self.exit_code, "evidence": self.evidence}


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
    """What every backend shares: the job's environment."""

    name = "base"
    # Whether a query is a call into a scheduler (slurmctld), which may be slow or down: the
    # training thread then never makes it itself (``Policy(background=True)``).
    remote = False

    def __init__(self, env: JobEnv | None = None) -> None:
        self.env = env or JobEnv()

    @property
    def is_coordinator(self) -> bool:
        return self.env.is_coordinator

    def grace_time_s(self) -> float | None:
        """The GraceTime of this job's partition (how long a preemption's notice runs before
        Slurm's TERM), None when unknown or there is no scheduler."""
        return None


@runtime_checkable
class Cluster(Protocol):
    """A scheduler backend. Verbs that change the job run on the coordinator only."""

    name: str
    env: JobEnv

    @property
    def is_coordinator(self) -> bool: ...

    def stop_cause(self, cause: str) -> str:
        """The cause as the scheduler knows it (a stop on a moved end time was a preemption)."""
        ...

    def requeue_job(self, cause: str) -> RequeueOutcome:
        """Coordinator only, after the final checkpoint is durable: put the job back, confirmed.

        Use ``hpcckpt.lifecycle.requeue``, which charges the budget and records the outcome.
        """
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

    def grace_time_s(self) -> float | None:
        """The GraceTime of this job's partition; None when unknown (``ClusterBase`` gives it)."""
        ...

    def submit_successor(self, *, dependency_job_id: str | None = None) -> str:
        """Coordinator only: the same job (script, allocation, array index) after this one; its id."""
        ...


def node_is_draining(state: str) -> bool:
    """True for DRAIN/DRAINING/DRAINED/FAIL/MAINT states: the node will not keep running jobs."""
    parts = {p.strip("*~#!%$@^-").upper() for p in state.replace("+", " ").split()}
    return bool(parts & {"DRAIN", "DRAINING", "DRAINED", "FAIL", "FAILING", "MAINT", "REBOOT_ISSUED"})
