"""No scheduler: "requeue" means the process exits with EXIT_REQUEUE (75) and the
local supervisor (``hpcckpt.supervisor``) starts it again."""

from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path

from hpcckpt.cluster.base import Cause, ClusterBase, Reservation, RequeueOutcome
from hpcckpt.cluster.budget import charge
from hpcckpt.exitcodes import EXIT_REQUEUE
from hpcckpt.supervisor import RESTART_ENV

log = logging.getLogger("hpcckpt.cluster")

_PROCESS_TAG = secrets.token_hex(4)  # tells apart processes that happen to reuse a PID


def _attempt() -> str:
    """This run, for the budget: each restart by the local supervisor is a new attempt.

    Under ``hpcckpt.supervisor`` the restart number it sets counts; a process started
    some other way is its own attempt (charging twice within it counts once).
    """
    restart = os.environ.get(RESTART_ENV)
    if restart is not None:
        return f"local-{os.getppid()}:{restart}"
    return f"local-pid-{os.getpid()}-{_PROCESS_TAG}"


class LocalCluster(ClusterBase):
    """Backend for runs outside Slurm (the demo, laptops, CI unit tiers)."""

    name = "local"

    def requeue(self, cause: str, state_dir: Path, *, committed_step: int | None = None) -> RequeueOutcome:
        """Charge the budget; the caller then exits with ``outcome.exit_code``."""
        decision = charge(state_dir, cause, attempt=_attempt(), committed_step=committed_step, options=self._budget)
        cause_value = Cause.parse(cause).value
        if not decision.allowed:
            log.warning("not requeueing: %s", decision.reason)
            return RequeueOutcome(requeued=False, method="none", detail=decision.reason,
                                  cause=cause_value)
        return RequeueOutcome(
            requeued=True, method="exit", cause=cause_value, exit_code=EXIT_REQUEUE,
            detail=f"exit {EXIT_REQUEUE}: the local supervisor restarts the command ({decision.reason})")

    def end_time(self) -> float | None:
        value = os.environ.get("HPCCKPT_END_TIME")
        return float(value) if value else None

    def reservations(self) -> list[Reservation]:
        return []

    def node_state(self) -> str:
        return ""

    def submit_successor(self, *, dependency_job_id: str | None = None) -> str:
        raise NotImplementedError("no scheduler to submit to; the local supervisor restarts on exit 75")
