"""``hpcckpt doctor``: will this job survive its next warning? Prints what to change.

    hpcckpt doctor --script train.sbatch --dir /scratch/run1/ckpt [--json]
    hpcckpt doctor --mode criu [--trial-s 20] -- python train.py   (can CRIU dump this command?)

Checks the --signal lead time against the measured save cost (from the ledger in
--dir), B: vs step delivery for the launcher in the script, requeue permission,
JobRequeue, partitions' GraceTime, the NCCL/USR1 clash, and plug-ins (CRIU).
Exit codes: 0 nothing failed (warnings allowed); 1 a check failed.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hpcckpt.cli.common import add_json, directory, emit
from hpcckpt.doctor import build_context, run_checks
from hpcckpt.errors import ConfigError

_MARK = {"ok": "ok  ", "info": "info", "warn": "WARN", "fail": "FAIL"}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="check signal lead time, requeue, GraceTime, USR1/NCCL...",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--script", type=Path, default=None, help="the sbatch script to check")
    p.add_argument("--dir", type=Path, default=None, help="checkpoint directory (measured save costs)")
    p.add_argument("--no-plugins", action="store_true", help="skip checks of other parts (CRIU)")
    p.add_argument("--mode", choices=("criu",), default=None,
                   help="with `-- CMD`: start CMD as CRIU mode would and say whether criu could dump it "
                        "(io_uring, perf events, established TCP, NCCL, MPS); the trial instance is ended after")
    p.add_argument("--trial-s", type=float, default=20.0, help="how long the trial runs before the look (default 20)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ARGS (with --mode criu)")
    add_json(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.script is not None and not args.script.is_file():
        raise ConfigError(f"--script={args.script} is not a file; pass the sbatch script, e.g. --script train.sbatch")
    ckpt_dir = directory(args.dir, option="--dir", must_exist=False) if args.dir is not None else None
    results = run_checks(build_context(script=args.script, ckpt_dir=ckpt_dir), plugins=not args.no_plugins)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if cmd and args.mode != "criu":
        raise ConfigError("a command after -- is checked only with --mode criu: hpcckpt doctor --mode criu -- CMD")
    if cmd:
        import tempfile

        from hpcckpt.criu.doctor import trial

        with tempfile.TemporaryDirectory(prefix="hpcckpt-doctor-") as tmp:
            results += trial(cmd, wait_s=args.trial_s, run_dir=Path(tmp))
    lines = []
    for c in results:
        lines.append(f"[{_MARK.get(c.severity, c.severity)}] {c.name}: {c.detail}")
        if c.fix and c.severity in {"warn", "fail"}:
            lines.append(f"       fix: {c.fix}")
    failed = [c for c in results if c.severity == "fail"]
    emit(args, {"ok": not failed, "checks": [c.as_dict() for c in results]}, "\n".join(lines))
    return 1 if failed else 0
