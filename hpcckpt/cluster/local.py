"""No scheduler: "requeue" means the process exits with EXIT_REQUEUE (75) and the
local restart loop (``hpcckpt.lifecycle.restart``) starts it again."""

from __future__ import annotations

from hpcckpt.cluster.base import Cause, ClusterBase, RequeueOutcome, Reservation
from hpcckpt.config import env_value
from hpcckpt.exitcodes import EXIT_REQUEUE


class LocalCluster(ClusterBase):
    """Backend for runs outside Slurm (the demo, laptops, CI unit tiers)."""

    name = "local"

    def stop_cause(self, cause: str) -> str:
        return cause

    def requeue_job(self, cause: str) -> RequeueOutcome:
        """Nothing to ask: the caller exits with ``outcome.exit_code`` and is restarted."""
        return RequeueOutcome(
            requeued=True, method="exit", cause=Cause.parse(cause).value, exit_code=EXIT_REQUEUE,
            evidence=f"exit {EXIT_REQUEUE}",
            detail=f"exit {EXIT_REQUEUE}: the local supervisor restarts the command")

    def end_time(self) -> float | None:
        value: float | None = env_value("end_time", None)
        return value

    def reservations(self) -> list[Reservation]:
        return []

    def node_state(self) -> str:
        return ""

    def submit_successor(self, *, dependency_job_id: str | None = None) -> str:
        raise NotImplementedError("no scheduler to submit to; the local supervisor restarts on exit 75")
