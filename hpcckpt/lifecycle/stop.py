"""When and why an in-process run stops, and how: the stop routine of ``Checkpointer``.

At each step boundary ``Stop.at_boundary`` gathers what asks for a stop (a signal, the
deadline, a maintenance window, ``HPCCKPT_STOP_AT_STEPS``) and every rank agrees on the
most urgent. ``Stop.stop`` then runs the stop in this order: the mode's final save (a
callback the mode hands in; the stop knows nothing of engines), the no-progress guard
(``no_progress``, counted by ``budget.no_progress``), the ``stop`` record, the figures, the requeue (``lifecycle.requeue``),
the mode's close, and ``RequeueExit`` (exit 75) or ``RefusedExit`` (exit 1). The costs it
judges by (step and save times, the stop's lead) are the ``Policy``'s measurements, and the
state's size for a first estimate comes as a value; it imports no mode.

After the run's last step ``guard_after_run`` keeps a stop signal a requeue until the
process exits (``signals.AfterRun``), holding only what the requeue needs.
"""
from __future__ import annotations

import functools
import logging
import sys
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, NoReturn

from ..cluster.base import Cause, Cluster
from ..errors import HpcckptError
from ..exitcodes import EXIT_PROBLEM, EXIT_REQUEUE, flush_and_exit
from ..policy import WARNING_SIGNALS, Figures, Policy, StopReason, estimate_save_s
from ..signals import AfterRun, Received, SignalRecorder
from .budget import no_progress
from .ledger import Ledger
from .records import record_stop
from .requeue import requeue

if TYPE_CHECKING:
    import signal

    from ..ranks import Ranks

log = logging.getLogger("hpcckpt")

# Allocations in a row that reach their deadline without a newer committed step before the job
# is refused (exit 1) instead of requeued: one may be a slow start; two would repeat forever.
DEADLINES_WITHOUT_PROGRESS = 2


class RequeueExit(SystemExit):
    """Raised after the final checkpoint is durable (and the job requeued): exit 75."""

    def __init__(self, reason: str, step: int) -> None:
        super().__init__(EXIT_REQUEUE)
        self.reason = reason
        self.step = step


class RefusedExit(SystemExit):
    """The job cannot progress within its time limit: exit 1, no requeue (the reason was logged)."""

    def __init__(self, reason: str, step: int) -> None:
        super().__init__(EXIT_PROBLEM)
        self.reason = reason
        self.step = step


@dataclass(frozen=True)
class Run:
    """Where the run stands as it stops: its step, its newest committed step, the step it
    started this allocation at, and how long the process took to start (None: unknown)."""

    step: int
    committed_step: int | None
    start_step: int
    startup_s: float | None


# The mode's final save: the committed step after it, and why it failed (None: durable).
FinalSave = Callable[[], "tuple[int | None, str | None]"]


class Stop:
    """The stop routine of an in-process run (one per ``Checkpointer``; every rank holds one)."""

    def __init__(self, *, ranks: Ranks, ledger: Ledger, cluster: Cluster, root: Path, policy: Policy,
                 figures: Figures, signals: SignalRecorder, stop_at: tuple[int, ...],
                 close: Callable[[], None]) -> None:
        self.ranks, self.ledger, self.cluster, self.root = ranks, ledger, cluster, root
        self.policy, self.figures, self.signals = policy, figures, signals
        self.stop_at = stop_at  # hpcckpt check's stops (HPCCKPT_STOP_AT_STEPS)
        self._close = close  # the mode's close: background saves finish, the writer lease goes
        self.deferred: str | None = None  # why a warning signal waits for the deadline
        self.warned = False  # some rank received a warning signal

    def at_boundary(self, step: int, *, resumed_from: int | None, periodic: bool) -> tuple[StopReason, bool]:
        """What every rank agreed at this boundary: the stop's reason (NONE: train on), and
        whether a periodic save is due. Collective (one ``max`` over the ranks)."""
        new = self.signals.log_new()  # every rank logs what it received
        local, warned = self._signal_reason(step)
        for r in new:
            if self.deferred is not None and r.signum in WARNING_SIGNALS:
                continue  # recorded as signal_deferred: the deadline, not this signal, stops the run
            self.ledger.append("signal", signum=r.signum, signame=r.name, step=step,
                               rank=self.ranks.rank, signal_time=r.wall_s)
        if step in self.stop_at and step != resumed_from:
            log.warning("hpcckpt: stopping at step %d as HPCCKPT_STOP_AT_STEPS asks", step)
            local = StopReason.SIGNAL
        if local is StopReason.NONE and self.ranks.is_coordinator:
            self.policy.poll(self.cluster)
            local = self.policy.stop_reason()
        # One collective decides both: ranks judge a periodic save from their own timings
        # (every_steps="auto"), and a rank that saved alone would wait in the commit exchange.
        agreed = self.ranks.max(int(local) * 4 + int(warned) * 2 + int(periodic and self.policy.periodic_due(step)))
        if agreed & 2:
            self.warned = True  # a rank holds a warning: the coordinator judges it at the next boundary
        return StopReason(agreed // 4), bool(agreed & 1)

    def _signal_reason(self, step: int) -> tuple[StopReason, bool]:
        """(SIGNAL, _) for a TERM-like signal or a warning that cannot wait. A warning long before
        the deadline leaves the stop to the deadline; the coordinator judges it from the end
        time (another rank's warning reaches it through the boundary's collective: ``True``)."""
        received = self.signals.received
        if any(r.signum not in WARNING_SIGNALS for r in received):
            return StopReason.SIGNAL, False
        if not (received or self.warned):
            return StopReason.NONE, False
        if not self.ranks.is_coordinator:
            return StopReason.NONE, self.deferred is None
        if self.deferred is None:
            why = self.policy.defer_warning(self.cluster)
            if why is None:
                return StopReason.SIGNAL, False
            self.deferred = why
            name = received[0].name if received else "a warning signal (another rank)"
            log.warning("hpcckpt: %s received %s", name, why)
            self.ledger.append("signal_deferred", step=step, signame=name, detail=why)
        return StopReason.NONE, False

    def stop(self, reason: StopReason, run: Run, *, final_save: FinalSave | None) -> NoReturn:
        """Stop: the final checkpoint (``final_save``; None: nothing was trained that a checkpoint
        should keep), the ledger, the requeue decision, then ``RequeueExit``."""
        first = self.signals.first() if reason is StopReason.SIGNAL else None  # a deferred warning did not stop it
        log.warning("hpcckpt: stopping at step %d (%s)%s", run.step, reason.name.lower(),
                    "; taking the final checkpoint" if final_save is not None else "")
        committed, final_error = final_save() if final_save is not None else (run.committed_step, None)
        run = Run(run.step, committed, run.start_step, run.startup_s)
        refusal = self.no_progress(reason, run)
        if self.ranks.is_coordinator:
            extra: dict[str, Any] = {} if final_error is None else {"final_error": final_error}
            record_stop(self.ledger, mode="inprocess", reason=reason.name.lower(), step=run.step,
                        committed_step=committed, requeue=refusal is None,
                        final_saved=final_save is not None and final_error is None,
                        signame=first.name if first else None, signal_time=first.wall_s if first else None, **extra)
        if refusal is not None:
            self.refuse(refusal, run.step)
        outcome: dict[str, Any] = {}
        if self.ranks.is_coordinator:
            self.keep_figures()  # before the requeue: Slurm may end the job right after it
            outcome = self.requeue(reason, committed)
        self.ranks.broadcast_json(outcome)
        self._close()
        raise RequeueExit(reason.name.lower(), run.step)

    def no_progress(self, reason: StopReason, run: Run) -> str | None:
        """After a deadline stop: why requeueing would livelock (None: requeue).

        Counts the allocations in a row that ended at their deadline without a newer
        committed step (the one no-progress guard, ``budget.no_progress``, in the requeue
        budget's file); at the second one the job stops."""
        if reason is not StopReason.DEADLINE or not self.ranks.is_coordinator:
            return None
        progressed = run.committed_step is not None and run.committed_step > run.start_step
        in_a_row = no_progress(self.root, "deadline", progressed=progressed)
        if in_a_row is None or in_a_row < DEADLINES_WITHOUT_PROGRESS:
            return None
        startup = f"; this run's start-up took {run.startup_s:.0f}s" if run.startup_s is not None else ""
        return (f"two allocations in a row reached their deadline without progress (step {run.step}); "
                f"each stops {self.policy.lead_figures()} before its end time{startup}. Give the job a longer "
                "time limit (--time), or lower deadline_margin_s (HPCCKPT_DEADLINE_MARGIN_S)")

    def refuse(self, why: str, step: int) -> NoReturn:
        """Stop without a requeue (it would come back to the same end): exit 1 with the figures."""
        why = self.ranks.broadcast_json(why)
        log.error("hpcckpt: not requeueing: %s", why)
        if self.ranks.is_coordinator:
            self.ledger.append("refused", step=step, reason=why)
        self._close()
        raise RefusedExit(why, step)

    def check_time_left(self, run: Run, *, state_bytes: Callable[[], int]) -> None:
        """At the start, with less time left than the stop needs (nothing could be trained):
        when even a process that started at once would have had too little, no allocation
        this long can train: refuse (exit 1, no requeue). When this run's own start-up took
        the time (a slow file system, a loaded node), the next allocation may well train: stop
        as at a deadline without progress, which requeues once and refuses at the second
        such allocation in a row (``no_progress``). ``state_bytes``: what this rank's save
        writes, asked only when no save was measured yet (``estimate_save``)."""
        verdict = self.ranks.broadcast_json(self._time_verdict(run, state_bytes) if self.ranks.is_coordinator
                                            else None)
        if verdict is None:
            return
        if verdict[0] == "refuse":
            self.refuse(verdict[1], run.step)
        log.warning("hpcckpt: %s", verdict[1])
        # Nothing to save: a resumed run stands at its committed step, and a fresh one has at
        # most the first step of a step_done() loop in memory (labelled step 0, a checkpoint of
        # it would be wrong); the next allocation starts from the same place.
        self.stop(StopReason.DEADLINE, run, final_save=None)

    def _time_verdict(self, run: Run, state_bytes: Callable[[], int]) -> list[str] | None:
        """The coordinator's verdict for ``check_time_left``: None, ["refuse", why] or ["stop", why]."""
        self.policy.poll(self.cluster, force=True)
        if self.policy.time_left() is not None and not self.policy.measured:
            self.estimate_save(state_bytes)
        left, lead = self.policy.time_left(), self.policy.lead_s()
        if left is None or left >= lead:
            return None
        startup = run.startup_s or 0.0
        if left + startup < lead:
            return ["refuse", (
                f"this allocation has {left:.0f}s left, less than the stop needs before the end time "
                f"({self.policy.lead_figures()}, measured by earlier runs); nothing could be trained. "
                "Give the job a longer time limit (--time), or lower deadline_margin_s "
                "(HPCCKPT_DEADLINE_MARGIN_S)")]
        return ["stop", (
            f"this run's start-up took {startup:.0f}s of its allocation: {left:.0f}s are left, less "
            f"than the stop needs before the end time ({self.policy.lead_figures()}); stopping "
            "without training (a second allocation in a row without progress stops the job)")]

    def estimate_save(self, state_bytes: Callable[[], int]) -> None:
        """No save was measured yet (the first allocation) and the end time is known: the stop's
        reserve comes from this state's size and the checkpoint directory's rate, measured now
        (``policy.estimate_save_s``), not from the assumed ``save_cost_s`` default (10 s, which
        made a 1-minute allocation stop without training for a 0.02 s save, and is too little
        for a state of tens of GB). The first save measured replaces the estimate."""
        try:
            nbytes = state_bytes()
            save_s, rate = estimate_save_s(self.root, nbytes)
        except (OSError, HpcckptError) as exc:
            log.warning("hpcckpt: could not measure the checkpoint directory's write rate (%s); the stop's reserve "
                        "assumes a %.0fs save until one is measured", exc, self.policy.save_cost_s)
            return
        self.policy.assume_save(save_s)
        log.info("hpcckpt: no save measured yet: the final save of this state (%.1f MB) is estimated at %.2fs "
                 "(%.0f MB/s measured under %s); the stop comes %s before the end time", nbytes / 1e6, save_s,
                 rate / 1e6, self.root, self.policy.lead_figures())

    def requeue(self, reason: StopReason, committed_step: int | None) -> dict[str, Any]:
        """The lifecycle's requeue (coordinator only; it records the outcome); exit 75 follows either way."""
        # A deadline that came from a pulled-in end time is what Slurm does at a GraceTime
        # preemption; the cluster's record (PreemptTime) confirms it or makes it a shortened limit.
        cause = Cause.PREEMPTION if reason is StopReason.DEADLINE and self.policy.end_moved_earlier else reason.cause
        return requeue_logged(self.cluster, self.root, self.ledger, cause, committed_step,
                              within_s=self.policy.time_left())

    def keep_figures(self) -> None:
        """The coordinator writes the figures that ``write_if_moved`` left for later."""
        if self.ranks.is_coordinator and self.figures.unwritten:
            self.figures.write(self.root)

    def done(self, step: int, committed_step: int | None) -> None:
        """The run ended (its final state checkpointed): the ``stop`` record of a finished run."""
        if self.ranks.is_coordinator:
            record_stop(self.ledger, mode="inprocess", reason="done", step=step, committed_step=committed_step,
                        requeue=False)

    def guard_after_run(self, step: int, committed_step: int | None, watched: Iterable[signal.Signals]) -> None:
        """From the run's end to the process's exit a stop signal requeues the job (``AfterRun``):
        the code after the training loop has no step boundary, and the next run, resuming at
        the final checkpoint, finds the run finished and runs that code again. A time-limit
        warning waits as it does in the run (the policy's ``defer_warning``: the end time is
        known, further than the stop's lead and within the warning window); TERM does not. A
        stop signal that came after the last step's boundary (a warning the run deferred aside)
        is judged at once. Not when the run kept no checkpoint (it saved none, so it keeps no
        final state either): a requeue would train it all again."""
        if committed_step is None:
            return
        late = next((r for r in self.signals.received if r.signum not in WARNING_SIGNALS), None)
        if late is None and self.deferred is None and self.ranks.is_coordinator:
            # A warning the last boundary did not see (the coordinator judges warnings in the
            # run; another rank leaves a warning it got to the coordinator's judgement there).
            late = next(iter(self.signals.received), None)
        self.signals.uninstall()
        # The guard holds what the requeue needs, not the Checkpointer: a script that goes on to
        # load another model must not keep this run's model and optimizer alive through it.
        stop = functools.partial(_stopped_after_run, step=step, committed_step=committed_step,
                                 coordinator=(self.ledger, self.cluster, self.root) if self.ranks.is_coordinator
                                 else None)
        guard = AfterRun(watched, stop, may_wait=functools.partial(_warning_may_wait, self.policy, self.cluster))
        if guard.install() and late is not None:
            guard.fire(late)


def _warning_may_wait(policy: Policy, cluster: Cluster, got: Received) -> str | None:
    """After the run: why ``got`` need not stop the script yet (a time-limit warning that can
    wait, as in the run); None for TERM and for a warning that cannot."""
    return policy.defer_warning(cluster) if got.signum in WARNING_SIGNALS else None


def _stopped_after_run(got: Received, *, step: int, committed_step: int | None,
                       coordinator: tuple[Ledger, Cluster, Path] | None) -> None:
    """A stop signal after the run finished (``Stop.guard_after_run``): the coordinator
    records it and requeues the job; every rank exits 75."""
    log.warning("hpcckpt: received %s after the run's last step (step %d, committed): the code after the "
                "training loop is stopped and the job requeued; the next run finds the run finished and runs "
                "that code again", got.name, step)
    if coordinator is not None:
        ledger, cluster, root = coordinator
        record_stop(ledger, mode="inprocess", reason="after_run", step=step, committed_step=committed_step,
                    requeue=True, final_saved=True, signame=got.name, signal_time=got.wall_s)
        requeue_logged(cluster, root, ledger, StopReason.SIGNAL.cause, committed_step)
    if _script_returned():
        # The script has returned: the interpreter is joining its threads or running atexit
        # callbacks, where a SystemExit is printed and ignored and the process would exit 0,
        # so the requeue just recorded would not happen where exit 75 is how it is made (a
        # local supervisor). End here with 75, as a stop inside the script would.
        flush_and_exit(EXIT_REQUEUE)
    raise RequeueExit("after_run", step)


def _script_returned() -> bool:
    """Whether the interpreter is past the script's last line. The main thread is marked
    stopped only near the end of ``threading._shutdown`` (after the threading atexit calls,
    e.g. joining executors' workers), so a signal handled before that also looks for the
    ``_shutdown`` frame on the interrupted stack."""
    if not threading.main_thread().is_alive():
        return True
    shutdown = getattr(threading, "_shutdown", None)
    code = getattr(shutdown, "__code__", None)
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def requeue_logged(cluster: Cluster, root: Path, ledger: Ledger, cause: str,
                   committed_step: int | None, *, within_s: float | None = None) -> dict[str, Any]:
    """The lifecycle's requeue on an in-process run's behalf, its decision logged."""
    outcome = requeue(cluster=cluster, state_dir=root, cause=cause, committed_step=committed_step, ledger=ledger,
                      source="checkpointer", within_s=within_s).as_dict()
    log.warning("hpcckpt: requeue decision: %s", outcome)
    return outcome
