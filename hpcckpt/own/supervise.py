"""``hpcckpt run --mode own``: the supervisor around a script that keeps its own checkpoints.

The script saves and resumes itself (``--resume``, ``CheckpointSaver``,
``--resume_from_checkpoint``) and is not changed. hpcckpt does the part a script cannot do
well by itself:

- **one notice, at the lead**: the time-limit warning (``#SBATCH --signal=B:USR2@LEAD``,
  which reaches this supervisor only), a preemption seen on the end time (GraceTime), or the
  end time nearer than the lead: the script is told once, the way it listens (a signal it
  names, sent only to its processes that catch it, so a notice never kills it; or a file it
  polls, ``HPCCKPT_NOTICE_FILE``, which ``hpcckpt.own.should_stop()`` reads);
- **the scheduler's warning stays with the supervisor**: the script hears the notice, not
  the raw warning signal;
- **a requeue that happens**: when the command exits after a stop with 75 (or a status it
  declares, ``--requeue-on``), or is ended by the stop, the one lifecycle requeue routine
  puts the job back (a ``scancel`` still cancels); the next allocation runs the command
  again and it resumes from its own save;
- **honest records**: ``start``, ``stop`` (Slurm's cause, the notice's time, how long the
  command took to exit after it, the time since its last save) and ``requeue`` for every
  allocation, so ``hpcckpt history`` counts every interruption. Its last save is what it
  reports (``hpcckpt.own.saved(step, path)``) or the newest file matching ``--saves``;
  without either, the lost time is unknown, never 0.
"""
from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..cluster import detect
from ..errors import ConfigError
from ..exitcodes import EXIT_REQUEUE
from ..lifecycle import identity, requeue
from ..lifecycle.ledger import Ledger, process_start_time
from ..lifecycle.records import record_start, record_stop
from ..lifecycle.restart import RESTART_ENV, restart_loop
from ..lifecycle.supervise import SignalInbox, as_recorded
from ..lifecycle.timing import StopTiming
from ..proc import tree as proctree

MODE = "own"
NOTICE_FILE_ENV = "HPCCKPT_NOTICE_FILE"  # where the notice is written, for a script that polls
NOTICE_ENV = "HPCCKPT_NOTICE"  # how the notice comes: a signal's name, or "file PATH"
ENDING = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGXCPU)
WATCHED = (*ENDING, signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM, signal.SIGCONT)


@dataclass(frozen=True, kw_only=True)
class Notice:
    """How the script hears the notice: a signal it catches, or a file it polls."""

    signal: signal.Signals | None = None
    file: Path | None = None

    @classmethod
    def parse(cls, text: str, run_dir: Path) -> Notice:
        from ..config import parse_signal

        text = text.strip()
        if text.lower() == "file" or text.lower().startswith("file:"):
            path = text.partition(":")[2].strip()
            return cls(file=Path(path) if path else run_dir / "STOP-NOTICE")
        try:
            return cls(signal=parse_signal(text))
        except ConfigError:
            raise ConfigError(f"--notice {text!r}: a signal the script catches (USR1, USR2, TERM, INT) or "
                              "file[:PATH] (a file it polls; hpcckpt.own.should_stop() reads it), e.g. "
                              "--notice TERM") from None

    def describe(self) -> str:
        return self.signal.name if self.signal is not None else f"file {self.file}"


@dataclass(frozen=True, kw_only=True)
class OwnOptions:
    dir: Path
    cmd: tuple[str, ...]
    notice: Notice
    warning: tuple[signal.Signals, ...] = (signal.SIGUSR2,)  # the batch script's --signal=B:...
    lead_s: float = 180.0
    requeue_on: frozenset[int] = frozenset({EXIT_REQUEUE})
    end_poll_s: float = 10.0
    saves: str | None = None  # a glob of the script's checkpoint files (its last save, for the records)

    def __post_init__(self) -> None:
        if not self.cmd:
            raise ConfigError("hpcckpt run --mode own: no command given; e.g. hpcckpt run --mode own --dir DIR "
                              "--notice TERM -- python train.py --resume")


@dataclass
class _Stop:
    cause: str
    signame: str | None
    at: float  # when the supervisor decided the stop (epoch s)
    notice_at: float | None = None


class OwnSupervisor:
    def __init__(self, opts: OwnOptions, *, log: Callable[[str], None] | None = None) -> None:
        self.opts = opts
        self.dir = Path(opts.dir).resolve()
        self.ledger = Ledger(self.dir)
        self.log = log or (lambda msg: print(f"hpcckpt run: {msg}", file=sys.stderr, flush=True))
        self.inbox = SignalInbox()
        self._stop: _Stop | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._started_at = time.time()
        # The end time and the lead (--lead-s, at most a quarter of this allocation), as every
        # supervisor reads them; the notice's own rules are below (_duties, _on_signal).
        self.timing = StopTiming(lead_s=opts.lead_s, need_s=lambda: 0.0, log=self.log, ledger=self.ledger,
                                 what="notice", source="own-supervisor", progress=lambda: 0.0)

    # -- the run ----------------------------------------------------------------------------
    def run(self) -> int:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.inbox.install(WATCHED, "hpcckpt run")
        env = dict(os.environ)
        env.setdefault("HPCCKPT_DIR", str(self.dir))  # hpcckpt.own.saved() records there
        env[NOTICE_ENV] = self.opts.notice.describe()  # hpcckpt.own.should_stop() listens for it
        if self.opts.notice.file is not None:
            self.opts.notice.file.unlink(missing_ok=True)  # a notice belongs to one allocation
            env[NOTICE_FILE_ENV] = str(self.opts.notice.file)
        self._start_record()
        self._proc = subprocess.Popen(list(self.opts.cmd), env=env)
        self.log(f"started {' '.join(self.opts.cmd)!r} (PID {self._proc.pid}); it keeps its own checkpoints and "
                 f"hears the stop as {self.opts.notice.describe()}")
        self.timing.watch_end(detect(), self.opts.end_poll_s)
        while True:
            code = self._proc.poll()
            if code is not None:
                status = self._exited(code)
                self.inbox.quiet()  # decided: a signal now must not kill the batch shell
                return status
            while self.inbox.pending:
                self._on_signal(self.inbox.pending.pop(0))
            self._duties()
            self.inbox.sleep(1.0)

    def _duties(self) -> None:
        """The end time: pulled in (a preemption's grace), or nearer than the lead."""
        watch = self.timing.watch
        if watch is None or self._stop is not None:
            return
        if watch.moved():
            self._notify("preemption", None, f"the job's end time was pulled in ({self._left()} left)")
            return
        left = watch.remaining_s()
        if left is not None and left <= self._lead_s(left):
            self._notify("time_limit", None, f"{left:.0f} s before the end time (the lead is {self._lead_s(left):.0f} s)")

    def _lead_s(self, left: float) -> float:
        """``--lead-s``, at most a quarter of this allocation (``--time-min`` may grant less than
        the lead): the templates' rule, so a short allocation still trains."""
        return self.timing.lead_s(left)

    def _refreshed_left(self) -> float | None:
        watch = self.timing.watch
        if watch is None:
            return None
        if watch.refresh():
            self._notify("preemption", None, f"the job's end time was pulled in ({self._left()} left)")
        return watch.remaining_s()

    def _left(self) -> str:
        left = self.timing.remaining_s()
        return f"{left:.0f} s" if left is not None else "an unknown time"

    def _on_signal(self, sig: signal.Signals) -> None:
        if sig in self.opts.warning:
            left = self._refreshed_left()
            if left is not None and left > self._lead_s(left) + 1.0 and self._stop is None:
                # slurmctld's coarse tick sends --signal up to a minute early: the notice keeps the lead
                self.log(f"received {sig.name} {left:.0f} s before the end: the notice goes {self._lead_s(left):.0f} s "
                         "before it; a preemption or TERM still notifies at once")
                self.ledger.append("signal", signum=int(sig), signame=sig.name, step=None, source="own-supervisor",
                                   cause="time_limit", deferred_s=round(left - self._lead_s(left), 3))
                return
            self._notify("time_limit", sig, f"received {sig.name} (the scheduler's warning)")
        elif sig in ENDING:
            # Under Slurm this TERM reached the command as well; a script listening for another
            # notice still gets it, so that it saves in what time is left.
            self._notify("signal", sig, f"received {sig.name}")
        elif sig == signal.SIGCONT:
            pass  # Slurm sends it before TERM; nothing to do
        else:
            self.log(f"forwarding {sig.name} to the command")
            self._send(sig)

    def _notify(self, cause: str, sig: signal.Signals | None, why: str) -> None:
        if self._stop is not None:
            return  # one notice an allocation
        self._stop = _Stop(cause=cause, signame=sig.name if sig else None, at=time.time())
        notice = self.opts.notice
        if notice.file is not None:
            tmp = notice.file.with_name(f".{notice.file.name}.tmp")
            tmp.write_text(f"{cause} {time.time():.3f}\n")
            os.replace(tmp, notice.file)
            told = f"wrote {notice.file}"
        else:
            assert notice.signal is not None
            told = self._send(notice.signal)
        self._stop.notice_at = time.time()
        then = ("it saves and exits, 75 for a requeue" if "not sent" not in told else
                "it trains on until the scheduler ends it, then comes back from its own last save")
        self.log(f"{why}: notice to the command ({told}); {then}")
        self.ledger.append("signal", signum=int(sig) if sig else None, signame=sig.name if sig else None, step=None,
                           source="own-supervisor", cause=cause, notice=notice.describe(), detail=why,
                           signal_time=self._stop.at)

    def _send(self, sig: signal.Signals) -> str:
        """``sig`` to the command's processes that catch it (a process without a handler would
        die of it): its root if it does, else those below it that do."""
        assert self._proc is not None
        root = self._proc.pid
        targets = [root] if proctree.catches(root, sig) else [p for p in proctree.tree(root)[1:]
                                                               if proctree.catches(p, sig)]
        for pid in targets:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        if not targets:
            self.log(f"NO NOTICE DELIVERED: no process of the command catches {sig.name}, and it would end it "
                     "now; it trains on until the scheduler ends it and comes back from its own last save. Give "
                     f"the script a {sig.name} handler (or --notice with the signal it listens for) to save first")
            return f"{sig.name}: no process catches it, not sent"
        return f"{sig.name} to PID {', '.join(map(str, targets))}"

    # -- the end ------------------------------------------------------------------------------
    def _exited(self, code: int) -> int:
        code = code if code >= 0 else 128 - code  # killed by a signal: as a shell says it
        stop = self._stop
        if stop is None and code in self.opts.requeue_on:
            stop = _Stop(cause="signal", signame=None, at=time.time())  # it asked for a requeue by itself
        if stop is None:
            self.log(f"the command exited with status {code}")
            self._stop_record("done" if code == 0 else "error", code, None)
            return code
        if code == 0:
            self.log("the command finished (status 0) after the notice: the run is done")
            self._stop_record("done", code, stop)
            return 0
        cause = as_recorded(stop.cause, log=self.log)
        how = ("exited 75: its own save is what the next allocation resumes from" if code in self.opts.requeue_on
               else f"ended with status {code} after the stop: it resumes from its last own save")
        self.log(f"the command {how}; requeueing")
        self._stop_record(cause, code, stop)
        outcome = requeue(cluster=detect(), state_dir=self.dir, cause=cause, committed_step=None,
                          ledger=self.ledger, source=MODE, note=f"the command {how}",
                          within_s=self.timing.remaining_s())
        if outcome.exit_code is not None:
            return int(outcome.exit_code)
        return 0 if outcome.requeued else (code if code not in self.opts.requeue_on else 1)

    def _last_save(self) -> tuple[float | None, Any]:
        """When the script last saved (and what), from its own report or its files; (None, None)."""
        when, what = None, None
        for ev in self.ledger.events():
            if ev.get("event") == "saved" and isinstance(ev.get("time"), (int, float)):
                when, what = float(ev["time"]), ev.get("step")
        if self.opts.saves:
            pattern = self.opts.saves if os.path.isabs(self.opts.saves) else str(Path.cwd() / self.opts.saves)
            for path in glob.glob(pattern):
                try:
                    st = os.stat(path)
                except OSError:
                    continue
                # ctime: when the file became what it is (a save written aside and renamed into
                # place changes it at the rename, its commit), not when its bytes were written
                done = max(st.st_mtime, st.st_ctime)
                if when is None or done > when:
                    when, what = done, os.path.basename(path)
        return when, what

    def _start_record(self) -> None:
        prev = None
        for ev in self.ledger.events():
            if ev.get("event") == "stop" and ev.get("mode") == MODE:
                prev = ev
            elif ev.get("event") == "start":
                prev = None
        lost: dict[str, Any] = {}
        if prev is not None and prev.get("reason") not in ("done", "error"):
            lost_s = prev.get("lost_s")
            lost = {"lost_s": lost_s, "lost_exact": lost_s is not None}
        record_start(self.ledger, mode=MODE, resumed_from=None, notice=self.opts.notice.describe(),
                     process_start=process_start_time(), **lost)

    def _stop_record(self, reason: str, code: int, stop: _Stop | None) -> None:
        now = time.time()
        saved_at, saved = self._last_save()
        fields: dict[str, Any] = {"exit_code": code, "progress_s": round(now - self._started_at, 3)}
        if stop is not None:
            fields.update(signame=stop.signame, signal_time=stop.at, notice_time=stop.notice_at,
                          exit_after_notice_s=round(now - stop.notice_at, 3) if stop.notice_at else None)
        if reason != "done":
            # what the next allocation trains again: from the script's last save to this end
            fields.update(last_save_time=saved_at, last_save=saved,
                          lost_s=round(max(0.0, now - max(saved_at, self._started_at)), 3)
                          if saved_at is not None else None)
        record_stop(self.ledger, mode=MODE, reason=reason, step=None, **fields)


def run_own(opts: OwnOptions) -> int:
    """Supervise ``opts.cmd`` once (under Slurm); outside Slurm, restart it on each requeue as the
    local scheduler does (``_HPCCKPT_LOCAL_RESTART``), up to 10 times."""
    if identity.current().in_slurm:
        return OwnSupervisor(opts).run()

    def run_once(restart: int) -> int:
        os.environ[RESTART_ENV] = str(restart)
        return OwnSupervisor(opts).run()

    return restart_loop(run_once, max_restarts=10, what=opts.cmd[0])
