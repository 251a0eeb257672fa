"""Interruptions of one training run, rebuilt from its ledger and Slurm's records.

The ledger is a sequence of runs, each opened by a ``start`` event (or a CRIU restore).
A run that ends in a ``stop`` with a reason other than "done" (or that simply vanishes,
e.g. killed before it could stop) is an interruption; the next ``start`` says where
training resumed and how long the restore took. The ledger is streamed: each run is
folded into a small summary as it is read, so a ledger of any size takes bounded memory
per run. Jobs are named as Slurm names them (``A_T`` for an array task); Slurm's own
records are looked up by the raw job id each event carries.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..cluster.causes import RunRecord, classify, match_run, slurm_runs
from .ledger import Ledger

Event = Mapping[str, Any]
MAX_FAILED_DUMPS = 100  # failed CRIU dumps (and superseded restarts) listed: the newest
SUPERSEDED = "superseded"
# The records that open a run (every mode's: in-process and JIT ``start``, CRIU's restore).
# Every reader of runs splits the ledger with ``opens_run``/``runs``/``newest_run`` below.
OPENERS = frozenset({"start", "criu_restore"})
# Records a run writes while it loads, before its opener: they fold into the run before it
# (which they do not prolong), and say the next run's process was already running then.
PRELUDE = frozenset({"skip_corrupt", "fresh_start", "criu_restore_failed"})
# Records of how a run watches (the end time's poll period): no step, no stop, no time of the
# run's own. A supervisor may write one before its run's opener, so they neither begin a run
# nor count in one (else the first run of a CRIU job on a partition with a GraceTime read as
# an interruption of unknown cause before it).
NOTES = frozenset({"end_poll"})


@dataclass(frozen=True, kw_only=True)
class Interruption:
    index: int
    job_id: str | None
    restart_count: int | None
    cause: str
    slurm_state: str | None
    signal: str | None
    signal_time: float | None
    step_at_signal: int | None
    stop_step: int | None
    committed_step: int | None
    resumed_step: int | None
    lost_steps: int | None  # None: cannot be counted (the run vanished without saying where it was)
    save_s: float | None
    queue_wait_s: float | None
    restore_s: float | None
    requeue_method: str | None
    requeue_detail: str | None
    failed_ranks: list[int] | None = None  # a rank failure (JIT): which ranks died or hung
    requeued: bool | None = None  # confirmed (Slurm's record, or the successor's id)
    successor_job_id: str | None = None
    resumed_by: str | None = None  # the job whose run came next (a successor's own id)
    # CRIU runs count progress in seconds of the job's run time, not steps: what the next
    # restore lost (exact when the stop was dumped; else a lower bound, with the dump interval
    # as the upper one when periodic images were taken).
    lost_s: float | None = None
    lost_exact: bool | None = None
    lost_at_most_s: float | None = None
    resumed_image: str | None = None  # the CRIU image the next run restored
    started_over: str | None = None  # why the next CRIU run started from the beginning (no image restored)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _int(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, int):  # however long (JSON holds any): never through a float
        return value
    return int(value) if math.isfinite(value) else None


def _float(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        out = float(value)  # an int past 1.8e308 overflows
    except OverflowError:
        return None
    return out if math.isfinite(out) else None


def _str(value: Any) -> str | None:
    return str(value) if value not in (None, "") else None


MAX_SECONDS = 1e11  # about 3000 years: a time or a duration past it is no figure hpcckpt wrote


def _time(value: Any) -> float | None:
    """An epoch time a record may hold (positive, not absurdly far), else None."""
    t = _float(value)
    return t if t is not None and 0 < t < MAX_SECONDS else None


def _seconds(value: Any) -> float | None:
    """A duration a record may hold (not negative, bounded), else None."""
    s = _float(value)
    return min(s, MAX_SECONDS) if s is not None and s >= 0 else None


def _earliest(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)


@dataclass(kw_only=True)
class RunSummary:
    """What one run left in the ledger, folded event by event (bounded size)."""

    head: dict[str, Any]
    signal: dict[str, Any] | None = None
    stop: dict[str, Any] | None = None
    requeue: dict[str, Any] | None = None
    last_commit: dict[str, Any] | None = None
    max_commit: int | None = None
    reached: int | None = None
    dump_s: float | None = None
    rank_failure: dict[str, Any] | None = None
    last_time: float | None = None
    slurm_job_id: str | None = None
    # For the goodput accounting (``goodput``): this run's own first and newest record times
    # (a record the NEXT run writes before its start, PRELUDE, does not count: its earliest
    # time is kept apart), when the newest step was first recorded, the newest signal acted
    # on at once (not deferred), the final commit, the blocking seconds of the periodic saves
    # (commit stall_s; CRIU periodic dump_s) and the step time the auto interval measured.
    first_time: float | None = None
    end_time: float | None = None
    prelude_time: float | None = None
    reached_time: float | None = None
    stop_signal: dict[str, Any] | None = None
    final_commit: dict[str, Any] | None = None
    stall_s_sum: float = 0.0
    step_s: float | None = None

    def add(self, ev: Event) -> None:
        name = ev.get("event")
        self.last_time = _float(ev.get("time")) or self.last_time
        self._account(ev)
        self.slurm_job_id = self.slurm_job_id or _str(ev.get("slurm_job_id"))
        if name == "signal" and (self.signal is None or (self.signal.get("deferred_s") and not ev.get("deferred_s"))):
            # The signal of the stop: a warning that was deferred (it came long before the end)
            # gives way to the signal that stopped the run (a later preemption's, the TERM).
            self.signal = dict(ev)
        elif name == "stop":
            self.stop = dict(ev)
        elif name == "requeue":
            self.requeue = dict(ev)
        elif name == "commit":
            self.last_commit = dict(ev)
            step = _int(ev.get("step"))
            if step is not None:
                self.max_commit = step if self.max_commit is None else max(self.max_commit, step)
        elif name == "criu_dump":
            self.dump_s = _float(ev.get("dump_s"))
        elif name == "rank_failure":
            self.rank_failure = dict(ev)
        self._reach(ev)

    def _reach(self, ev: Event) -> None:
        steps = []
        if ev.get("event") in {"signal", "commit", "stop"}:
            steps.append(_int(ev.get("step")))
        if ev.get("event") == "rank_failure":  # it loses the step in flight
            steps += [_int(ev.get("lost_step")), _int(ev.get("reached_step"))]
        for step in steps:
            if step is not None and (self.reached is None or step > self.reached):
                self.reached, self.reached_time = step, _time(ev.get("time"))

    def _account(self, ev: Event) -> None:
        """The figures ``goodput`` needs, each checked for its type (a hostile record adds nothing)."""
        name, when = ev.get("event"), _time(ev.get("time"))
        if isinstance(name, str) and name in PRELUDE:
            self.prelude_time = _earliest(self.prelude_time, when)
            return
        self.first_time = _earliest(self.first_time, when)
        if when is not None:
            self.end_time = when if self.end_time is None else max(self.end_time, when)
        if name == "signal" and not ev.get("deferred_s"):
            self.stop_signal = {"time": when, "step": _int(ev.get("step"))}
        elif name == "commit" and ev.get("final") is True:
            self.final_commit = {"time": when, "save_s": _seconds(ev.get("save_s")),
                                 "stall_s": _seconds(ev.get("stall_s"))}
        elif name == "commit":
            self.stall_s_sum += _seconds(ev.get("stall_s")) or 0.0
            auto = ev.get("auto")
            step_s = _seconds(auto.get("step_s")) if isinstance(auto, Mapping) else None
            self.step_s = step_s or self.step_s
        elif name == "criu_dump" and ev.get("periodic") is True:  # the job was frozen while it ran
            self.stall_s_sum += _seconds(ev.get("dump_s")) or 0.0

    @property
    def done(self) -> bool:
        return self.stop is not None and self.stop.get("reason") == "done"

    @property
    def committed(self) -> int | None:
        committed = _int(self.stop.get("committed_step")) if self.stop else None
        return committed if committed is not None else self.max_commit

    def save_s(self) -> float | None:
        commit = self.last_commit
        if commit is not None and _int(commit.get("step")) == self.committed:
            return _float(commit.get("save_s"))
        return self.dump_s


@dataclass(kw_only=True)
class Fold:
    """The whole ledger, folded in one streaming pass."""

    runs: list[RunSummary] = field(default_factory=list)
    finished: bool = False
    failed_dumps: list[dict[str, Any]] = field(default_factory=list)
    superseded: list[dict[str, Any]] = field(default_factory=list)  # restarts refused: another job had the directory

    def add(self, ev: Event) -> None:
        if ev.get("event") == SUPERSEDED:  # written by a loser while the winner runs: no run of its own
            self.superseded = [*self.superseded[-(MAX_FAILED_DUMPS - 1):], dict(ev)]
            return
        if ev.get("event") in NOTES:
            return
        if opens_run(ev) or not self.runs:  # the records before the first opener: a run of their own
            self.runs.append(RunSummary(head=dict(ev)))
        self.runs[-1].add(ev)
        if ev.get("event") == "stop" and ev.get("reason") in ("done", "after_run"):
            # after_run: stopped in the code after its training loop, requeued to run that again
            self.finished = ev.get("reason") == "done"
        if ev.get("event") == "criu_dump_failed":
            self.failed_dumps = [*self.failed_dumps[-(MAX_FAILED_DUMPS - 1):], dict(ev)]

    def slurm_ids(self) -> set[str]:
        return {r.slurm_job_id or str(r.head["job_id"]) for r in self.runs if r.slurm_job_id or r.head.get("job_id")}


def opens_run(ev: Event) -> bool:
    """Whether ``ev`` is the first record of a run: an opener (``OPENERS``), or the batch
    script's requeue of a run stopped in its start-up (``unstarted``: that run's only record)."""
    return ev.get("event") in OPENERS or _unstarted_requeue(ev)


def runs(events: Iterable[Event], *, headless: bool = True) -> Iterator[list[Event]]:
    """The ledger's runs, oldest first, each as its records in order (streamed: one run is held
    at a time, whatever the ledger's size). A run begins at a record that ``opens_run`` (the
    rule ``fold`` splits by). The records before the first opener (a ledger that begins inside
    a run) are a run of their own, or skipped without ``headless``. ``superseded`` records
    (written by a job refused the directory while another ran) and ``NOTES`` belong to no run."""
    run: list[Event] = []
    for ev in events:
        if ev.get("event") == SUPERSEDED or ev.get("event") in NOTES:
            continue
        if opens_run(ev):
            if run:
                yield run
            run = [ev]
        elif run or headless:
            run.append(ev)
    if run:
        yield run


def newest_run(events: Iterable[Event], *, headless: bool = True) -> list[Event]:
    """The records of the ledger's newest run (``runs``); empty when there is none."""
    newest: list[Event] = []
    for run in runs(events, headless=headless):
        newest = run
    return newest


def fold(events: Iterable[Event]) -> Fold:
    out = Fold()
    for ev in events:
        out.add(ev)
    return out


def _signame(run: RunSummary) -> str | None:
    if run.signal:
        return _str(run.signal.get("signame"))
    return _str(run.stop.get("signame")) if run.stop else None


def _lost(run: RunSummary, nxt: RunSummary | None) -> int | None:
    """Steps trained but not kept; None where they cannot be counted: a run that vanished
    without a stop never said how far it got past its last record."""
    if _unstarted(run):
        return 0  # stopped in its start-up: it never began training
    if nxt is None or run.reached is None:
        return None
    resumed = _int(nxt.head.get("resumed_from"))
    if run.stop is None and run.rank_failure is None:
        return None
    return max(0, run.reached - (resumed or 0))


def _unstarted_requeue(ev: Event) -> bool:
    """The batch script's requeue of a run stopped in its start-up (``hpcckpt requeue --stopped-status``)."""
    return ev.get("event") == "requeue" and ev.get("unstarted") is True


def _unstarted(run: RunSummary) -> bool:
    """A run stopped in its start-up: its one record (its head) is that requeue."""
    return _unstarted_requeue(run.head)


def _stop_of(run: RunSummary, slurm: Sequence[RunRecord]) -> tuple[str, float | None, RunRecord | None]:
    """A stopped run's cause (with Slurm's record of it), its signal's time, and that record:
    what the history's row and the goodput's row both say of the stop."""
    stop, sig, req = run.stop, run.signal, run.requeue
    signal_time = _float(sig.get("signal_time") or sig.get("time")) if sig else None
    when = signal_time or (_float(stop.get("time")) if stop else None) or run.last_time
    record = match_run(slurm, run.slurm_job_id or _str(run.head.get("job_id")), when)
    cause = classify(stop, _signame(run), signal_time, record, _str(req.get("cause")) if req else None,
                     requeued=bool(req.get("requeued") if req else None)).value
    return cause, signal_time, record


def _interruption(index: int, run: RunSummary, nxt: RunSummary | None, slurm: Sequence[RunRecord],
                  resumer: RunSummary | None) -> Interruption:
    stop, sig, req = run.stop, run.signal, run.requeue
    signame = _signame(run)
    cause, signal_time, record = _stop_of(run, slurm)
    job_id = _str(run.head.get("job_id"))
    head_next = nxt.head if nxt else None
    end_time = _float((req or stop or {}).get("time")) or run.last_time
    next_time = _float(head_next.get("time")) if head_next else None
    requeued = req.get("requeued") if req else None
    return Interruption(
        index=index, job_id=job_id, restart_count=_int(run.head.get("restart_count")),
        cause=cause,
        slurm_state=record.state if record else None, signal=signame, signal_time=signal_time,
        step_at_signal=_int(sig.get("step")) if sig else None,
        stop_step=_int(stop.get("step")) if stop else None,
        committed_step=run.committed,
        resumed_step=_int(resumer.head.get("resumed_from")) if resumer else None,
        lost_steps=_lost(run, resumer), save_s=run.save_s(),
        queue_wait_s=(next_time - end_time if next_time is not None and end_time is not None else None),
        restore_s=_float(head_next.get("restore_s")) if head_next else None,
        requeue_method=_str(req.get("method")) if req else None,
        requeue_detail=_str(req.get("detail")) if req else None,
        failed_ranks=_failed_ranks(run), requeued=requeued if isinstance(requeued, bool) else None,
        successor_job_id=_str(req.get("successor_job_id")) if req else None,
        resumed_by=_str(head_next.get("job_id")) if head_next else None,
        **_lost_seconds(head_next), **_resumed_image(head_next))


def _resumed_image(head: Event | None) -> dict[str, Any]:
    """Which CRIU image the next run restored, or why it restored none (its ``start`` says)."""
    if head is None:
        return {}
    if head.get("event") == "criu_restore":
        return {"resumed_image": _str(head.get("image"))}
    if head.get("mode") != "criu":
        return {}
    if head.get("no_image"):
        return {"started_over": f"there was no image ({head.get('no_image')})"}
    if head.get("fallback"):
        return {"started_over": f"the image could not be restored (--on-restore-failure={head.get('fallback')})"}
    return {"started_over": "no image was restored"}


def _lost_seconds(head: Event | None) -> dict[str, Any]:
    """What a CRIU restore (or a CRIU run's start) says the run before it lost, in seconds."""
    if head is None or "lost_s" not in head and "lost_at_most_s" not in head:
        return {}
    exact = head.get("lost_exact")
    return {"lost_s": _float(head.get("lost_s")), "lost_exact": exact if isinstance(exact, bool) else None,
            "lost_at_most_s": _float(head.get("lost_at_most_s"))}


def _failed_ranks(run: RunSummary) -> list[int] | None:
    ranks = run.rank_failure.get("failed_ranks") if run.rank_failure else None
    return sorted(r for r in ranks if isinstance(r, int) and not isinstance(r, bool)) if isinstance(ranks, list) else None


def interruptions(events: Iterable[Event] | Fold, *, slurm: Sequence[RunRecord] | None = None) -> list[Interruption]:
    """One row per interrupted run; ``slurm`` defaults to what Slurm recorded for these jobs."""
    folded = events if isinstance(events, Fold) else fold(events)
    runs = folded.runs
    if slurm is None:
        slurm = slurm_runs(folded.slurm_ids())
    out: list[Interruption] = []
    for i, run in enumerate(runs):
        if run.done:
            continue
        nxt = runs[i + 1] if i + 1 < len(runs) else None
        if run.stop is None and nxt is None and not _unstarted(run):
            continue  # still running (or the last run vanished without a trace)
        # the run that resumed from this one's checkpoint: runs stopped in their start-up resumed nothing
        resumer = next((r for r in runs[i + 1:] if not _unstarted(r)), None)
        out.append(_interruption(len(out) + 1, run, nxt, slurm, resumer))
    return out + [_superseded(len(out) + i + 1, ev) for i, ev in enumerate(folded.superseded)]


def _superseded(index: int, ev: Event) -> Interruption:
    """A run that did not start because another job held the directory (a duplicate after a
    requeue in doubt, or a successor): nothing was lost; who had it is in the detail."""
    return Interruption(
        index=index, job_id=_str(ev.get("job_id")), restart_count=_int(ev.get("restart_count")),
        cause="superseded", slurm_state=None, signal=None, signal_time=_float(ev.get("time")),
        step_at_signal=None, stop_step=None, committed_step=None, resumed_step=None, lost_steps=0,
        save_s=None, queue_wait_s=None, restore_s=None, requeue_method=None,
        requeue_detail=_str(ev.get("detail")), requeued=False, resumed_by=_str(ev.get("by_job_id")))


def summary(events: Iterable[Event] | Fold, rows: Sequence[Interruption]) -> dict[str, Any]:
    folded = events if isinstance(events, Fold) else fold(events)
    lost = [r.lost_steps for r in rows if r.lost_steps is not None]
    seconds = [r.lost_s for r in rows if r.lost_s is not None]
    return {"interruptions": len(rows), "finished": folded.finished, "lost_steps_total": sum(lost),
            "lost_steps_unknown": sum(1 for r in rows
                                      if r.lost_steps is None and r.lost_s is None and r.lost_at_most_s is None),
            "lost_s_total": round(sum(seconds), 3) if seconds else None,
            "causes": sorted({r.cause for r in rows})}


# -- goodput -------------------------------------------------------------------------------
# The wall time from the first run's start to the last run's end, split into buckets that sum
# to it exactly (whole microseconds inside). Names follow Google's ml-goodput-measurement
# where they fit (GOODPUT_NAMES: its BadputType for each bucket).

BUCKETS = ("productive_training", "program_startup", "checkpoint_restore", "checkpoint_save",
           "wasted_progress", "requeue_and_queue_wait", "other", "unaccounted")
GOODPUT_NAMES = {
    "productive_training": "GOODPUT", "program_startup": "PROGRAM_STARTUP",
    "checkpoint_restore": "UNPRODUCTIVE_CHECKPOINT_RESTORE_TIME",
    "checkpoint_save": "UNPRODUCTIVE_CHECKPOINT_SAVE_TIME",
    "wasted_progress": "WASTED_PROGRESS_FROM_DISRUPTION",
    "requeue_and_queue_wait": "INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION", "other": "OTHER", "unaccounted": "OTHER"}
_US = 1_000_000


def _us(seconds: float) -> int:
    return int(round(seconds * _US))


@dataclass(kw_only=True)
class _Span:
    """One run's time points in microseconds, in order: begin <= restore begin <= training
    begin <= stop begin (the final save starts) <= stop record <= end (its last record)."""

    run: RunSummary
    begin: int
    restore: int
    train: int
    stop: int
    stopped: int
    end: int
    startup_measured: bool


def _opener_time(run: RunSummary) -> float | None:
    return _time(run.head.get("time")) if run.head.get("event") in OPENERS else None


def _stop_begin(run: RunSummary) -> float | None:
    """When the run stopped training to take its final save: the signal acted on at that step,
    else the rank failure, else the final commit less its own time; None: no stop was seen."""
    stop, sig, final = run.stop, run.stop_signal, run.final_commit
    if stop is not None and sig is not None and sig["time"] is not None and sig["step"] == _int(stop.get("step")):
        return float(sig["time"])
    failed = _time(run.rank_failure.get("time")) if run.rank_failure else None
    if failed is not None:
        return failed
    if final is not None and final["time"] is not None:
        return float(final["time"]) - max(final["save_s"] or 0.0, final["stall_s"] or 0.0)
    return _time(stop.get("time")) if stop else None


def _spans(runs: Sequence[tuple[RunSummary, float | None]], slurm: Sequence[RunRecord]) -> list[_Span]:
    """Each run's time points, clamped so that runs follow each other and points stay in order."""
    out: list[_Span] = []
    prev_end: int | None = None
    for run, prelude in runs:
        assert run.end_time is not None and run.first_time is not None  # runs without one are dropped
        end = _us(run.end_time)
        opened = run.head.get("event") in OPENERS  # else the ledger begins inside a run
        train_at = _opener_time(run) or run.first_time
        restore_at = train_at - ((_seconds(run.head.get("restore_s")) or 0.0) if opened else 0.0)
        process = _time(run.head.get("process_start")) if opened else None
        started = [t for t in (process, _slurm_start(run, train_at, slurm)) if t is not None and t <= restore_at]
        begin = _us(min([restore_at, run.first_time, *started, *([prelude] if prelude is not None else [])]))
        begin = begin if prev_end is None else max(begin, prev_end)
        end = max(end, begin)

        restore = _clamp(restore_at, begin, end, begin)
        train = _clamp(train_at, restore, end, restore)
        stop = _clamp(_stop_begin(run), train, end, end)
        stopped = _clamp(_time(run.stop.get("time")) if run.stop else None, stop, end, stop if run.stop else end)
        out.append(_Span(run=run, begin=begin, restore=restore, train=train, stop=stop, stopped=stopped, end=end,
                         startup_measured=bool(started)))
        prev_end = end
    return out


def _clamp(t: float | None, low: int, high: int, default: int) -> int:
    """``t`` in microseconds (``default`` when unknown), kept within [low, high]."""
    return min(max(_us(t) if t is not None else default, low), high)


def _slurm_start(run: RunSummary, when: float, slurm: Sequence[RunRecord]) -> float | None:
    """When Slurm started the allocation this run ran in (sacct or the jobcomp log), if it says."""
    if not slurm:
        return None
    record = match_run(slurm, run.slurm_job_id or _str(run.head.get("job_id")), when)
    return _time(record.start_s) if record is not None else None


def _interrupted(run: RunSummary) -> bool:
    return (run.stop is not None and not run.done) or run.requeue is not None or run.rank_failure is not None


def _criu(run: RunSummary) -> bool:
    return run.head.get("event") == "criu_restore" or run.head.get("mode") == "criu"


def _first_step(run: RunSummary) -> int | None:
    """The step the run began training at (0 for a fresh start); None: not a step-counting run."""
    if run.head.get("event") != "start" or _criu(run):
        return None
    resumed = _int(run.head.get("resumed_from"))
    return 0 if resumed is None else resumed


def _step_us(span: _Span) -> int | None:
    """One step's time in this run: the auto interval's measure, else (time to the newest step
    recorded, less the periodic saves' blocking) / steps trained; None: no steps to measure."""
    run = span.run
    if run.step_s:
        return max(1, _us(run.step_s))
    first, reached = _first_step(run), run.reached
    if first is None or reached is None or reached <= first or run.reached_time is None:
        return None
    trained = min(_us(run.reached_time), span.stop) - span.train - _us(run.stall_s_sum)
    return max(1, trained // (reached - first)) if trained > 0 else None


def _lost_time(span: _Span, nxt: _Span | None, step_us: int | None) -> tuple[int | None, int | None]:
    """(steps, microseconds) of training the next run did again; (None, None) where unknown:
    steps beyond the newest one a run recorded (it vanished) are never known."""
    run = span.run
    if nxt is None or run.done:
        return 0, 0
    if _criu(run) or _criu(nxt.run):
        lost_s = _seconds(nxt.run.head.get("lost_s"))
        return None, _us(lost_s) if lost_s is not None else None
    if run.reached is None or nxt.run.head.get("event") != "start":
        return None, None
    steps = max(0, run.reached - (_int(nxt.run.head.get("resumed_from")) or 0))
    if steps == 0:
        return 0, 0
    return steps, steps * step_us if step_us is not None else None


def goodput(events: Iterable[Event] | Fold, *, slurm: Sequence[RunRecord] | None = None) -> dict[str, Any]:
    """The wall time from the first run's start to the last run's end, per run (allocation) and
    in total, in buckets that sum to it: productive training, program start-up, checkpoint
    restore, checkpoint save (the part training waited for), wasted progress (training done
    again after an interruption), requeue and queue wait, other, and unaccounted (the time
    after a run that vanished without a stop record: training lost, the requeue and the next
    start-up cannot be told apart). Program start-up is measured where a run's opening record
    carries ``process_start`` or ``slurm`` says when its allocation started; elsewhere it falls
    in the requeue and queue wait (before the first run: outside the wall time).
    """
    folded = events if isinstance(events, Fold) else fold(events)
    runs: list[tuple[RunSummary, float | None]] = []
    prelude: float | None = None
    skipped = 0
    for run in folded.runs:
        if run.end_time is None or run.first_time is None:  # only the next run's prelude, or no valid time
            prelude = _earliest(prelude, run.prelude_time)
            skipped += run.prelude_time is None
            continue
        runs.append((run, prelude))
        prelude = run.prelude_time
    spans = _spans(runs, slurm or ())
    steps = [_step_us(s) for s in spans]
    known = sorted(x for x in steps if x is not None)
    typical = known[len(known) // 2] if known else None  # the median run's step time for runs without one
    rows, notes = [], []
    for i, span in enumerate(spans):
        nxt = spans[i + 1] if i + 1 < len(spans) else None
        row, why = _row(i + 1, span, nxt, steps[i] or typical, slurm or ())
        rows.append(row)
        notes += why
    total = {b: sum(r["_us"][b] for r in rows) for b in BUCKETS}
    wall = spans[-1].end - spans[0].begin if spans else 0  # == sum(total.values()): the rows tile it
    if any(not s.startup_measured for s in spans):
        notes.append("program start-up is measured only where a run's start record carries process_start or "
                     "Slurm's record says when the allocation started; elsewhere it is inside "
                     "requeue_and_queue_wait (for the first run: before the wall time)")
    if skipped:
        notes.append(f"{skipped} group(s) of records without a valid time were left out")
    for row in rows:
        row["buckets"] = {b: row["_us"][b] / _US for b in BUCKETS}
        del row["_us"]
    return {"wall_s": wall / _US, "allocations": len(rows),
            "goodput": round(total["productive_training"] / wall, 6) if wall else None,
            "buckets": {b: total[b] / _US for b in BUCKETS}, "badput_types": GOODPUT_NAMES,
            "rows": rows, "notes": notes}


def _row(index: int, span: _Span, nxt: _Span | None, step_us: int | None,
         slurm: Sequence[RunRecord]) -> tuple[dict[str, Any], list[str]]:
    """One run's buckets, over its own span and the gap after it (up to the next run's begin)."""
    run, notes = span.run, []
    b = dict.fromkeys(BUCKETS, 0)
    b["program_startup"] = span.restore - span.begin
    b["checkpoint_restore"] = span.train - span.restore
    training = span.stop - span.train
    periodic = min(_us(run.stall_s_sum), training)
    b["checkpoint_save"] = periodic + (span.stopped - span.stop)
    lost_steps, lost_us = _lost_time(span, nxt, step_us)
    wasted = min(lost_us or 0, training - periodic)
    b["wasted_progress"] = wasted
    b["productive_training"] = training - periodic - wasted
    after = "requeue_and_queue_wait" if _interrupted(run) else "other"
    b[after] += span.end - span.stopped
    gap = nxt.begin - span.end if nxt else 0
    vanished = nxt is not None and run.stop is None and not _interrupted(run)
    b["unaccounted" if vanished else after] += gap
    if vanished:
        notes.append(f"run #{index} ended without a stop record: the {gap / _US:.1f} s before the next run "
                     "are unaccounted (training lost, requeue and start-up cannot be told apart)")
    if lost_us is None and lost_steps:
        notes.append(f"run #{index}: {lost_steps} step(s) were trained again but no step time was measured: "
                     "their time is counted as productive")
    # A stopped run ended for the cause its history row gives (Slurm's record of the stop).
    if run.stop is not None:
        ended = _stop_of(run, slurm)[0] if _interrupted(run) else (_str(run.stop.get("reason")) or "stop")
    else:
        ended = "start-up" if _unstarted(run) else (
            "rank_failure" if run.rank_failure else "vanished" if nxt else "running or vanished")
    return {"index": index, "job_id": _str(run.head.get("job_id")), "restart_count": _int(run.head.get("restart_count")),
            "local_restart": _int(run.head.get("local_restart")), "ended": ended,
            "begin_time": span.begin / _US, "end_time": span.end / _US,
            "span_s": ((nxt.begin if nxt else span.end) - span.begin) / _US,
            "resumed_from": _first_step(run), "reached_step": run.reached,
            "lost_steps": lost_steps, "step_s": step_us / _US if step_us else None,
            "startup_measured": span.startup_measured, "_us": b}, notes


def record_superseded(ledger: Ledger, *, holder: str, holder_job_id: str | None) -> None:
    """For the run that finds another live job writing its directory (the writer lease is
    held): one ``superseded`` event naming that job; the run then exits quietly (status 0)."""
    ledger.append(SUPERSEDED, detail=f"another job holds the checkpoint directory: {holder}",
                  by_job_id=holder_job_id)


def load(ckpt_dir: Path) -> Fold:
    """The ledger of ``ckpt_dir``, streamed and folded."""
    return fold(Ledger(ckpt_dir).events())


def load_events(ckpt_dir: Path) -> list[dict[str, Any]]:
    return Ledger(ckpt_dir).read()
