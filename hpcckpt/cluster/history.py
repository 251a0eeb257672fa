"""Interruptions of one training run, rebuilt from its ledger and Slurm's records.

The ledger is a sequence of runs, each opened by a ``start`` event. A run that
ends in a ``stop`` with a reason other than "done" (or that simply vanishes, e.g.
killed before it could stop) is an interruption; the next ``start`` says where
training resumed and how long the restore took.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hpcckpt.cluster.causes import RunRecord, classify, match_run, slurm_runs

Event = Mapping[str, Any]


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
    lost_steps: int | None
    save_s: float | None
    queue_wait_s: float | None
    restore_s: float | None
    requeue_method: str | None
    requeue_detail: str | None
    failed_ranks: list[int] | None = None  # a rank failure (JIT): which ranks died or hung

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def split_runs(events: Sequence[Event]) -> list[list[Event]]:
    """Events grouped per run; each group starts at a ``start`` (or a CRIU restore)."""
    runs: list[list[Event]] = []
    for ev in events:
        if ev.get("event") in {"start", "criu_restore"} or not runs:
            runs.append([])
        runs[-1].append(ev)
    return runs


def _first(run: Sequence[Event], name: str) -> Event | None:
    return next((e for e in run if e.get("event") == name), None)


def _last(run: Sequence[Event], name: str) -> Event | None:
    return next((e for e in reversed(run) if e.get("event") == name), None)


def _int(value: Any) -> int | None:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _float(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _last_step(run: Sequence[Event]) -> int | None:
    steps = [_int(e.get("step")) for e in run if e.get("event") in {"signal", "commit", "stop"}]
    # A rank failure loses the step in flight (the JIT checkpoint holds the one before it).
    steps += [_int(e.get(k)) for e in run if e.get("event") == "rank_failure" for k in ("lost_step", "reached_step")]
    known = [s for s in steps if s is not None]
    return max(known) if known else None


def _save_s(run: Sequence[Event], committed: int | None) -> float | None:
    for ev in reversed(run):
        if ev.get("event") == "commit" and _int(ev.get("step")) == committed:
            return _float(ev.get("save_s"))
        if ev.get("event") == "criu_dump":
            return _float(ev.get("dump_s"))
    return None


def _interruption(index: int, run: Sequence[Event], nxt: Sequence[Event] | None,
                  slurm: Sequence[RunRecord]) -> Interruption:
    stop, sig, req = _last(run, "stop"), _first(run, "signal"), _last(run, "requeue")
    head = run[0]
    signame = str(sig.get("signame")) if sig else (str(stop.get("signame")) if stop and stop.get("signame") else None)
    signal_time = _float(sig.get("signal_time") or sig.get("time")) if sig else None
    when = signal_time or (_float(stop.get("time")) if stop else None) or _float(run[-1].get("time"))
    job_id = head.get("job_id")
    record = match_run(slurm, str(job_id) if job_id else None, when)
    committed = _int(stop.get("committed_step")) if stop else None
    commits = [_int(e.get("step")) for e in run if e.get("event") == "commit"]
    if committed is None and any(c is not None for c in commits):
        committed = max(c for c in commits if c is not None)
    start_next = nxt[0] if nxt else None
    resumed = _int(start_next.get("resumed_from")) if start_next else None
    reached = _last_step(run)
    end_time = _float((req or stop or run[-1]).get("time"))
    next_time = _float(start_next.get("time")) if start_next else None
    return Interruption(
        index=index, job_id=str(job_id) if job_id else None,
        restart_count=_int(head.get("restart_count")),
        cause=classify(stop, signame, signal_time, record,
                       str(req.get("cause")) if req and req.get("cause") else None).value,
        slurm_state=record.state if record else None,
        signal=signame, signal_time=signal_time,
        step_at_signal=_int(sig.get("step")) if sig else None,
        stop_step=_int(stop.get("step")) if stop else None,
        committed_step=committed, resumed_step=resumed,
        lost_steps=(max(0, reached - (resumed or 0)) if reached is not None and start_next else None),
        save_s=_save_s(run, committed),
        queue_wait_s=(next_time - end_time if next_time is not None and end_time is not None else None),
        restore_s=_float(start_next.get("restore_s")) if start_next else None,
        requeue_method=str(req.get("method")) if req else None,
        requeue_detail=str(req.get("detail")) if req else None,
        failed_ranks=_failed_ranks(run))


def _failed_ranks(run: Sequence[Event]) -> list[int] | None:
    ev = _last(run, "rank_failure")
    ranks = ev.get("failed_ranks") if ev else None
    return sorted(r for r in ranks if _int(r) is not None) if isinstance(ranks, list) else None


def interruptions(events: Sequence[Event], *, slurm: Sequence[RunRecord] | None = None) -> list[Interruption]:
    """One row per interrupted run; ``slurm`` defaults to what Slurm recorded for these jobs."""
    runs = split_runs(events)
    if slurm is None:
        ids = {str(e["job_id"]) for e in events if e.get("job_id")}
        slurm = slurm_runs(ids)
    out: list[Interruption] = []
    for i, run in enumerate(runs):
        stop = _last(run, "stop")
        if stop is not None and stop.get("reason") == "done":
            continue
        nxt = runs[i + 1] if i + 1 < len(runs) else None
        if stop is None and nxt is None:
            continue  # still running (or the last run vanished without a trace)
        out.append(_interruption(len(out) + 1, run, nxt, slurm))
    return out


def summary(events: Sequence[Event], rows: Sequence[Interruption]) -> dict[str, Any]:
    done = any(e.get("event") == "stop" and e.get("reason") == "done" for e in events)
    lost = [r.lost_steps for r in rows if r.lost_steps is not None]
    return {"interruptions": len(rows), "finished": done, "lost_steps_total": sum(lost),
            "causes": sorted({r.cause for r in rows})}


def load_events(ckpt_dir: Path) -> list[dict[str, Any]]:
    from hpcckpt.ledger import Ledger

    return Ledger(ckpt_dir).read()
