"""The one requeue routine of every mode (Checkpointer, JIT guard, CRIU supervisor, CLI).

Call sequence, on the coordinator only, after the final checkpoint is durable::

    outcome = requeue(cluster=..., state_dir=..., cause=..., committed_step=..., source=...)
    # then exit: with outcome.exit_code when it has one (local: 75)

1. the cause as the scheduler knows it (``cluster.stop_cause``: a stop on a moved end
   time was a preemption; a job Slurm timed out hit its time limit; a job its user or an
   operator cancelled (``scancel``) is never requeued and gets no successor, in every mode);
2. the per-cause budget (``budget.charge``), unless it cannot be read in time;
3. ``cluster.requeue_job``: requeued and confirmed from Slurm's record, or a successor;
4. ONE ``requeue`` event in the ledger (this schema, nowhere else), and when the job is
   not going to run again the reason on stderr too.
Stop signals arriving meanwhile (``scontrol requeue`` itself makes Slurm TERM the job)
are held off while this runs, so the record is written; Slurm's KILL still ends it.
"""
from __future__ import annotations

import contextlib
import logging
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..cluster.base import Cause, Cluster, RequeueOutcome
from ..cluster.scontrol import within
from .budget import BudgetOptions, charge
from .identity import Identity, current
from .ledger import Ledger

EVENT = "requeue"
CANCELLED = "cancelled"  # the method of a requeue refused because the job was cancelled
SCHEDULER_S = 30.0  # at most this long in calls to the scheduler, all of a stop's together
EXIT_S = 2.0  # of the time left: kept for the record and the exit
log = logging.getLogger("hpcckpt.lifecycle")


def requeue(*, cluster: Cluster, state_dir: Path, cause: str, committed_step: int | None,
            source: str, identity: Identity | None = None, ledger: Ledger | None = None,
            budget: BudgetOptions | None = None, note: str | None = None,
            unstarted: bool = False, within_s: float | None = None) -> RequeueOutcome:
    """Put this job back in the queue (or say why not), record it once, and return the outcome.
    ``unstarted``: the run was stopped in its start-up, before it began training (recorded, so
    that a second such stop in a row can be told from the first). ``within_s``: the time left
    before the job's end (its grace, its time limit), when known: every call into the
    scheduler ends within it (less ``EXIT_S`` for the record and the exit), and within
    ``SCHEDULER_S`` at most, so a slow or absent slurmctld cannot hold the stop."""
    identity = identity or current()
    ledger = ledger or Ledger(state_dir, identity=identity)
    limit = SCHEDULER_S if within_s is None else max(1.0, min(SCHEDULER_S, within_s - EXIT_S))
    with _held_off(), within(limit):
        outcome = _decide(cluster, Path(state_dir), cause, committed_step, identity, budget)
        fields: dict[str, Any] = {"source": source, **outcome.as_dict(), **({"note": note} if note else {}),
                                  **({"unstarted": True} if unstarted else {})}
        ledger.append(EVENT, **fields)
    if not outcome.requeued:
        print(f"hpcckpt: job {identity.job_id or '(local)'} NOT requeued: {outcome.detail}",
              file=sys.stderr, flush=True)
    return outcome


def _decide(cluster: Cluster, state_dir: Path, cause: str, committed_step: int | None,
            identity: Identity, budget: BudgetOptions | None) -> RequeueOutcome:
    try:
        cause = cluster.stop_cause(cause)
    except Exception as exc:  # noqa: BLE001 - the caller's cause stands when Slurm cannot be asked
        log.info("hpcckpt: could not ask the scheduler why the job stops (%s); cause %s stands", exc, cause)
    if Cause.parse(cause) is Cause.USER_CANCEL:
        return RequeueOutcome(requeued=False, method=CANCELLED, cause=Cause.USER_CANCEL.value, job_id=identity.job_id,
                              detail=f"job {identity.job_id} was cancelled (scancel): it ends here, as asked. To "
                                     "stop a job for a requeue instead, signal it: scancel --signal=TERM --full "
                                     f"{identity.job_id}, or scontrol requeue {identity.job_id}")
    decision = charge(state_dir, cause, attempt=identity.attempt, committed_step=committed_step, options=budget)
    if not decision.allowed:
        return RequeueOutcome(requeued=False, method="none", detail=decision.reason,
                              cause=Cause.parse(cause).value, job_id=identity.job_id)
    try:
        return cluster.requeue_job(cause)
    except Exception as exc:  # noqa: BLE001 - exit 75 still lets a batch script or supervisor retry
        return RequeueOutcome(requeued=False, method="error", cause=Cause.parse(cause).value,
                              job_id=identity.job_id, detail=f"{type(exc).__name__}: {exc}")


_HELD = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


@contextlib.contextmanager
def _held_off() -> Iterator[None]:
    """Signals whose default would kill this process are ignored while the requeue is decided
    and recorded; handlers already installed (hpcckpt's recorder) stay as they are."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {s: signal.getsignal(s) for s in _HELD}
    for s, handler in saved.items():
        if handler is signal.SIG_DFL:
            signal.signal(s, signal.SIG_IGN)
    try:
        yield
    finally:
        for s, handler in saved.items():
            if handler is signal.SIG_DFL:
                signal.signal(s, handler)
