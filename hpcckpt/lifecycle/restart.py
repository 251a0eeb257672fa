"""The local restart loop: the embedded default "scheduler" when there is no Slurm.

``restart_loop`` runs a run of the job, and when it ends with ``EXIT_REQUEUE`` (75) runs it
again, as Slurm would requeue the job: the restarted run finds the committed checkpoint and
resumes. ``_HPCCKPT_LOCAL_RESTART`` counts restarts the way ``SLURM_RESTART_COUNT`` does.
Every mode outside Slurm restarts through it: ``LocalSupervisor`` (a command: app mode, the
demo; signals sent to it are forwarded) and the own-checkpoints supervisor.
"""
from __future__ import annotations

import logging
import os
import signal as _signal
import subprocess
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..config import internal_var
from ..exitcodes import EXIT_REQUEUE
from ..signals import unblock

log = logging.getLogger("hpcckpt.restart")

RESTART_ENV = internal_var("LOCAL_RESTART")  # the restart number, read by the local cluster's requeue budget


def restart_loop(run_once: Callable[[int], int], *, max_restarts: int, what: str,
                 should_restart: Callable[[], str | None] | None = None) -> int:
    """``run_once(restart)`` (0, 1, ...) until it returns anything but 75, at most
    ``max_restarts`` restarts, and not after a 75 whose requeue was refused (``should_restart``
    says why not, else None). The last run's status."""
    restart = 0
    while True:
        code = run_once(restart)
        if code != EXIT_REQUEUE:
            return code
        if restart >= max_restarts:
            log.error("hpcckpt: %s asked to be restarted %d times; giving up (raise max_restarts, "
                      "hpcckpt run --max-restarts)", what, restart)
            return code
        refused = should_restart() if should_restart is not None else None
        if refused is not None:
            log.error("hpcckpt: %s exited 75 but its requeue was refused (%s); not restarting", what, refused)
            return code
        restart += 1
        log.warning("hpcckpt: exit status 75 (requeue): restarting %s, restart %d of at most %d",
                    what, restart, max_restarts)


@dataclass
class LocalSupervisor:
    cmd: Sequence[str]
    max_restarts: int = 10
    env: dict[str, str] | None = None
    on_start: Callable[[subprocess.Popen[bytes], int], None] | None = None
    # After an exit 75: why not to restart (the job's own requeue was refused), or None.
    should_restart: Callable[[], str | None] | None = None
    restarts: int = 0
    exit_codes: list[int] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _pending: list[int] = field(default_factory=list)
    current: subprocess.Popen[bytes] | None = None

    def run(self) -> int:
        """Run until the command exits with anything but 75 (or restarts run out)."""
        return restart_loop(self._run_once, max_restarts=self.max_restarts, what=self.cmd[0],
                            should_restart=self.should_restart)

    def _run_once(self, restart: int) -> int:
        self.restarts = restart
        env = dict(os.environ if self.env is None else self.env)
        env[RESTART_ENV] = str(restart)
        with self._lock:
            self.current = subprocess.Popen(list(self.cmd), env=env)
        while self._pending:  # signals that came while the command was being started
            self.current.send_signal(self._pending.pop(0))
        if self.on_start:
            self.on_start(self.current, restart)
        code = self.current.wait()
        self.exit_codes.append(code)
        return code

    def signal(self, signum: int) -> bool:
        """Send ``signum`` to the running command; False if none runs. A handler that runs
        while the command is being started (the lock held by the code it interrupted, on the
        same thread: waiting for it would hang for ever) leaves the signal for ``run`` to
        send once the command runs."""
        if not self._lock.acquire(blocking=False):
            self._pending.append(signum)
            return True
        try:
            proc = self.current
        finally:
            self._lock.release()
        if proc is None or proc.poll() is not None:
            return False
        proc.send_signal(signum)
        return True

    def forward_signals(self, signums: Sequence[int] = (_signal.SIGUSR1, _signal.SIGUSR2, _signal.SIGTERM)) -> None:
        for s in signums:
            _signal.signal(s, lambda n, _f: self.signal(n))
        unblock(signums, "hpcckpt supervisor")  # the command inherits the mask: it must see them too
