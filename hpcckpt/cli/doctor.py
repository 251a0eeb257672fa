"""``hpcckpt doctor``: will this job survive its next warning? Prints what to change.

    hpcckpt doctor --script train.sbatch --dir /scratch/run1/ckpt [--json]
    hpcckpt doctor --script own.sbatch [--dir RUN/hpcckpt]          (a script with its own checkpoints)
    hpcckpt doctor --mode own [--notice TERM] [--lead-s 300] -- python train.py --resume ckpt.pt
    hpcckpt doctor --mode criu [--trial-s 20] -- python train.py   (can CRIU dump this command?)

Checks what applies to the job's mode (--mode, else the script's `hpcckpt run --mode`):
in-process (the Checkpointer): the --signal lead time against the measured save cost (from
the ledger in --dir), B: vs step delivery, HPCCKPT_SIGNALS, the NCCL/USR1 clash; CRIU: its
dump signals, one node only, and plug-ins (criu, CUDA); own checkpoints: the notice (which
signal, whether the script catches it), its lead against the script's save, GraceTime and
KillWait. All: requeue permission, JobRequeue, partitions' GraceTime.

With `-- CMD`, a trial: CMD runs for --trial-s seconds as the mode would start it, without
side effects (its working directory and the directories its arguments name are overlays whose
writes are discarded; scontrol requeue/update, scancel and sbatch are blocked; every process
it started is ended after). Doctor reads what its processes do with the stop's signal
(SigCgt), and sends it as the job would get it (own: the notice; CRIU: Slurm's TERM, when
some process hears it) to see how it ends and how long that takes (--stop-wait-s, 0: not).
Exit codes: 0 nothing failed (warnings allowed); 1 a check failed.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from hpcckpt.cli.common import add_json, directory, emit
from hpcckpt.doctor import Check, build_context, own_trial, run_checks
from hpcckpt.errors import ConfigError

_MARK = {"ok": "ok  ", "info": "info", "warn": "WARN", "fail": "FAIL"}


def register(sub: argparse._SubParsersAction) -> None:
    from hpcckpt.cli.run import non_negative_seconds

    p = sub.add_parser("doctor", help="check signal lead time, requeue, GraceTime, USR1/NCCL...",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--script", type=Path, default=None, help="the sbatch script to check")
    p.add_argument("--dir", type=Path, default=None,
                   help="checkpoint directory (measured save costs; own mode: the run's hpcckpt records)")
    p.add_argument("--no-plugins", action="store_true", help="skip checks of other parts (CRIU)")
    p.add_argument("--mode", choices=("criu", "own"), default=None,
                   help="the job's mode (default: the script's hpcckpt run --mode). With `-- CMD`: criu: start "
                        "CMD as CRIU mode would and say whether criu could dump it and what it does with TERM; "
                        "own: start it as hpcckpt run --mode own would, see whether it catches its notice, send it "
                        "and time its exit. The trial has no side effects and is ended after")
    p.add_argument("--notice", default=None, metavar="SIGNAL|file[:PATH]",
                   help="own mode: how the script hears the stop (default: the script's --notice, else TERM)")
    p.add_argument("--lead-s", type=non_negative_seconds, default=None, metavar="SECONDS",
                   help="own mode: the notice's lead before the end (default: the script's --lead-s or --signal)")
    p.add_argument("--requeue-on", default=None, metavar="CODES",
                   help="own mode: exit statuses that mean 'requeue me' (default: the script's, else 75)")
    p.add_argument("--save-s", type=non_negative_seconds, default=None, metavar="SECONDS",
                   help="own mode: how long the script's save on the notice takes, when you know it")
    p.add_argument("--trial-s", type=float, default=20.0, help="how long the trial runs before the look (default 20)")
    p.add_argument("--stop-wait-s", type=non_negative_seconds, default=60.0, metavar="SECONDS",
                   help="how long the trial waits for CMD to exit after its stop signal (default 60; 0: send none)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ARGS (with --mode criu or --mode own)")
    add_json(p)
    p.set_defaults(func=run)


def _codes(text: str | None) -> frozenset[int] | None:
    if text is None:
        return None
    try:
        return frozenset(int(c) for c in text.split(",") if c.strip())
    except ValueError:
        raise ConfigError(f"--requeue-on {text!r}: exit statuses, comma-separated, e.g. 75 or 75,3") from None


def run(args: argparse.Namespace) -> int:
    if args.script is not None and not args.script.is_file():
        raise ConfigError(f"--script={args.script} is not a file; pass the sbatch script, e.g. --script train.sbatch")
    ckpt_dir = directory(args.dir, option="--dir", must_exist=False) if args.dir is not None else None
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if cmd and args.mode is None:
        raise ConfigError("a command after -- is checked only with --mode criu or --mode own: "
                          "hpcckpt doctor --mode criu -- CMD")
    ctx = build_context(script=args.script, ckpt_dir=ckpt_dir, mode=args.mode, notice=args.notice,
                        lead_s=args.lead_s, save_s=args.save_s, requeue_on=_codes(args.requeue_on))
    trial_checks: list[Check] = []
    if cmd and args.mode == "criu" and ctx.nodes > 1:
        from hpcckpt.criu.options import multi_node_refusal

        trial_checks.append(Check(name="criu trial", ok=False, detail=f"not run: {multi_node_refusal(ctx.nodes)}"))
    elif cmd and args.mode == "criu":
        from hpcckpt.criu.doctor import trial

        trial_checks += trial(cmd, wait_s=args.trial_s, stop_wait_s=args.stop_wait_s)
    elif cmd:
        own = ctx.own
        found = own_trial(cmd, notice=own.notice, wait_s=args.trial_s, stop_wait_s=args.stop_wait_s,
                          requeue_on=own.requeue_on)
        trial_checks += found.checks
        ctx = dataclasses.replace(ctx, trial_save_s=found.save_s, notice_caught=found.notice_caught,
                                  term_disposition=found.term_disposition)
    results = run_checks(ctx, plugins=not args.no_plugins) + trial_checks
    lines = []
    for c in results:
        lines.append(f"[{_MARK.get(c.severity, c.severity)}] {c.name}: {c.detail}")
        if c.fix and c.severity in {"warn", "fail"}:
            lines.append(f"       fix: {c.fix}")
    failed = [c for c in results if c.severity == "fail"]
    emit(args, {"ok": not failed, "checks": [c.as_dict() for c in results]}, "\n".join(lines))
    return 1 if failed else 0
