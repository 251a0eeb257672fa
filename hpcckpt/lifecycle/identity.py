"""Who this process is, made once from the environment: job, array task, restarts, rank, host.

This module and ``cluster/`` are the only readers of ``SLURM_*`` variables. Everything
the lifecycle records (ledger events, requeue budgets, the successor's lineage) names
the job the way Slurm's own tools do: ``<array job>_<task>`` for an array task (the
raw ``SLURM_JOB_ID`` of a task is a number of its own that ``sacct`` and the queue
never show next to the array), else the job id.
"""

from __future__ import annotations

import os
import secrets
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ..cluster.env import JobEnv
from ..config import read_internal
from ..errors import ConfigError

_PROCESS_TAG = secrets.token_hex(4)  # tells apart processes that happen to reuse a PID


@dataclass(frozen=True, kw_only=True)
class Identity:
    """This process's place in the job; frozen: a requeued job is a new process."""

    job_id: str | None  # "A_T" for an array task, else SLURM_JOB_ID; None outside Slurm
    raw_job_id: str | None  # SLURM_JOB_ID itself (what `scontrol` acts on for a task too)
    array_job_id: str | None = None
    array_task_id: str | None = None
    restart_count: int = 0  # SLURM_RESTART_COUNT
    local_restart: int | None = None  # the local supervisor's restart number; None when not under it
    rank: int = 0
    host: str = ""
    # The node this process runs on, as the job's ranks tell nodes apart: Slurm's node name,
    # else torchrun's node rank (GROUP_RANK), else the host name.
    node: str = ""
    in_step: bool = False  # inside an srun step (not the batch shell)

    @property
    def in_slurm(self) -> bool:
        return self.raw_job_id is not None

    @property
    def restart(self) -> int:
        """Restarts so far, whoever restarts: Slurm's count under Slurm, the local one outside."""
        return self.restart_count if self.in_slurm else (self.local_restart or 0)

    @property
    def attempt(self) -> str:
        """This run, for the requeue budgets: charging one run twice counts once."""
        if self.in_slurm:
            return f"{self.job_id}:{self.restart_count}"
        if self.local_restart is not None:
            return f"local-{os.getppid()}:{self.local_restart}"
        return f"local-pid-{os.getpid()}-{_PROCESS_TAG}"  # not restarted by anyone: its own attempt

    def record(self) -> dict[str, object]:
        """The fields every ledger event carries."""
        return {"job_id": self.job_id, "slurm_job_id": self.raw_job_id, "restart_count": self.restart_count,
                "local_restart": self.local_restart or 0, "host": self.host, "pid": os.getpid()}

    def as_job(self, backend: str) -> dict[str, object]:
        """The ``job`` block of a checkpoint's manifest; ``backend`` is the cluster's ``name``."""
        return {"job_id": self.job_id, "restart_count": self.restart_count, "backend": backend}


def _local_restart(environ: Mapping[str, str]) -> int | None:
    value = read_internal("LOCAL_RESTART", environ)  # RESTART_ENV, or the name older versions set
    if value is None:
        return None
    try:
        return int(value or 0)
    except ValueError:
        return 0


def current(environ: Mapping[str, str] | None = None) -> Identity:
    """The identity of this process (``environ`` defaults to ``os.environ``)."""
    environ = os.environ if environ is None else environ
    env = JobEnv(environ=environ)
    return Identity(
        job_id=env.job_id, raw_job_id=env.raw_job_id, array_job_id=env.array_job_id,
        array_task_id=env.array_task_id, restart_count=_lenient(lambda: env.restart_count),
        local_restart=_local_restart(environ), rank=_lenient(lambda: env.global_rank),
        host=socket.gethostname(), in_step=env.in_step, node=_node(env, environ))


def _node(env: JobEnv, environ: Mapping[str, str]) -> str:
    if env.node_name:
        return env.node_name
    group = environ.get("GROUP_RANK", "").strip()  # torchrun's node rank
    return f"node-{group}" if group.isdigit() else socket.gethostname()


def _lenient(read: Callable[[], int]) -> int:
    """A malformed Slurm number counts as 0 here: a record must never stop training."""
    try:
        return read()
    except ConfigError:
        return 0
