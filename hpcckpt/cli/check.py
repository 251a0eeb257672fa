"""``hpcckpt check [--stop-at S,...|--stops N] -- CMD ARGS``: does CMD resume exactly?

Runs CMD once uninterrupted and once stopped at the given steps (or N random ones),
restarting it on exit 75 as the local supervisor would, each in a directory of its own
(HPCCKPT_DIR). At every step hpcckpt records a digest of each registered object, the
RNGs, user_meta and the modules' non-persistent buffers; the check reports the first
step where the two runs differ, what differs there, and the usual forgotten state.
Exit status: 0 identical, 1 not identical or the command failed (its output is shown), 2 bad usage.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from .common import add_json, emit, positive_int


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("check", help="run a training command uninterrupted and with stops; compare step by step",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stop-at", type=_steps, default=None, metavar="S,...",
                   help="steps at which to stop (default: --stops random steps)")
    p.add_argument("--stops", type=positive_int, default=2, help="how many random stops (default 2)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random stops (default 0)")
    p.add_argument("--dir", type=Path, default=None,
                   help="where the two runs keep their checkpoints and traces (default: a temporary directory)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ARGS")
    add_json(p)
    p.set_defaults(func=run)


def _steps(text: str) -> list[int]:
    try:
        steps = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected step numbers separated by commas, e.g. 12,40; got {text!r}") from None
    if not steps or min(steps) < 1:
        raise argparse.ArgumentTypeError(f"expected step numbers >= 1, e.g. 12,40; got {text!r}")
    return steps


def run(args: argparse.Namespace) -> int:
    from ..check import check

    cmd = list(args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd)
    if args.dir is not None:
        outcome = check(cmd, args.dir.absolute(), stop_at=args.stop_at, stops=args.stops, seed=args.seed)
    else:
        with tempfile.TemporaryDirectory(prefix="hpcckpt-check-") as work:
            outcome = check(cmd, Path(work), stop_at=args.stop_at, stops=args.stops, seed=args.seed)
    emit(args, outcome.as_dict(), "\n".join(outcome.lines()))
    return 0 if outcome.identical else 1
