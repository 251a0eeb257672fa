"""``hpcckpt run --mode app``: the command as it is, its signals passed on; outside Slurm,
restarted on each exit 75 (see the package's docstring)."""
from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..lifecycle import identity
from ..lifecycle.ledger import Ledger
from ..lifecycle.supervise import FORWARDED, SignalInbox, run_forwarding


@dataclass(frozen=True, kw_only=True)
class AppOptions:
    dir: Path
    cmd: tuple[str, ...]
    signals: str = "USR2,TERM"  # --signal: watched besides FORWARDED (under Slurm)
    max_restarts: int = 10  # outside Slurm: restarts on exit 75 before giving up

    def __post_init__(self) -> None:
        if not self.cmd:
            raise ConfigError("hpcckpt run: no command given; e.g. hpcckpt run --mode app --dir DIR -- python train.py")

    def watched(self) -> set[signal.Signals]:
        """The signals passed on: every catchable one (``FORWARDED``) and those of ``--signal``."""
        from ..config import parse_signals

        extra = parse_signals(self.signals, option="--signal")
        bad = [s.name for s in extra if s in (signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD)]
        if bad or not extra:
            raise ConfigError(f"--signal {','.join(bad) or '(empty)'} cannot be caught and passed on; use a "
                              "catchable signal such as USR2 (and `#SBATCH --signal=B:USR2@LEAD`)")
        return {*FORWARDED, *extra}


def run_app(opts: AppOptions) -> tuple[int, dict[str, Any]]:
    """Supervise ``opts.cmd``: its exit status, and the summary ``--json`` prints."""
    if identity.current().in_slurm:
        return _forward(opts)
    return restart_locally(opts)


def _log(msg: str) -> None:
    print(f"hpcckpt run: {msg}", file=sys.stderr, flush=True)


def _forward(opts: AppOptions) -> tuple[int, dict[str, Any]]:
    """Under Slurm: every signal passed on; the application saves and requeues itself."""
    watched = opts.watched()
    Path(opts.dir).mkdir(parents=True, exist_ok=True)
    inbox = SignalInbox()
    inbox.install(watched, "hpcckpt run")
    try:
        code = run_forwarding(opts.cmd, inbox, log=_log)
    finally:
        inbox.quiet()  # decided: a signal now must not kill the batch shell
    return code, {"exit_code": code, "action": "exited", "restored_from": None, "images": [], "detail": ""}


def restart_locally(opts: AppOptions) -> tuple[int, dict[str, Any]]:
    """Outside Slurm: the local supervisor restarts CMD on exit 75 (requeue).

    Each restart is counted (``_HPCCKPT_LOCAL_RESTART``, which the job's requeue budget reads)
    and said on stderr; it stops at ``--max-restarts``, or when the job's own requeue was
    refused (its budget: the ledger's last ``requeue`` says ``requeued: false``).
    """
    from ..lifecycle.restart import LocalSupervisor as Restarter

    run_dir = Path(opts.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.setdefault("HPCCKPT_DIR", str(run_dir))  # the job's checkpoints (and ledger), unless it has its own
    ledger = Ledger(Path(env["HPCCKPT_DIR"]))

    def refused() -> str | None:
        last = None
        for e in ledger.events():  # streamed: a ledger of any size in bounded memory
            if e.get("event") == "requeue":
                last = e
        return None if last is None or last.get("requeued", True) else str(last.get("detail") or "refused")

    sup = Restarter(list(opts.cmd), max_restarts=opts.max_restarts, env=env, should_restart=refused)
    sup.forward_signals()
    code = sup.run()
    return code, {"exit_code": code, "restarts": sup.restarts, "exit_codes": sup.exit_codes, "dir": str(run_dir)}
