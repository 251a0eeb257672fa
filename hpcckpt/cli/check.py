"""``hpcckpt check [--stop-at S,...|--stops N] -- CMD ARGS``: does CMD resume exactly?

Runs CMD once uninterrupted and once stopped at the given steps (or N random ones),
restarting it on exit 75 as the local supervisor would, each in a directory of its own
(HPCCKPT_DIR). At every step hpcckpt records a digest of each registered object, the
RNGs, user_meta and the modules' non-persistent buffers, field by field (state_dict keys,
tensor names, user_meta keys). The check reports the first step where the two runs differ
and, per object, the fields that differ, at which steps, and whether they still differ at the
end (with both values where they are numbers). It tells a divergence of the training (a
registered model, module, optimizer, RNG, non-persistent buffer or reported loss differs)
from bookkeeping (only a scheduler's or another object's field or a user_meta key differs,
e.g. a running average kept for display, while the training state agrees at every step), and
picks its hints from what differs: a counter off by a constant (one derived from the batch
index: number batches from batches.start), an EMA copy that differs while the model agrees,
a float set from a running average (leave it, or register it).
A start of CMD that runs past --timeout seconds is killed and reported as hung, with where
it hangs (py-spy dump where py-spy is installed, and the last lines of its output).
Exit status: 0 identical; 1 the training diverged, or the command failed (its output is
shown); 2 bad usage; 3 bookkeeping only (the models, optimizers, RNGs and losses agree at
every step and at the end, other state differs); 4 a run did not end within --timeout.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from ..exitcodes import EXIT_EXTERNAL, EXIT_NOTHING, EXIT_OK, EXIT_PROBLEM
from .common import add_json, emit, positive_int

EXIT_BOOKKEEPING = EXIT_NOTHING  # 3: only bookkeeping differs; the training state agrees
EXIT_HUNG = EXIT_EXTERNAL  # 4: a run of the command did not end within --timeout


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("check", help="run a training command uninterrupted and with stops; compare step by step",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stop-at", type=_steps, default=None, metavar="S,...",
                   help="steps at which to stop (default: --stops random steps)")
    p.add_argument("--stops", type=positive_int, default=2, help="how many random stops (default 2)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random stops (default 0)")
    p.add_argument("--timeout", type=_seconds, default=None, metavar="S",
                   help="the most seconds one start of CMD may run; past it the run is killed and reported as "
                        "hung, with where it hangs (exit 4). Default: no limit for the uninterrupted run, 3 "
                        "times its time + 60 s for each start of the stopped run")
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


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, e.g. 600; got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected seconds > 0, e.g. 600; got {text!r}")
    return value


def run(args: argparse.Namespace) -> int:
    from ..check import RunTimeout, check

    cmd = list(args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd)
    opts = dict(stop_at=args.stop_at, stops=args.stops, seed=args.seed, timeout=args.timeout)
    try:
        if args.dir is not None:
            outcome = check(cmd, args.dir.absolute(), **opts)
        else:
            with tempfile.TemporaryDirectory(prefix="hpcckpt-check-") as work:
                outcome = check(cmd, Path(work), **opts)
    except RunTimeout as exc:
        emit(args, {"error": str(exc), "type": "RunTimeout", "hung": True}, f"hpcckpt check: hung: {exc}")
        return EXIT_HUNG
    emit(args, outcome.as_dict(), "\n".join(outcome.lines()))
    if outcome.identical:
        return EXIT_OK
    return EXIT_BOOKKEEPING if outcome.verdict == "bookkeeping" else EXIT_PROBLEM
