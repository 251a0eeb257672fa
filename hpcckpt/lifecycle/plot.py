"""``hpcckpt history DIR --plot FILE.png``: the requeue chain of one run as a timeline.

One row per allocation (a run of the job, as ``goodput`` counts them), on one time axis from
the first run's start: its start-up, its restore, its training (the part the next run did
again drawn over its end), its final save at the stop, then the requeue and the wait in the
queue until the next allocation began. Each stop is labelled with its cause (``preemption``,
``time_limit``, ``signal``, ... as ``hpcckpt history`` names them; ``done`` for the end), and
the title gives the goodput. Drawn with matplotlib's Agg backend: no display needed.

The figure is returned as well as written, so that a caller (a test) can read its elements:
each allocation's training bar is a collection with gid ``allocation-N``, each stop's label a
text with gid ``cause-N``, each wait a collection with gid ``wait-N`` (N: the allocation).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..cluster.causes import RunRecord
from .history import (
    Event,
    Fold,
    Interruption,
    RunSummary,
    _earliest,
    _Span,
    _spans,
    _unstarted,
    fold,
    goodput,
    interruptions,
)

if TYPE_CHECKING:  # matplotlib is imported when a figure is drawn, never with the CLI
    from matplotlib.figure import Figure

COLORS = {"startup": "#b0b0b0", "restore": "#f0a030", "training": "#3a9a4a", "wasted": "#d04040",
          "save": "#3060c0", "after": "#c8c8e8", "wait": "#909090"}
LABELS = {"startup": "start-up", "restore": "restore", "training": "training", "wasted": "trained again",
          "save": "final save", "after": "requeue", "wait": "queue wait"}


def _causes(folded: Fold, rows: Sequence[Interruption]) -> dict[int, str]:
    """The cause of each interrupted run, keyed by ``id(run)``: ``interruptions`` gives one
    row per interrupted run, in order, with the same rule for which runs count."""
    out: dict[int, str] = {}
    plain = iter([r for r in rows if r.cause != "superseded"])
    runs = folded.runs
    for i, run in enumerate(runs):
        if run.done:
            out[id(run)] = "done"
            continue
        nxt = runs[i + 1] if i + 1 < len(runs) else None
        if run.stop is None and nxt is None and not _unstarted(run):
            out[id(run)] = "running"
            continue
        row = next(plain, None)
        if row is not None:
            out[id(run)] = row.cause
    return out


def _runs(folded: Fold) -> list[tuple[RunSummary, float | None]]:
    """The runs ``goodput`` counts, each with the earliest record the next run wrote before its
    opener (its prelude), exactly as ``goodput`` pairs them."""
    runs: list[tuple[RunSummary, float | None]] = []
    prelude: float | None = None
    for run in folded.runs:
        if run.end_time is None or run.first_time is None:
            prelude = _earliest(prelude, run.prelude_time)
            continue
        runs.append((run, prelude))
        prelude = run.prelude_time
    return runs


def _unit(wall_s: float) -> tuple[float, str]:
    if wall_s >= 2 * 3600:
        return 3600.0, "hours"
    if wall_s >= 120:
        return 60.0, "minutes"
    return 1.0, "seconds"


def plot(events: Iterable[Event] | Fold, out: Path | None = None, *,
         slurm: Sequence[RunRecord] | None = None, title: str | None = None) -> Figure:
    """Draw the timeline of ``events`` (a ledger, or its fold); write it to ``out`` (PNG, SVG,
    PDF: by the suffix) when given. ``slurm``: Slurm's records of the runs (start times,
    causes); ``[]`` to use the ledger alone."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    folded = events if isinstance(events, Fold) else fold(events)
    slurm = list(slurm) if slurm is not None else []
    info = goodput(folded, slurm=slurm)
    causes = _causes(folded, interruptions(folded, slurm=slurm))
    paired = _runs(folded)
    spans = _spans(paired, slurm)
    n = len(spans)
    fig = Figure(figsize=(11, 1.6 + 0.7 * max(n, 1)), layout="constrained")
    ax = fig.add_subplot()
    share = f"{100 * info['goodput']:.1f}%" if info["goodput"] is not None else "-"
    head = title or "hpcckpt history"
    fig.suptitle(f"{head}: goodput {share}, {n} allocation(s), "
                 f"{_duration(info['buckets']['productive_training'])} of training in {_duration(info['wall_s'])}")
    if not spans:
        ax.text(0.5, 0.5, "no run in this ledger", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        if out is not None:
            fig.savefig(out)
        return fig
    t0 = spans[0].begin
    scale, unit = _unit(info["wall_s"])
    x = lambda us: (us - t0) / 1e6 / scale  # noqa: E731  (microseconds -> axis units)
    for i, (span, row) in enumerate(zip(spans, info["rows"])):
        nxt = spans[i + 1].begin if i + 1 < n else None
        _allocation(ax, x, i, n - 1 - i, span, row, nxt, causes.get(id(span.run), "stop"))  # the first on top
    ax.set_yticks(range(n), [_ylabel(i, row) for i, row in reversed(list(enumerate(info["rows"])))])
    ax.set_ylim(-0.9, n - 0.1)
    ax.set_xlabel(f"{unit} since the first allocation began")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(handles=[Patch(facecolor=COLORS[k], label=LABELS[k]) for k in COLORS], loc="upper center",
              bbox_to_anchor=(0.5, -0.25 if n < 3 else -0.12), ncol=len(COLORS), fontsize=8, frameon=False)
    if out is not None:
        fig.savefig(out, dpi=120)
    return fig


def _allocation(ax: Any, x: Callable[[float], float], i: int, y: float, span: _Span, row: dict[str, Any],
                nxt: float | None, cause: str) -> None:
    """Allocation ``i``'s row at height ``y``: its phases, the queue wait before ``nxt`` (the next
    allocation's begin), why it stopped, and what it resumed from and lost."""
    height = 0.5
    wasted_us = int(round(row["buckets"]["wasted_progress"] * 1e6))
    for a, b, kind, gid in ((span.begin, span.restore, "startup", None), (span.restore, span.train, "restore", None),
                            (span.train, span.stop, "training", f"allocation-{i + 1}"),
                            (span.stop - wasted_us, span.stop, "wasted", None),
                            (span.stop, span.stopped, "save", None), (span.stopped, span.end, "after", None)):
        _bar(ax, x(a), x(b), y, height, kind, gid)
    if nxt is not None and nxt > span.end:
        col = ax.broken_barh([(x(span.end), x(nxt) - x(span.end))], (y - height / 6, height / 3),
                             facecolors=COLORS["wait"], hatch="///", edgecolor="white", linewidth=0)
        col.set_gid(f"wait-{i + 1}")
        ax.annotate(f"queue {_duration((nxt - span.end) / 1e6)}", (x((span.end + nxt) / 2), y - height / 2),
                    ha="center", va="top", fontsize=8, color="#505050")
    if cause != "running":
        ax.plot([x(span.stop), x(span.stop)], [y - height * 0.7, y + height * 0.7], color="black", linewidth=1)
        ax.text(x(span.stop), y + height * 0.75, cause, ha="center", va="bottom", fontsize=9,
                fontweight="bold" if cause != "done" else "normal", gid=f"cause-{i + 1}")
    resumed = row["resumed_from"]
    if resumed:
        ax.text(x(span.begin), y + height * 0.6, f"resumed from step {resumed}", ha="left", va="bottom",
                fontsize=8, color="#505050")
    lost = row["lost_steps"]
    if lost:
        ax.text(x(span.stop), y - height * 0.6, f"{lost} step(s) lost", ha="right", va="top", fontsize=8,
                color=COLORS["wasted"])


def _bar(ax: Any, a: float, b: float, y: float, height: float, kind: str, gid: str | None) -> None:
    if b <= a and gid is None:
        return
    col = ax.broken_barh([(a, max(b - a, 0.0))], (y - height / 2, height), facecolors=COLORS[kind],
                         edgecolor="none")
    if gid is not None:
        col.set_gid(gid)


def _duration(s: float) -> str:
    if s < 10:
        return f"{s:.1f} s"
    if s < 600:
        return f"{s:.0f} s"
    return f"{s / 60:.1f} min" if s < 36000 else f"{s / 3600:.1f} h"


def _ylabel(i: int, row: dict[str, Any]) -> str:
    job = row.get("job_id")
    return f"#{i + 1}" + (f" job {job}" if job else "")
