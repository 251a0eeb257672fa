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
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..cluster.causes import RunRecord, classify, match_run, slurm_runs
from .ledger import Ledger

Event = Mapping[str, Any]
MAX_FAILED_DUMPS = 100  # failed CRIU dumps (and superseded restarts) listed: the newest
SUPERSEDED = "superseded"


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
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return int(value)


def _float(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _str(value: Any) -> str | None:
    return str(value) if value not in (None, "") else None


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

    def add(self, ev: Event) -> None:
        name = ev.get("event")
        self.last_time = _float(ev.get("time")) or self.last_time
        self.slurm_job_id = self.slurm_job_id or _str(ev.get("slurm_job_id"))
        if name == "signal" and self.signal is None:
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
            if step is not None:
                self.reached = step if self.reached is None else max(self.reached, step)

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
        if ev.get("event") in {"start", "criu_restore"} or not self.runs:
            self.runs.append(RunSummary(head=dict(ev)))
        self.runs[-1].add(ev)
        if ev.get("event") == "stop" and ev.get("reason") == "done":
            self.finished = True
        if ev.get("event") == "criu_dump_failed":
            self.failed_dumps = [*self.failed_dumps[-(MAX_FAILED_DUMPS - 1):], dict(ev)]

    def slurm_ids(self) -> set[str]:
        return {r.slurm_job_id or str(r.head["job_id"]) for r in self.runs if r.slurm_job_id or r.head.get("job_id")}


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
    if nxt is None or run.reached is None:
        return None
    resumed = _int(nxt.head.get("resumed_from"))
    if run.stop is None and run.rank_failure is None:
        return None
    return max(0, run.reached - (resumed or 0))


def _interruption(index: int, run: RunSummary, nxt: RunSummary | None, slurm: Sequence[RunRecord]) -> Interruption:
    stop, sig, req = run.stop, run.signal, run.requeue
    signame = _signame(run)
    signal_time = _float(sig.get("signal_time") or sig.get("time")) if sig else None
    when = signal_time or (_float(stop.get("time")) if stop else None) or run.last_time
    job_id = _str(run.head.get("job_id"))
    record = match_run(slurm, run.slurm_job_id or job_id, when)
    head_next = nxt.head if nxt else None
    end_time = _float((req or stop or {}).get("time")) or run.last_time
    next_time = _float(head_next.get("time")) if head_next else None
    requeued = req.get("requeued") if req else None
    return Interruption(
        index=index, job_id=job_id, restart_count=_int(run.head.get("restart_count")),
        cause=classify(stop, signame, signal_time, record, _str(req.get("cause")) if req else None,
                       requeued=bool(requeued)).value,
        slurm_state=record.state if record else None, signal=signame, signal_time=signal_time,
        step_at_signal=_int(sig.get("step")) if sig else None,
        stop_step=_int(stop.get("step")) if stop else None,
        committed_step=run.committed, resumed_step=_int(head_next.get("resumed_from")) if head_next else None,
        lost_steps=_lost(run, nxt), save_s=run.save_s(),
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
        if run.stop is None and nxt is None:
            continue  # still running (or the last run vanished without a trace)
        out.append(_interruption(len(out) + 1, run, nxt, slurm))
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
