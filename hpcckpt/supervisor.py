"""The local supervisor: the embedded default "scheduler" when there is no Slurm.

It runs a command, and when the command exits with ``EXIT_REQUEUE`` (75) it
restarts it, as Slurm would requeue the job: the restarted process finds the
committed checkpoint and resumes. ``_HPCCKPT_LOCAL_RESTART`` counts restarts the way
``SLURM_RESTART_COUNT`` does. Signals sent to the supervisor are forwarded.
"""
from __future__ import annotations

import logging
import os
import signal as _signal
import subprocess
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .config import internal_var
from .exitcodes import EXIT_REQUEUE
from .signals import unblock

log = logging.getLogger("hpcckpt.supervisor")

RESTART_ENV = internal_var("LOCAL_RESTART")  # the restart number, read by the local cluster's requeue budget


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
        while True:
            env = dict(os.environ if self.env is None else self.env)
            env[RESTART_ENV] = str(self.restarts)
            with self._lock:
                self.current = subprocess.Popen(list(self.cmd), env=env)
            while self._pending:  # signals that came while the command was being started
                self.current.send_signal(self._pending.pop(0))
            if self.on_start:
                self.on_start(self.current, self.restarts)
            code = self.current.wait()
            self.exit_codes.append(code)
            if code != EXIT_REQUEUE:
                return code
            if self.restarts >= self.max_restarts:
                log.error("hpcckpt: %s asked to be restarted %d times; giving up (raise max_restarts, "
                          "hpcckpt run --max-restarts)", self.cmd[0], self.restarts)
                return code
            refused = self.should_restart() if self.should_restart is not None else None
            if refused is not None:
                log.error("hpcckpt: %s exited 75 but its requeue was refused (%s); not restarting",
                          self.cmd[0], refused)
                return code
            self.restarts += 1
            log.warning("hpcckpt: exit status 75 (requeue): restarting %s, restart %d of at most %d",
                        self.cmd[0], self.restarts, self.max_restarts)

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
