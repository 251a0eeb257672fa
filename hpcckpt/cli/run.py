"""``hpcckpt run [--mode criu|own|app] --dir DIR [options] -- CMD ARGS``: supervise a job.

``--mode own`` (a script that keeps its own checkpoints): CMD runs unchanged; hpcckpt gives
it one notice at the lead before the deadline (the time-limit warning --signal, a preemption
seen on the end time, or the end nearer than --lead-s) the way it listens (--notice TERM,
USR1, USR2, or file[:PATH]), requeues the job when it exits 75 (--requeue-on) or is ended by
the stop, and records every allocation for `hpcckpt history`.

``--mode criu`` (transparent): CMD runs unchanged as PID 2 of its own PID + mount namespaces; on the
dump signal the whole process tree is dumped with CRIU (CUDA state first, through
the driver's checkpoint API), the image is committed under DIR/criu/, and the job
is requeued; the next run in DIR restores the newest image. ``--mode app``: CMD runs
as is and every signal is forwarded (the application checkpoints itself).
Outside Slurm, ``--mode app`` is the local supervisor: CMD is restarted each time it exits
with 75 (its final checkpoint is durable, "requeue me"), up to --max-restarts times.
Exit status: the job's own, 75 after a dump outside Slurm (or restarts exhausted),
1 when a restore failed with --on-restore-failure=fail.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ConfigError
from .common import add_json, directory, emit, positive_int, positive_seconds

if TYPE_CHECKING:
    from ..app import AppOptions
    from ..criu.supervisor import RunOptions
    from ..own.supervise import OwnOptions


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="run a command under an hpcckpt supervisor (CRIU, own-checkpoints or app mode)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("criu", "own", "app"), default="criu",
                   help="criu: dump the whole process tree; own: the script keeps its own checkpoints "
                        "(hpcckpt notices, requeues, records); app: forward every signal")
    p.add_argument("--notice", default="TERM", metavar="SIGNAL|file[:PATH]",
                   help="--mode own: how the script hears the stop: a signal it catches (default TERM), or a "
                        "file it polls (HPCCKPT_NOTICE_FILE; hpcckpt.own.should_stop() reads it)")
    p.add_argument("--requeue-on", default="75", metavar="CODES",
                   help="--mode own: exit statuses after a notice that mean 'requeue me' (default 75)")
    p.add_argument("--saves", default=None, metavar="GLOB",
                   help="--mode own: the script's checkpoint files (e.g. 'ckpt/*.pt'): the newest one's time is "
                        "its last save, from which `hpcckpt history` counts what a stop lost")
    p.add_argument("--dir", type=Path, required=True, help="run directory (images go to DIR/criu/)")
    p.add_argument("--signal", default="USR2,TERM",
                   help="signal(s) that trigger a dump, comma-separated (default USR2,TERM: match "
                        "`#SBATCH --signal=B:USR2@90`; TERM is what Slurm sends at a preemption's end and at the "
                        "time limit; the job itself ignores these; USR1 may be taken by NCCL)")
    p.add_argument("--dump-every", type=non_negative_seconds, default=0.0, metavar="SECONDS",
                   help="--mode criu: also take an image every SECONDS while the job runs (criu dump "
                        "--leave-running; later dumps write only dirtied pages), so a kill without warning loses "
                        "at most that much (default 0: images only at a stop)")
    p.add_argument("--end-poll-s", type=non_negative_seconds, default=None, metavar="SECONDS",
                   help="--mode criu under Slurm: read the job's end time this often; a preemption with GraceTime "
                        "pulls it in, and the job is dumped then (default HPCCKPT_POLL_S, else 10; 0: off)")
    p.add_argument("--lead-s", type=non_negative_seconds, default=None, metavar="SECONDS",
                   help="--mode criu: the LEAD of `#SBATCH --signal=B:USR2@LEAD`; a warning that slurmctld's coarse "
                        "tick delivers earlier waits until LEAD seconds before the end (default: dump at once)")
    p.add_argument("--keep", type=positive_int, default=2, help="images to keep (default 2)")
    p.add_argument("--on-restore-failure", choices=("app", "fresh", "fail"), default="app",
                   help="app: start CMD again, it resumes from its own checkpoint (default); "
                        "fresh: start CMD with _HPCCKPT_CRIU_FALLBACK=fresh; fail: exit 1")
    p.add_argument("--tcp-established", action="store_true",
                   help="dump/restore established TCP connections (same addresses needed at restore)")
    p.add_argument("--ext-unix-sk", action="store_true", help="allow unix sockets connected outside the job")
    p.add_argument("--cuda-lock-timeout-s", type=positive_seconds, default=60.0,
                   help="how long CUDA lock may wait for submitted GPU work (default 60)")
    p.add_argument("--criu", default=None, help="criu binary (default: HPCCKPT_CRIU, site criu >= 4, "
                                                "or the private install of scripts/install-criu)")
    p.add_argument("--max-restarts", type=positive_int, default=10,
                   help="--mode app outside Slurm: restarts on exit 75 before giving up (default 10)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ARGS")
    add_json(p)
    p.set_defaults(func=run)


def options_from_args(args: argparse.Namespace) -> RunOptions:
    from ..config import env_value, parse_signals
    from ..criu.ops import DumpOptions
    from ..criu.supervisor import RunOptions

    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    run_dir = directory(args.dir, option="--dir", must_exist=False)
    end_poll_s = args.end_poll_s if args.end_poll_s is not None else env_value("poll_s", 10.0)
    return RunOptions(dir=run_dir, cmd=tuple(cmd), mode=args.mode, dump_signals=parse_signals(args.signal, option="--signal"),
                      keep=args.keep, on_restore_failure=args.on_restore_failure,
                      dump=DumpOptions(tcp_established=args.tcp_established, ext_unix_sk=args.ext_unix_sk),
                      cuda_lock_timeout_ms=int(args.cuda_lock_timeout_s * 1000), criu_path=args.criu,
                      dump_every_s=args.dump_every, end_poll_s=end_poll_s, json_stdout=bool(args.json),
                      lead_s=args.lead_s)


def non_negative_seconds(text: str) -> float:
    """Seconds >= 0 (0 turns the feature off), e.g. 300."""
    import math

    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected seconds >= 0 (0: off), e.g. 300; got {text!r}")
    return value


def own_options(args: argparse.Namespace) -> OwnOptions:
    from ..config import env_value, parse_signals
    from ..own.supervise import Notice, OwnOptions

    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    run_dir = directory(args.dir, option="--dir", must_exist=False)
    try:
        codes = frozenset(int(c) for c in str(args.requeue_on).split(",") if c.strip())
    except ValueError:
        raise ConfigError(f"--requeue-on {args.requeue_on!r}: exit statuses, comma-separated, e.g. 75 or 75,3") from None
    warning = tuple(s for s in parse_signals(args.signal, option="--signal") if s.name not in ("SIGTERM", "SIGINT"))
    return OwnOptions(dir=run_dir, cmd=tuple(cmd), notice=Notice.parse(args.notice, run_dir), warning=warning,
                      lead_s=args.lead_s if args.lead_s is not None else 180.0, requeue_on=codes,
                      end_poll_s=args.end_poll_s if args.end_poll_s is not None else env_value("poll_s", 10.0),
                      saves=args.saves)


def app_options(args: argparse.Namespace) -> AppOptions:
    from ..app import AppOptions

    cmd = [c for c in args.cmd[1 if args.cmd[:1] == ["--"] else 0:]]
    if not cmd:
        raise ConfigError("hpcckpt run: no command given; e.g. hpcckpt run --mode app --dir DIR -- python train.py")
    run_dir = directory(args.dir, option="--dir", must_exist=False)
    return AppOptions(dir=run_dir, cmd=tuple(cmd), signals=args.signal, max_restarts=args.max_restarts)


def run(args: argparse.Namespace) -> int:
    if args.mode == "own":
        from ..own.supervise import run_own

        return run_own(own_options(args))
    if args.mode == "app":
        from ..app import run_app

        code, summary = run_app(app_options(args))
        if args.json:
            emit(args, summary, "")
        return code
    from ..criu.supervisor import Supervisor

    outcome = Supervisor(options_from_args(args)).run()
    if args.json:
        emit(args, outcome.as_dict(), "")
    return outcome.exit_code
