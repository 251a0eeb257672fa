"""``hpcckpt history DIR``: one row per interruption of the run checkpointed in DIR.

``--goodput``: the job's wall time split into productive training and badput buckets,
per run (allocation) and in total. ``--plot FILE.png``: the requeue chain as a timeline
(each allocation, its stop and cause, restores, lost work, queue waits; goodput in the title)."""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

from hpcckpt.cli.common import add_json, directory, emit
from hpcckpt.cluster.causes import slurm_runs
from hpcckpt.errors import ConfigError, NoCheckpoint
from hpcckpt.lifecycle.history import BUCKETS, Fold, Interruption, goodput, interruptions, load, summary


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("history", help="per interruption: cause, signal, lost steps, save/queue/restore time",
                       description=__doc__)
    p.add_argument("dir", type=Path, help="checkpoint directory (holds ledger.jsonl)")
    p.add_argument("--goodput", action="store_true",
                   help="the wall time split into productive training and badput (save, restore, lost "
                        "progress, requeue and queue wait, start-up), per allocation and in total")
    p.add_argument("--plot", type=Path, metavar="FILE",
                   help="also draw the requeue chain as a timeline into FILE (.png, .svg or .pdf): each allocation, "
                        "its stop and cause, restores, work done again, queue waits; goodput in the title")
    add_json(p)
    p.set_defaults(func=run)


def _fmt(value: object, unit: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}{unit}"
    return f"{value}{unit}"


def _when(epoch: object) -> str:
    if isinstance(epoch, bool) or not isinstance(epoch, (int, float)) or not math.isfinite(epoch) or epoch <= 0:
        return "-"
    return time.strftime("%H:%M:%S", time.localtime(epoch))


def run(args: argparse.Namespace) -> int:
    folded = load(directory(args.dir, option="DIR"))
    if not folded.runs:
        raise NoCheckpoint(f"{args.dir}/ledger.jsonl is missing or empty: no run has started "
                           "with this checkpoint directory (check the path)")
    if args.plot is not None:
        _plot(args, folded)
    if args.goodput:
        return _goodput(args, folded)
    rows = interruptions(folded)
    head = (f"{'#':>2} {'job':>10} {'cause':<16} {'signal':<8} {'at':<8} {'sig step':>8} "
            f"{'committed':>9} {'resumed':>12} {'lost':>7} {'save':>7} {'queue':>7} {'restore':>7}  requeue")
    lines = [head] + [
        f"{r.index:>2} {_fmt(r.job_id):>10} {r.cause:<16} {_fmt(r.signal):<8} {_when(r.signal_time):<8} "
        f"{_fmt(r.step_at_signal):>8} {_fmt(r.committed_step):>9} {_resumed(r):>12} "
        f"{_lost(r):>7} "
        f"{_fmt(r.save_s, 's'):>7} {_fmt(r.queue_wait_s, 's'):>7} {_fmt(r.restore_s, 's'):>7}  {_requeue(r)}"
        for r in rows]
    info = summary(folded, rows)
    lines += [f"! #{r.index}: job {r.job_id} superseded: {r.requeue_detail}" for r in rows if r.cause == "superseded"]
    lines += [f"! #{r.index}: the next run started from the beginning: {r.started_over}"
              for r in rows if r.started_over]
    lines += [f"! #{r.index}: rank(s) {', '.join(map(str, r.failed_ranks))} failed; the survivors saved step "
              f"{_fmt(r.committed_step)} just in time" for r in rows if r.failed_ranks]
    unknown = f" (+ unknown in {info['lost_steps_unknown']})" if info["lost_steps_unknown"] else ""
    seconds = f", {info['lost_s_total']:.1f} s of CRIU progress lost" if info["lost_s_total"] is not None else ""
    lines.append(f"{info['interruptions']} interruption(s), {info['lost_steps_total']} lost step(s){seconds}"
                 f"{unknown}, {'finished' if info['finished'] else 'not finished'}")
    # A failed CRIU dump is no interruption (the job ran on) but must not go unseen.
    failed = folded.failed_dumps
    lines += [f"! {_when(e.get('time'))} CRIU dump failed, {_dump_outcome(e)}: "
              f"{e.get('error')}" + (f"; fix: {e['fix']}" if e.get("fix") else "") for e in failed]
    emit(args, {"dir": str(args.dir), **info, "rows": [r.as_dict() for r in rows], "failed_dumps": failed},
         "\n".join(lines))
    return 0


def _plot(args: argparse.Namespace, folded: Fold) -> None:
    """``--plot FILE``: the timeline, written before the table (the table goes to stdout as ever)."""
    from hpcckpt.lifecycle.plot import plot

    out = args.plot
    if out.suffix.lower() not in (".png", ".svg", ".pdf"):
        raise ConfigError(f"--plot {out}: give a file ending in .png, .svg or .pdf")
    if not out.parent.is_dir():
        raise ConfigError(f"--plot {out}: its directory {out.parent} does not exist")
    plot(folded, out, slurm=slurm_runs(folded.slurm_ids()), title=f"hpcckpt history {args.dir}")
    print(f"hpcckpt history: wrote {out}", file=sys.stderr)


def _requeue(r: Interruption) -> str:
    """The requeue column: how the job came back, with the successor's id."""
    if r.requeue_method is None:
        return "-"
    if r.successor_job_id:
        return f"successor {r.successor_job_id}"
    return r.requeue_method if r.requeued is not False else f"NOT requeued ({r.requeue_method})"


def _resumed(r: Interruption) -> str:
    """Where the next run resumed: the CRIU image it restored ("none": it started over), or the step."""
    if r.resumed_image:
        return r.resumed_image
    return "none" if r.started_over else _fmt(r.resumed_step)


def _dump_outcome(e: dict) -> str:
    """What became of the job when its CRIU dump failed (ledger ``criu_dump_failed``)."""
    if e.get("stuck"):
        return "THE JOB MAY BE STUCK (a CUDA driver call did not return)"
    if e.get("exited_itself"):
        return f"the job finished by itself (exit {e.get('exit_code')})"
    return "job ended" if e.get("job_ended") else "job kept running"


def _lost(r: Interruption) -> str:
    """Lost steps; for a CRIU run the seconds of progress (``<=N s`` when only bounded)."""
    if r.lost_steps is not None:
        return _fmt(r.lost_steps)
    if r.lost_s is not None:
        return f"{r.lost_s:.1f}s" if r.lost_exact else f">={r.lost_s:.1f}s"
    if r.lost_at_most_s is not None:
        return f"<={r.lost_at_most_s:.0f}s"
    return "unknown"


_SHORT = {"productive_training": "training", "program_startup": "startup", "checkpoint_restore": "restore",
          "checkpoint_save": "save", "wasted_progress": "wasted", "requeue_and_queue_wait": "requeue+q",
          "other": "other", "unaccounted": "unacct"}


def _goodput(args: argparse.Namespace, folded: Fold) -> int:
    """``--goodput``: one row per run (allocation, with the wait after it) and the total."""
    info = goodput(folded, slurm=slurm_runs(folded.slurm_ids()))
    wall = info["wall_s"]
    share = f"{100 * info['goodput']:.1f}%" if info["goodput"] is not None else "-"
    lines = [f"goodput {share}: {_secs(info['buckets']['productive_training'])} of productive training in "
             f"{_secs(wall)} of wall time, {info['allocations']} run(s)",
             f"{'#':>3} {'job':>10} {'ended':<12} {'span':>8} " + " ".join(f"{_SHORT[b]:>9}" for b in BUCKETS)]
    lines += [f"{r['index']:>3} {_fmt(r['job_id']):>10} {r['ended'][:12]:<12} {_secs(r['span_s']):>8} "
              + " ".join(f"{_secs(r['buckets'][b]):>9}" for b in BUCKETS) for r in info["rows"]]
    lines.append(f"{'':>3} {'total':>10} {'':<12} {_secs(wall):>8} "
                 + " ".join(f"{_secs(info['buckets'][b]):>9}" for b in BUCKETS))
    lines.append(f"{'':>3} {'':>10} {'':<12} {'':>8} "
                 + " ".join(f"{_pct(info['buckets'][b], wall):>9}" for b in BUCKETS))
    lines += [f"! {note}" for note in info["notes"]]
    emit(args, {"dir": str(args.dir), **info}, "\n".join(lines))
    return 0


def _secs(s: float) -> str:
    """Seconds as a short duration: 12.34s, 12.3m, 12.3h."""
    if s < 600:
        return f"{s:.2f}s"
    return f"{s / 60:.1f}m" if s < 36000 else f"{s / 3600:.1f}h"


def _pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole > 0 else "-"
