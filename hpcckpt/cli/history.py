"""``hpcckpt history DIR``: one row per interruption of the run checkpointed in DIR."""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

from hpcckpt.cli.common import add_json, directory, emit
from hpcckpt.errors import NoCheckpoint
from hpcckpt.lifecycle.history import Interruption, interruptions, load, summary


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("history", help="per interruption: cause, signal, lost steps, save/queue/restore time",
                       description=__doc__)
    p.add_argument("dir", type=Path, help="checkpoint directory (holds ledger.jsonl)")
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
