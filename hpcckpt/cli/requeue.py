"""``hpcckpt requeue``: requeue this Slurm job (or submit a successor if Slurm refuses).

Meant for batch scripts after ``srun`` exits 75 (EXIT_REQUEUE): every rank has
stopped, the final checkpoint is committed, and now the job goes back to the queue.
When the run already put itself back (its coordinator's requeue was confirmed, e.g. a
successor submitted), nothing more is done: one requeue per interruption.
Outside Slurm it exits 75 so that a local supervisor restarts the command.
The cause (for the per-cause budgets) defaults to the last ``stop`` in the ledger.

``--stopped-status RC``: the batch script forwarded a TERM, or the command died of one
(RC 143: Slurm signals a job's processes one at a time, so the command's TERM can come
before the batch shell's), and the command ended with status RC instead of 75 (bash can
lose the status of a command that ends while its trap runs: ``wait`` then gives -1). When this run never began training (no ``start`` of this job's
run in the ledger: the stop came during its start-up, before hpcckpt could take the
signal, and killed it), the job is requeued all the same: nothing was trained, so nothing
is lost, and the job comes back instead of ending at a time limit or a cancel-mode
preemption. A second such stop in a row at a time limit is refused (the start-up does not
fit the allocation). A run that did begin and whose stop asked for a requeue is handled as
without the option (the shell lost its exit 75); a lost status of a run that recorded the
end of its training is 0; one that decided otherwise (a refusal, a failure) keeps its
status RC and nothing is requeued.

Exit codes: 0 requeued, successor submitted, or already done by the run; 1 not requeued
(refused by a budget / crash-loop guard, or Slurm refused and no successor could be
submitted: the reason is printed); 2 bad usage; 75 local (no Slurm); with
``--stopped-status RC``, RC when the run had begun or the requeue was refused.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from hpcckpt.cli.common import add_json, directory, emit
from hpcckpt.cluster import detect
from hpcckpt.cluster.base import Cause
from hpcckpt.errors import ConfigError
from hpcckpt.exitcodes import EXIT_REQUEUE
from hpcckpt.lifecycle import requeue
from hpcckpt.lifecycle.causes import stop_cause
from hpcckpt.lifecycle.history import OPENERS, Event, runs
from hpcckpt.lifecycle.identity import Identity, current
from hpcckpt.lifecycle.ledger import Ledger
from hpcckpt.lifecycle.requeue import CANCELLED

RAN_S = 30.0  # a command that ran this long was not stopped in its start-up (--ran-s)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("requeue", help="requeue this Slurm job (successor job if refused)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cause", default=None,
                   help="time_limit | preemption | maintenance | signal | failure "
                        "(default: from the ledger's last stop)")
    p.add_argument("--dir", type=Path, default=None,
                   help="checkpoint directory: budgets and ledger live there (default $HPCCKPT_DIR)")
    p.add_argument("--stopped-status", type=int, default=None, metavar="RC",
                   help="the command ended with status RC (not 75) after a TERM (forwarded by this script, "
                        "or 143: it died of one): "
                        "requeue only if the run never began training (killed in its start-up)")
    p.add_argument("--ran-s", type=float, default=None, metavar="SECONDS",
                   help="with --stopped-status: how long the command ran (the templates pass $SECONDS). A "
                        f"command that ran {RAN_S:.0f} s or more and recorded nothing of hpcckpt's (a script "
                        "that keeps its own checkpoints) was stopped in its training, not its start-up: it is "
                        "requeued and resumes from its own last save")
    add_json(p)
    p.set_defaults(func=run)


def _state_dir(arg: Path | None) -> Path:
    raw = arg or (Path(os.environ["HPCCKPT_DIR"]) if os.environ.get("HPCCKPT_DIR") else None)
    if raw is None:
        raise ConfigError("hpcckpt requeue needs the checkpoint directory: pass --dir DIR or set HPCCKPT_DIR")
    return directory(raw, option="--dir" if arg else "HPCCKPT_DIR", must_exist=False)


def _cause(text: str) -> Cause:
    cause = Cause.parse(text)
    if cause is Cause.UNKNOWN and text.strip().lower() != Cause.UNKNOWN.value:
        valid = ", ".join(c.value for c in Cause if c not in (Cause.UNKNOWN, Cause.DONE))
        raise ConfigError(f"--cause={text!r} is not a cause hpcckpt knows; use one of {valid}, "
                          "e.g. --cause time_limit")
    return cause


def _this_run(ev: Event, who: Identity) -> bool:
    """Whether ``ev`` was recorded by this job's current run (Slurm's restart count, or the
    local supervisor's restart number); outside both, no event can be told to be this run's."""
    if who.in_slurm:
        return ev.get("job_id") == who.job_id and ev.get("restart_count") == who.restart_count
    if who.local_restart is not None:
        return ev.get("slurm_job_id") is None and ev.get("local_restart") == who.local_restart
    return False


def _newest_run(ledger: Ledger, who: Identity) -> tuple[Event | None, Event | None]:
    """The ledger's last ``stop`` (the newest run's, or an earlier run's when the newest recorded
    none: its reason and committed step are the last known) and the ``requeue`` this run
    recorded after it in the newest run (``runs``: streamed).
    A requeue of an earlier run is not this run's: a run killed before it recorded anything
    must not find its predecessor's requeue and take it for its own."""
    stop: Event | None = None
    req: Event | None = None
    for run in runs(ledger.events()):
        req = None
        for ev in run:
            name = ev.get("event")
            if name == "stop":
                stop, req = ev, None
            elif name == "requeue":
                req = ev
    if req is not None and (who.in_slurm or who.local_restart is not None) and not _this_run(req, who):
        req = None
    return stop, req


@dataclass
class _Unstarted:
    """What the ledger says of a run stopped in its start-up (``--stopped-status``)."""
    began: bool = False  # this run recorded a start: it decided for itself
    asked: bool = False  # ... and its last stop asked for a requeue (its exit 75 may be what the shell lost)
    done: bool = False  # ... and its last stop was the end of the training
    in_row: int = 0  # runs just before it stopped at a time limit before they began (requeued as such)
    committed_step: int | None = None  # the newest committed step any run recorded


def _unstarted(ledger: Ledger, who: Identity) -> _Unstarted:
    got = _Unstarted()
    for ev in ledger.events():
        name = ev.get("event")
        # OPENERS, not opens_run: a requeue of a run stopped in its start-up opens a run too,
        # but it is what ``in_row`` counts (below), not a run that began
        if name in OPENERS:
            got.in_row = 0
            got.began = got.began or _this_run(ev, who)
        elif name == "requeue" and ev.get("unstarted") is True and not _this_run(ev, who):
            got.in_row = got.in_row + 1 if ev.get("cause") == Cause.TIME_LIMIT.value else 0
        elif name == "stop" and _this_run(ev, who):
            got.asked, got.done = ev.get("requeue") is True, ev.get("reason") == "done"
        if isinstance(ev.get("committed_step"), int):
            got.committed_step = ev["committed_step"]
    return got


def _stopped_before_start(args: argparse.Namespace, state_dir: Path, ledger: Ledger, who: Identity) -> int | None:
    """``--stopped-status RC``: the exit status, or None to go on as a plain ``hpcckpt requeue``."""
    rc = int(args.stopped_status)
    # bash loses the status of a command that ends while a trap runs (``wait`` gives -1)
    status = f"status {rc}" if 0 <= rc < 256 else "its status lost by the shell"
    failed = rc if 0 < rc < 256 else 1
    seen = _unstarted(ledger, who)
    if seen.began:
        if seen.asked:
            return None  # it stopped for a requeue: the shell lost its exit 75, not the requeue
        if rc < 0 and seen.done:
            emit(args, {"requeued": False, "began": True, "status": 0},
                 "hpcckpt requeue: the shell lost the command's status; its run recorded the end of its training: "
                 "finished, exit 0")
            return 0
        emit(args, {"requeued": False, "began": True, "status": rc},
             f"hpcckpt requeue: this run began training and ended ({status}) after a stop signal; "
             "it decided for itself (see its output and `hpcckpt history`): not requeued here")
        return failed
    cluster = detect()
    try:
        cause = Cause.parse(cluster.stop_cause(Cause.SIGNAL.value))
    except Exception:  # noqa: BLE001 - the scheduler could not be asked: a bare stop signal
        cause = Cause.SIGNAL
    ran_s = args.ran_s if isinstance(args.ran_s, (int, float)) and args.ran_s >= 0 else None
    if ran_s is not None and ran_s >= RAN_S:
        # Judged from how long it ran, never from a missing `start`: a script with its own
        # checkpoints records nothing of hpcckpt's, and was stopped in its training.
        note = (f"the command ran {ran_s:.0f} s and was stopped ({status}); it recorded nothing of hpcckpt's "
                "(a script with its own checkpoints?): it resumes from its own last save")
        outcome = requeue(cluster=cluster, state_dir=state_dir, cause=cause.value, source="cli",
                          committed_step=seen.committed_step, ledger=ledger, note=note)
        emit(args, outcome.as_dict(), f"hpcckpt requeue: {note}: "
             f"{'requeued' if outcome.requeued else 'NOT requeued'} ({outcome.method}): {outcome.detail}")
        if outcome.method == "exit":
            return EXIT_REQUEUE
        return 0 if outcome.requeued else failed
    if cause is Cause.TIME_LIMIT and seen.in_row >= 1:
        why = (f"this run was stopped at its time limit before it began training ({status}), as was the run "
               "before it: its start-up does not fit the allocation. Give the job a longer time limit (--time) "
               "or make the start-up shorter (a copy of the environment on node-local disk, fewer imports)")
        ledger.append("refused", reason=why, step=seen.committed_step)
        emit(args, {"requeued": False, "began": False, "status": rc, "detail": why},
             f"hpcckpt requeue: NOT requeued: {why}")
        return failed
    outcome = requeue(cluster=cluster, state_dir=state_dir, cause=cause.value, source="cli",
                      committed_step=seen.committed_step, ledger=ledger, unstarted=True,
                      note=f"stopped in its start-up, before it began training ({status})")
    emit(args, outcome.as_dict(),
         f"hpcckpt requeue: stopped before training began ({status}): "
         f"{'requeued' if outcome.requeued else 'NOT requeued'} ({outcome.method}): {outcome.detail}")
    if outcome.method == "exit":
        return EXIT_REQUEUE
    return 0 if outcome.requeued else failed


def run(args: argparse.Namespace) -> int:
    state_dir = _state_dir(args.dir)
    ledger = Ledger(state_dir)
    who = current()
    if args.stopped_status is not None:
        decided = _stopped_before_start(args, state_dir, ledger, who)
        if decided is not None:
            return decided
    stop, done = _newest_run(ledger, who)
    if done is not None and done.get("method") == CANCELLED:
        emit(args, {**{k: done.get(k) for k in ("requeued", "method", "detail")}, "already": True},
             f"hpcckpt requeue: the job was cancelled; not requeued: {done.get('detail')}")
        return 0
    if done is not None and done.get("requeued") is True and done.get("method") != "exit":
        info = {k: done.get(k) for k in ("requeued", "method", "detail", "successor_job_id", "evidence")}
        emit(args, {**info, "already": True},
             f"hpcckpt requeue: already done by the run itself ({done.get('method')}): {done.get('detail')}")
        return 0
    cause = (_cause(args.cause) if args.cause
             else stop_cause(stop.get("reason") if stop else None, default=Cause.SIGNAL))
    committed = stop.get("committed_step") if stop else None
    outcome = requeue(cluster=detect(), state_dir=state_dir, cause=cause.value, source="cli",
                      committed_step=committed if isinstance(committed, int) else None, ledger=ledger)
    emit(args, outcome.as_dict(),
         f"hpcckpt requeue: {'requeued' if outcome.requeued else 'NOT requeued'} "
         f"({outcome.method}): {outcome.detail}")
    if outcome.method == "exit":
        return EXIT_REQUEUE
    return 0 if outcome.requeued else 1
