"""``hpcckpt demo``: preempt, requeue and resume a small transformer; compare bit for bit.

Runs on the GPU when one is visible (``--device auto``), deterministically: the
uninterrupted and the preempted runs must agree in every bit of every parameter.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..config import DEFAULT_ENGINE
from .common import add_json, emit


def step_list(raw: str) -> tuple[int, ...]:
    """``--preempt-at 9,23`` -> (9, 23); anything else is a usage error naming the option."""
    out: list[int] = []
    for part in raw.split(","):
        if not part.strip():
            continue
        try:
            out.append(int(part))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{part.strip()!r} is not a step number; give comma-separated steps (e.g. --preempt-at 9,23)") from None
    return tuple(out)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="train, preempt, requeue, resume; check the result is bit-identical",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", default=DEFAULT_ENGINE, choices=["sync", "concurrent"],
                   help=f"the in-process engine (default: {DEFAULT_ENGINE}, what Checkpointer() uses)")
    p.add_argument("--device", default="auto", help="auto (cuda when a GPU is visible), cuda or cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--preemptions", type=int, default=1, help="number of preemptions at random steps")
    p.add_argument("--preempt-at", type=step_list, default=(), help="comma-separated steps instead of random ones")
    p.add_argument("--every", type=int, default=10, help="periodic checkpoint interval (steps)")
    p.add_argument("--dir", type=Path, default=None, help="work directory (created; default: a fresh temp dir)")
    p.add_argument("--no-plot", action="store_true")
    add_json(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..demo.run import DemoOptions, run_demo
    from ..demo.runtime import resolve_device, work_dir

    o = DemoOptions(engine=args.engine, seed=args.seed, steps=args.steps, preemptions=args.preemptions,
                    preempt_at=args.preempt_at, every=args.every, dir=args.dir, plot=not args.no_plot,
                    device=resolve_device(args.device))
    if o.dir is not None:
        work_dir(o.dir)  # a file or an unwritable path is refused before anything runs
    say = (lambda s: print(f"[demo] {s}", file=sys.stderr)) if args.json else (lambda s: print(f"[demo] {s}"))
    res = run_demo(o, progress=say)
    verdict = "IDENTICAL" if res["identical"] else "DIFFERENT"
    text = (f"[demo] {verdict}: {res['steps']} steps on {res['device']}, {res['engine']} engine, preempted at "
            f"{res['preempted_at']}, resumed from {res['resumed_from']}, max |param diff| = {res['max_abs_param_diff']}\n"
            f"[demo] loss traces equal: {res['losses_equal']}; digest {str(res['param_digest'])[:16]}"
            + (f"\n[demo] {res['note']}" if res.get("note") else "")
            + (f"\n[demo] plot: {res['plot']}" if res.get("plot") else "") + f"\n[demo] files: {res['dir']}")
    emit(args, res, text)
    return 0 if res["identical"] else 1
