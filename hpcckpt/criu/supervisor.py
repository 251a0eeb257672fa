"""``hpcckpt run``: the supervisor a batch script runs instead of the bare command.

Namespaces (``--mode criu``), and why. libcuda builds /proc paths from its own
getpid()/gettid(), so a job in a new PID namespace needs a /proc of that namespace,
hence its own mount namespace too; but criu serialises every mount of a mount
namespace it dumps, and real GPU nodes have mounts it refuses (squashfs driver
mounts, Lustre, GPFS, NFS, autofs). CRIU's criu-ns shape solves both:
  * the job runs as PID 2 under nsinit (PID 1) in fresh PID + mount namespaces with
    a fresh /proc (``unshare --pid --fork --mount-proc``; fds above 2 closed first);
  * CUDA lock + checkpoint act on the job's host PIDs, only for processes that have
    a CUDA context (see hpcckpt.cuda.group); the manifest records the GPUs those
    processes use (hpcckpt.cuda.gpumap), not every GPU of the node;
  * ``criu dump -t 2`` runs from INSIDE the job's PID + mount namespaces (nsjoin.py):
    neither is serialised, files reopen by path on the next node;
  * ``criu restore`` runs inside fresh PID + mount namespaces under a new nsinit,
    which sets the PID counter above the image's PIDs; the restored PID 2 cannot
    clash with anything on the node; CUDA restore + unlock act on its host PID,
    onto the same GPUs or, by UUID pairs (identical UUIDs kept, the rest paired in
    index order with free GPUs of the same model), onto others (driver >= 580).
After a restore the job looks exactly like a fresh start, so every later dump takes
the same path. Parent, signals, waiting: the job's parent is always nsinit (criu runs
``--restore-detached`` under it and the orphaned PID 2 is re-parented to it); signals
go from the supervisor to nsinit, which forwards them to PID 2; the supervisor waits
for ``unshare`` (its own child), whose exit status is nsinit's, which is the job's,
only through unshare's Popen (never waitpid(-1): a status taken elsewhere is lost).
A restored job that exits before it is seen is not started again: unshare's status is
its exit; one that cannot be watched has its namespace ended before any fallback.

Call sequence:
  start:  newest committed image under DIR/criu? -> verify every file -> GPUs here fit?
          -> criu restore -> CUDA restore + unlock -> wait. No image, or restore
          fails -> fallback: start CMD fresh (``app``: the application resumes from its
          own checkpoint; ``fresh``: it is told to ignore it via
          HPCCKPT_CRIU_FALLBACK=fresh), or exit (``fail``).
  signal: a dump signal -> CUDA lock + checkpoint -> criu dump into a Transaction ->
          commit (checksummed, fsync, rename, LATEST) -> retention -> requeue and exit.
          Any other catchable signal is forwarded to the job. The job starts with the dump
          signals ignored (USR2, TERM by default): Slurm sends TERM to every process of the
          job at a preemption's end and at the time limit, and only we may act on it. Under
          Slurm the end time is read every --end-poll-s: pulled in to near now (a GraceTime
          preemption, which sends no signal at its start) it is a dump at once, pulled in
          further (a shortened limit) it only re-plans the dump; a time-limit warning the
          coarse tick delivered early (or --time-min's short allocation at its start) waits
          until the lead before the end (policy.bounded_lead_s).
  between: soon after the start, what criu would refuse (io_uring, perf events, TCP) is
          said once (stderr, ledger criu_check); with --dump-every, periodic images while
          the job runs on (chained by --track-mem where the kernel tracks dirty pages).
  failed dump: the job keeps running (criu resumes it, CUDA is unlocked). The trigger
          signal is forwarded only to the job's processes that catch it (SigCgt): a job
          that does not would be killed by it and lose everything since its last save.
          The failure is reported on stderr and in the ledger (``hpcckpt history``)
          with the reason and what to change. No requeue from an older image: the
          running job is ahead of it, and that image stays the one a later run restores.
          Any failure after the CUDA checkpoint (criu, the image directory, fork, a log
          file) gives every CUDA process its GPU back; one that cannot be is named and the
          job is said to be stuck.
  job ended during the dump: it exited by itself (a normal exit, status < 128, with no
          TERM/INT/HUP/XCPU pending here) while the CUDA lock or criu was under way, so the
          dump failed for want of a process: that is its natural end. Its status is ours,
          no requeue, no image marked stale. A job killed by a signal (143: the scheduler's
          TERM at the time limit or preemption; 137: criu's or anyone's SIGKILL), or one that
          exited while a TERM/INT/HUP/XCPU is pending here, did not end naturally: it is
          handled as below (images STALE, requeue, fallback).
  dump ended the job, no image: criu killed the tree but the image could not be
          committed (or criu reported failure after killing it, e.g. a timeout), or the
          job was killed from outside while it was being dumped: the
          existing images are marked STALE (the job had run past them; restoring one
          would rewind), and the job is requeued; the next run falls back per
          ``--on-restore-failure``. An image renamed into place whose LATEST update
          failed is complete: the newest image is chosen by sequence, not by LATEST.
  exit:   the job's exit status becomes ours; the newest image is marked consumed so a
          later run in the same DIR does not resurrect a finished job.
Signal handlers only record; all work happens in the main loop.

Limits. ``criu restore --restore-detached`` lets the restored job run before its CUDA
state is back: from criu's exit until CUDA restore + unlock (seconds), it runs CPU code
only, and its CUDA calls block (it is still locked) until the unlock, which is harmless.
Code that touches UVM/managed memory (cudaMallocManaged) from the CPU in that window
would fault and crash; such jobs (UVM is not supported by the CUDA checkpoint API
anyway), like NCCL and CUDA IPC users, are not CRIU-mode jobs: use --mode app.
A CUDA process that is stopped or traced (SIGSTOP, a debugger, scontrol suspend) is
refused by the CUDA steps, since the driver works through the process's own restore
thread (a traced one, e.g. by a criu that was just killed on its timeout, gets ~10 s for
the tracer to let go); a lock/checkpoint/restore/unlock that does not return in time is
reported as STUCK, and calls for the job's other processes still go on, so those already
locked are given back. Should the stuck call return later, the main loop says so and
gives that process its GPU back too. A state query that does not answer (30 s) changed
nothing: the dump fails with the job running.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..cluster import detect
from ..errors import CheckpointCorrupt, CriuError, CudaCheckpointError, HpcckptError, NoCheckpoint
from ..exitcodes import EXIT_REQUEUE
from ..lifecycle import identity, requeue
from ..lifecycle.history import OPENERS
from ..lifecycle.ledger import Ledger, process_start_time
from ..lifecycle.supervise import EndTimeWatch, SignalInbox, as_recorded, end_poll_s
from ..lifecycle.timing import bounded_lead_s, warning_wait_s
from ..proc import tree as proctree
from ..store.commit import Transaction, atomic_write
from ..store.lock import writer_lock
from ..store.manifest import build_image
from . import images, ops
from .locate import Criu, find_criu
from .watch import Progress, Tee

MODES = ("criu", "app")
FALLBACKS = ("app", "fresh", "fail")
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2,
             signal.SIGQUIT, signal.SIGALRM, signal.SIGXCPU, signal.SIGCONT)
# Signals that end a run from outside (the scheduler's time limit, preemption, scancel, a
# hang-up): a job that ends while one is pending has not reached its natural end. Not the
# signals that trigger a dump (RunOptions.dump_signals), nor config.STOP_SIGNALS.
ENDING_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGXCPU)
CONSUMED = "CONSUMED"
OWN_SAVE = "OWN-SAVE"  # the image named in it is behind the job's own save (it exited 75 after it)
# When the dumpability check runs (seconds after the job starts or is restored): early,
# and again once a launcher such as torchrun has started its workers.
CHECK_AT_S = (5.0, 45.0)
SIGNAL_TICK_S = 60.0  # slurmctld sends --signal up to this much earlier than asked
DUMP_MARGIN_S = 15.0  # a deferred time-limit dump starts at least this long before the end
MAX_CHAIN = 8  # images in a --track-mem chain (each holding only what the one before lacks)
STALE = images.STALE
NS_LAYOUT = 2  # images of the job tree at PID 2, dumped from inside its namespaces


class _CommitFailed(CriuError):
    """criu dumped (and so ended) the job, but the image could not be committed."""


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    dir: Path
    cmd: tuple[str, ...]
    mode: str = "criu"
    dump_signals: tuple[signal.Signals, ...] = (signal.SIGUSR2, signal.SIGTERM)
    keep: int = 2
    dump_every_s: float = 0.0  # periodic images (criu dump --leave-running); 0: only at a stop
    end_poll_s: float = 10.0  # under Slurm: how often the end time is read (a preemption pulls it in)
    lead_s: float | None = None  # the --signal lead of the batch script (an early warning waits for it)
    on_restore_failure: str = "app"
    dump: ops.DumpOptions = field(default_factory=ops.DumpOptions)
    cuda_lock_timeout_ms: int = 60_000
    criu_path: str | None = None
    json_stdout: bool = False  # our stdout carries --json: the job's stdout is copied to stderr

    def __post_init__(self) -> None:
        from ..errors import ConfigError

        if self.mode not in MODES:
            raise ConfigError(f"unknown --mode {self.mode!r}; valid: {', '.join(MODES)}")
        if self.on_restore_failure not in FALLBACKS:
            raise ConfigError(f"unknown --on-restore-failure {self.on_restore_failure!r}; "
                              f"valid: {', '.join(FALLBACKS)}")
        bad = [s.name for s in self.dump_signals if s in (signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD)]
        if bad or not self.dump_signals:
            raise ConfigError(f"--signal {','.join(bad) or '(empty)'} cannot trigger a dump; use a catchable "
                              "signal such as USR2 (and `#SBATCH --signal=B:USR2@LEAD`)")
        if self.keep < 1:
            raise ConfigError(f"--keep must be >= 1 (got {self.keep})")
        if not self.cmd:
            raise ConfigError("no command given: use `hpcckpt run [options] -- CMD ARGS`")


@dataclass(kw_only=True)
class CriuOutcome:
    exit_code: int
    action: str  # "exited" | "requeue" | "restore-failed"
    restored_from: str | None = None
    images: list[str] = field(default_factory=list)
    detail: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"exit_code": self.exit_code, "action": self.action, "restored_from": self.restored_from,
                "images": self.images, "detail": self.detail}


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def exit_code_of(status: int) -> int:
    return 128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def multi_node_refusal(nodes: int) -> str:
    """Why CRIU mode does not take a job on several nodes (the one message of the template, the
    supervisor and doctor)."""
    return (f"this job has {nodes} nodes, and CRIU mode dumps the process tree of one node: the other nodes' "
            "ranks run under slurmstepd outside it, so no image holds the job. For several nodes use the "
            "in-process templates (hpcckpt template ddp, or torchrun) with hpcckpt's Checkpointer")


def _incarnation() -> str:
    me = identity.current()
    return f"{me.job_id or 'local'}-r{me.restart_count}-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"


class Supervisor:
    def __init__(self, opts: RunOptions, *, log: Callable[[str], None] | None = None,
                 cuda_driver: Callable[[], Any] | None = None) -> None:
        self.opts = opts
        self._cuda_driver = cuda_driver  # the CudaCheckpoint factory (a seam for fault tests)
        self.dir = Path(opts.dir).resolve()
        self.root = images.criu_root(self.dir)
        self.ledger = Ledger(self.dir)
        self.log = log or (lambda msg: print(f"hpcckpt run: {msg}", file=sys.stderr, flush=True))
        self.inbox = SignalInbox()
        self.pending = self.inbox.pending  # the signals recorded, in order
        self._criu: Criu | None = None
        self.outcome = CriuOutcome(exit_code=1, action="exited")
        self.tag = _incarnation()
        self.acct = Progress()
        self._tee: Tee | None = None
        self._checks_at = list(CHECK_AT_S)
        self._watch: EndTimeWatch | None = None
        self._parent: str | None = None  # this run's last image, dumped with --track-mem
        self._last_dump = time.monotonic()
        self._dumped_at_s = 0.0
        self._track_mem: bool | None = None
        self._dump_at: float | None = None  # a deferred time-limit dump (monotonic)
        self._shortened = False  # the end time was pulled in too far ahead for a preemption: a shorter limit
        self._began = time.time()  # about when this allocation started (the batch shell exec's us)
        self._heard: tuple[signal.Signals, str] | None = None  # a stop the job's own processes heard too

    # -- entry ------------------------------------------------------------------
    def run(self) -> CriuOutcome:
        try:
            outcome = self._run()
        finally:
            self._close_tee()
            self.inbox.quiet()  # decided: a signal now must not kill the batch shell
        driver = sys.modules.get("hpcckpt.cuda.driver")
        if driver is not None:  # should a driver call still be blocked at exit: leave with this status
            driver.set_exit_status(outcome.exit_code)
        return outcome

    def _run(self) -> CriuOutcome:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.inbox.install({*FORWARDED, *self.opts.dump_signals}, "hpcckpt run")
        nodes = detect().env.num_nodes if self.opts.mode == "criu" else 1
        if nodes > 1:
            why = multi_node_refusal(nodes)
            self.log(f"NOT IN CRIU MODE: {why}; the command runs on untouched, with no image and no requeue")
            self.ledger.append("criu_refused", reason=why, nodes=nodes)
        if self.opts.mode == "app" or nodes > 1:
            proc = subprocess.Popen(list(self.opts.cmd))
            job = ops.Job(init_pid=proc.pid, app_pid=proc.pid, wait_pid=proc.pid, stdout=Path("/dev/stdout"),
                          stderr=Path("/dev/stderr"), proc=proc)
            self.outcome.exit_code = self._loop(job, dumps=False)
            return self.outcome
        try:
            restored = self._restore_or_start()
        except ops.JobExited as done:  # a job that ends at once is over, never started again
            self.log(str(done))
            self.outcome.exit_code = self._job_exited(done.code, dumped=False)
            return self.outcome
        if restored is None:
            return self.outcome
        self.outcome.exit_code = self._loop(restored, dumps=True)
        return self.outcome

    # -- main loop --------------------------------------------------------------
    def _reap(self, job: ops.Job) -> int | None:
        # Only through the job's own Popen: a waitpid(-1) here, or a dropped Popen that a
        # later subprocess call reaps, would take the status and leave nothing true to report.
        return job.poll()

    def _loop(self, job: ops.Job, *, dumps: bool) -> int:
        while True:
            if dumps:
                self._resume_late()
            code = self._reap(job)
            if code is not None:
                return self._job_exited(code, dumped=False)
            if dumps:
                result = self._duties(job)
                if result is not None:
                    return result
            while self.pending:
                sig = self.pending.pop(0)
                if dumps and sig in self.opts.dump_signals:
                    result = self._on_dump_signal(job, sig)
                    if result is not None:
                        return result
                else:
                    self.log(f"forwarding {sig.name} to the job (PID {job.init_pid})")
                    ops.kill_tree(job, sig)
            self.inbox.sleep(1.0)

    def _job_exited(self, code: int, *, dumped: bool) -> int:
        self.log(f"job exited with status {code}")
        self.outcome.action = "exited"
        if self.opts.mode != "criu" or dumped:
            return code
        if code == EXIT_REQUEUE:
            return self._own_save_requeue()
        if self._heard is not None and code != 0:
            sig, cause = self._heard
            cause = as_recorded(cause, log=self.log)
            self.log(f"the job ended (status {code}) of the {sig.name} it heard, with no image of that end: "
                     "requeueing; the next run restores the newest committed image (what ran since it is lost)")
            self._stop_record(cause, image=None, exit_code=code, signame=sig.name, heard=True)
            self._close_tee()
            return self._requeue(None, cause, what=f"after the job ended of the {sig.name} it heard (status {code})")
        if self._killed_from_outside(code):
            self.log(f"the job was killed from outside (status {code}) without a dump: not its natural end; the "
                     "newest image stays the one the next run restores (what it did since is lost)")
            self._stop_record("killed", exit_code=code)
            return code
        self._stop_record("done" if code == 0 else "error", exit_code=code)
        self._mark_consumed()
        return code

    def _own_save_requeue(self) -> int:
        """Exit 75: the job saved itself and asks for a requeue, as in every mode. No image of the
        exit is made or restored: the next run starts the command afresh and it resumes from its
        own save."""
        sig, cause = self._heard if self._heard is not None else (None, self._exit_cause())
        cause = as_recorded(cause, log=self.log)
        self.log(f"the job exited 75 (its own save: requeue me){f' after {sig.name}' if sig else ''}: requeueing; "
                 "the next run starts the command afresh and it resumes from its own checkpoint")
        self._mark_consumed(OWN_SAVE)
        self._stop_record(cause, image=None, exit_code=EXIT_REQUEUE, own_save=True,
                          signame=sig.name if sig else None)
        self._close_tee()
        return self._requeue(None, cause, what="after the job's own save (exit 75)")

    def _exit_cause(self) -> str:
        """Why a job that exited 75 by itself stopped: the signal it was sent, else its own choice."""
        pending = self._ending_signals()
        return self._stop_cause(pending[0]) if pending else "signal"

    def _killed_from_outside(self, code: int) -> bool:
        return code > 128 and (code - 128 in (signal.SIGKILL, *ENDING_SIGNALS) or self._told_to_stop())

    def _stop_record(self, reason: str, *, progress_s: float | None = None, **fields: Any) -> None:
        """One ``stop`` per run: why it ended and how far the job had got (seconds of running)."""
        self.ledger.append("stop", reason=reason, mode="criu", step=None,
                           progress_s=self.acct.now() if progress_s is None else progress_s, **fields)

    def _mark_consumed(self, marker: str = CONSUMED) -> None:
        """The newest image is not to be restored: its run finished (``CONSUMED``), or the job
        saved itself after it and exited 75 (``OWN_SAVE``)."""
        try:
            latest = images.newest(self.root)
        except NoCheckpoint:
            return
        atomic_write(self.root / marker, (latest.name + "\n").encode())

    def _consumed(self) -> str | None:
        return self._marker(CONSUMED)

    def _marker(self, name: str) -> str | None:
        try:
            return (self.root / name).read_text().strip() or None
        except FileNotFoundError:
            return None

    def _mark_stale(self) -> str | None:
        """The job ended in a dump that left no committed image: every image here is behind it."""
        try:
            latest = images.newest(self.root)
        except NoCheckpoint:
            return None
        atomic_write(self.root / STALE, (latest.name + "\n").encode())
        return latest.name

    def _stale(self, image: images.Image) -> bool:
        return images.stale(self.root, image)

    # -- start / restore ----------------------------------------------------------
    def _stdio_paths(self) -> tuple[Path, Path]:
        base = self.root / "stdio" / self.tag
        return base.with_suffix(".out"), base.with_suffix(".err")

    def cuda(self) -> Any:
        if self._cuda_driver is None:
            from ..cuda import CudaCheckpoint

            self._cuda_driver = CudaCheckpoint
        return self._cuda_driver()

    def criu(self) -> Criu:
        if self._criu is None:
            self._criu = find_criu(self.opts.criu_path)
        return self._criu

    def _start_fresh(self, fallback: str | None, *, no_image: str | None = None) -> ops.Job:
        """Start the command from the beginning; ``no_image``: why this start is a restart that
        had no image to restore (recorded on the ``start`` event for ``hpcckpt history``)."""
        out, err = self._stdio_paths()
        env = dict(os.environ)
        if fallback:
            env["HPCCKPT_CRIU_FALLBACK"] = fallback
        job = ops.launch(list(self.opts.cmd), stdout=out, stderr=err, env=env,
                         log=self.root / "logs" / f"unshare-{self.tag}.log", ignore=self._ignored())
        self.log(f"started {' '.join(self.opts.cmd)!r} in new PID + mount namespaces (host PID {job.app_pid}); "
                 f"stdout {out}, stderr {err}")
        self._started(job, progress_s=0.0)
        self.ledger.append("start", mode="criu", resumed_from=None, image=None, progress_s=0.0,
                           fallback=fallback, dump_every_s=self.opts.dump_every_s, no_image=no_image,
                           process_start=process_start_time(),
                           **Progress.lost_since(self.ledger.events(), 0.0))
        return job

    def _ignored(self) -> tuple[signal.Signals, ...]:
        """The dump signals, ignored by the job: Slurm's TERM reaches every process of the job,
        and only the supervisor may act on it (dump first, then the job ends)."""
        return tuple(s for s in self.opts.dump_signals if s not in (signal.SIGKILL, signal.SIGSTOP))

    def _started(self, job: ops.Job, *, progress_s: float) -> None:
        """The job runs (fresh or restored): count its progress, copy its output, watch its end."""
        self.acct.begin(progress_s)
        self._last_dump = time.monotonic()
        self._parent = None
        self._tee = Tee([(job.stdout, 2 if self.opts.json_stdout else 1), (job.stderr, 2)])
        self._tee.start()
        if self.opts.end_poll_s > 0:
            cluster = detect()
            if cluster.name != "local":  # a scheduler that can move the end time
                self._watch = EndTimeWatch(cluster.end_time, poll_s=end_poll_s(cluster, self.opts.end_poll_s, log=self.log,
                                                                           ledger=self.ledger))

    def _close_tee(self) -> None:
        if self._tee is not None:
            self._tee.close()

    def _restore_or_start(self) -> ops.Job | None:
        try:
            image = images.newest(self.root)
        except NoCheckpoint:
            restarted = self._restarted()
            if restarted:
                self.log(f"NO CRIU IMAGE to restore ({restarted}, but {self.root} holds none): the command starts "
                         "from the beginning")
            return self._start_fresh(None, no_image=restarted)
        if self._consumed() == image.name:
            self.log(f"{image.path} belongs to a run that already finished; starting the command from the "
                     "beginning")
            return self._start_fresh(None)
        if self._marker(OWN_SAVE) == image.name:
            self.log(f"the job saved itself and exited 75 after {image.name}: the command starts afresh and "
                     "resumes from its own checkpoint")
            return self._start_fresh(None, no_image="the job's own save (exit 75)")
        if self._stale(image):
            return self._restore_failed(image, CriuError(
                f"{image.name} is stale: a later dump ended the job but could not be committed, so the job "
                "had run past this image and restoring it would rewind its work"))
        try:
            return self._restore(image)
        except ops.RestoredJobExited as done:
            self.log(f"restored {image.name}; {done}")
            self.outcome.restored_from = image.name
            self.outcome.exit_code = self._job_exited(done.code, dumped=False)
            return None
        except (CheckpointCorrupt, CriuError, CudaCheckpointError, OSError) as exc:
            return self._restore_failed(image, exc)

    def _restarted(self) -> str | None:
        """Why this start is a restart (Slurm's or the local supervisor's restart count, or an
        earlier run in this directory that did not run to its end), None for a first start."""
        me = identity.current()
        if me.restart > 0:
            return f"job {me.job_id or '(local)'} was restarted, restart {me.restart}"
        last: dict[str, Any] | None = None  # the last run's opener, while that run has not finished
        for e in self.ledger.events():  # streamed: a ledger of any size in bounded memory
            if e.get("event") in OPENERS:
                last = e
            elif e.get("event") == "stop" and e.get("reason") in ("done", "error"):
                last = None
        if last is not None:
            job = last.get("job_id")
            return f"an earlier run{f' (job {job})' if job else ''} in this directory did not finish"
        return None

    def _restore_failed(self, image: images.Image, exc: Exception) -> ops.Job | None:
        fallback = self.opts.on_restore_failure
        self.log(f"cannot restore {image.path}: {exc}")
        self.ledger.append("criu_restore_failed", image=image.name, error=str(exc), fallback=fallback)
        if fallback == "fail":
            self.log("--on-restore-failure=fail: not starting the job")
            self.outcome.exit_code, self.outcome.action, self.outcome.detail = 1, "restore-failed", str(exc)
            return None
        self.log(f"NOT RESTORED: {image.name} cannot be used ({_first_line(exc)}); the command starts from the "
                 f"beginning (--on-restore-failure={fallback}; with `app` it resumes from its own checkpoint if it "
                 "writes one)")
        return self._start_fresh(fallback)

    def _restore(self, image: images.Image) -> ops.Job:
        t0 = time.monotonic()
        with writer_lock(self.root):
            manifest = images.verify(image)
            for older in images.chain(image)[1:]:  # the images it takes unchanged pages from
                images.verify(older)
            if manifest.get("ns_layout") != NS_LAYOUT:
                raise CriuError(f"{image.path} was dumped by an older hpcckpt (the job's namespace init inside "
                                "the image); this version restores only images it made itself")
            verify_s = time.monotonic() - t0
            pairs = self._gpu_plan(manifest)
            criu = self.criu()
            out, err = self._stdio_paths()
            logs = self.root / "logs"
            t1 = time.monotonic()
            job = ops.restore(criu, image.path, old_stdio=manifest.get("stdio", {}), new_stdout=out, new_stderr=err,
                              log=logs / f"restore-{self.tag}.log", work_dir=logs, opts=self.opts.dump,
                              last_pid=int(manifest["max_inner_id"]))
            criu_s = time.monotonic() - t1
            self._restore_cuda(job, manifest, pairs)
        restore_s = time.monotonic() - t0
        self.log(f"restored {image.name} in {restore_s:.2f} s (verify {verify_s:.2f} s, criu {criu_s:.2f} s) into "
                 f"fresh namespaces; job host PID {job.app_pid}; stdout now {out}")
        progress_s = float(manifest.get("progress_s") or 0.0)
        self.ledger.append("criu_restore", image=image.name, restore_s=restore_s, verify_s=verify_s,
                           criu_s=criu_s, bytes=image.bytes_total(), progress_s=progress_s,
                           dump_every_s=self.opts.dump_every_s, process_start=process_start_time(),
                           **Progress.lost_since(self.ledger.events(), progress_s))
        self.outcome.restored_from = image.name
        self._started(job, progress_s=progress_s)
        return job

    def _gpu_plan(self, manifest: dict[str, Any]) -> list[tuple[str, str]] | None:
        """Before criu runs: can this node's GPUs take the image's CUDA processes?"""
        if not manifest.get("cuda_pids"):
            return None
        from ..cuda.gpumap import plan

        cu = self.cuda()
        pairs = plan(manifest.get("gpus", []), cu.gpus(), can_remap=cu.can_remap)
        if pairs:
            self.log("GPUs differ from the dump's; restoring CUDA state by UUID pairs "
                     + ", ".join(f"{a} -> {b}" for a, b in pairs))
        return pairs

    def _restore_cuda(self, job: ops.Job, manifest: dict[str, Any], pairs: list[tuple[str, str]] | None) -> None:
        inner = set(manifest.get("cuda_pids") or [])
        if not inner:
            return
        from ..cuda import restore_all

        pids = [p for p in proctree.tree(job.app_pid) if proctree.inner_pid(p) in inner]
        try:
            if len(pids) != len(inner):
                raise CudaCheckpointError(f"restored tree lacks CUDA processes {sorted(inner)} (found {pids})")
            restore_all(self.cuda(), pids, pairs)
        except CudaCheckpointError:
            ops.kill_tree(job)
            self._wait_gone(job)
            raise
        self.log(f"CUDA state restored and unlocked for host PIDs {pids}")

    # -- dump -------------------------------------------------------------------------
    # -- between signals ------------------------------------------------------------
    def _duties(self, job: ops.Job) -> int | None:
        """The dumpability check, a preemption seen on the end time, periodic images."""
        self._check_dumpable(job)
        if self._watch is not None and self._watch.moved() and self._pulled_in_is_preemption():
            left = self._watch.remaining_s()
            self.log(f"the job's end time was pulled in ({left:.0f} s left): a preemption (GraceTime); dumping now")
            return self._on_dump_signal(job, signal.SIGTERM, cause="preemption", received=False)
        if self._dump_at is not None and time.monotonic() >= self._dump_at:
            self._dump_at = None
            if not self._end_moved_later():
                return self._on_dump_signal(job, signal.SIGUSR2, cause="time_limit", received=False)
        if self.opts.dump_every_s > 0 and time.monotonic() - self._last_dump >= self.opts.dump_every_s:
            self._periodic_dump(job)
        return None

    def _pulled_in_is_preemption(self) -> bool:
        """The end time was just pulled in. To within the window of a preemption's grace or the
        lead (``_near_s``): a preemption, dump at once. Further away it is a shortened limit (an
        operator's ``scontrol update TimeLimit``): no dump and no requeue now, the dump is
        re-planned for the lead before the new end."""
        assert self._watch is not None
        left = self._watch.remaining_s()
        self._shortened = left is not None and left > self._near_s()
        if not self._shortened or left is None:
            return True
        lead = self._lead_s(left)
        at = time.monotonic() + left - lead
        self._dump_at = at if self._dump_at is None else min(self._dump_at, at)
        self.log(f"the job's end time was pulled in to {left:.0f} s from now, further than a preemption's grace "
                 f"({self._near_s():.0f} s): a shortened time limit; the dump is planned {lead:.0f} s before the new "
                 f"end (in {left - lead:.0f} s), no dump or requeue now")
        self.ledger.append("end_time_moved", left_s=left, dump_in_s=left - lead, progress_s=self.acct.now())
        return False

    def _end_moved_later(self) -> bool:
        """At a planned time-limit dump: was the limit lengthened since it was planned? Then the
        dump is planned again for the lead before the new end."""
        if self._watch is None:
            return False
        self._watch.refresh()
        left = self._watch.remaining_s()
        lead = self._lead_s(left) if left is not None else 0.0
        if left is None or left - lead <= SIGNAL_TICK_S:
            return False
        self._dump_at = time.monotonic() + left - lead
        self.log(f"the job's end time is now {left:.0f} s away (its limit was lengthened): the dump is planned "
                 f"{lead:.0f} s before it (in {left - lead:.0f} s)")
        return True

    def _defer(self, sig: signal.Signals, cause: str, received: bool) -> bool:
        """A time-limit warning early (slurmctld's coarse tick delivers ``B:USR2@LEAD`` up to
        a minute before LEAD, ``--lead-s``; with ``--time-min`` Slurm may grant less time than
        LEAD and the warning comes at the start): dump at the end minus the lead
        (``policy.bounded_lead_s``: LEAD, at most a quarter of this allocation, at least three
        times the measured dump cost and 15 s), not now. TERM, preemptions, a signal from
        elsewhere (``scancel --signal``: more than LEAD + a minute before the end) and runs
        without ``--lead-s`` dump at once."""
        left = self._watch.remaining_s() if self._watch is not None else None
        if not received or cause != "time_limit" or sig == signal.SIGTERM or left is None or self.opts.lead_s is None:
            return False
        lead = self._lead_s(left)
        wait = warning_wait_s(left, lead, window_s=self._near_s())
        if wait is None:
            return False
        self._dump_at = time.monotonic() + wait
        short = (f" (this allocation has about {self._allocation_s(left):.0f} s: a quarter of it, not "
                 f"--lead-s {self.opts.lead_s:.0f})" if lead < self.opts.lead_s else "")
        self.log(f"received {sig.name}, {left:.0f} s before the time limit: the dump starts {lead:.0f} s before "
                 f"the end{short} (in {wait:.0f} s); TERM or a preemption still dumps at once")
        self.ledger.append("signal", signum=int(sig), signame=sig.name, step=None, source="criu-supervisor",
                           cause=cause, deferred_s=wait, progress_s=self.acct.now())
        return True

    def _allocation_s(self, left: float) -> float:
        """The time this allocation has in all: what has run since the supervisor started, and what is left."""
        return max(0.0, time.time() - self._began) + left

    def _lead_s(self, left: float) -> float:
        """How long before the end a time-limit dump starts (``policy.bounded_lead_s``)."""
        need = self._dump_margin_s()
        lead = self.opts.lead_s if self.opts.lead_s is not None else need
        return bounded_lead_s(lead, allocation_s=self._allocation_s(left), need_s=need)

    def _near_s(self) -> float:
        """How close to the end a warning is the time-limit one: --lead-s plus slurmctld's tick
        (10 minutes without --lead-s)."""
        return (self.opts.lead_s + SIGNAL_TICK_S) if self.opts.lead_s is not None else 600.0

    def _dump_margin_s(self) -> float:
        """Three times the slowest dump + commit this run directory has seen, and 15 s at least."""
        costs = (float(e.get("dump_s") or 0) + float(e.get("commit_s") or 0) for e in self.ledger.events()
                 if e.get("event") == "criu_dump")  # streamed: bounded memory
        return max(DUMP_MARGIN_S, 3 * max(costs, default=0.0))

    def _check_dumpable(self, job: ops.Job) -> None:
        if not self._checks_at or self.acct.run_s() < self._checks_at[0]:
            return
        self._checks_at.pop(0)
        from . import dumpable

        found = dumpable.problems(job.app_pid, tcp_allowed=self.opts.dump.tcp_established)
        if found:
            self._checks_at.clear()  # said once
            for line in dumpable.lines(found):
                self.log(line)
        elif self._checks_at:
            return
        self.ledger.append("criu_check", ok=not found, problems=[p.as_dict() for p in found],
                           fix=dumpable.fix(found) if found else "")

    def _periodic_dump(self, job: ops.Job) -> None:
        """An image while the job runs on (criu dump --leave-running): a kill without warning
        then loses at most one interval."""
        self._last_dump = time.monotonic()
        try:
            with writer_lock(self.root):
                self._dump(job, None)
        except (HpcckptError, OSError) as exc:
            ended = not self._job_alive(job)
            self.log(f"periodic CRIU dump failed: {exc}" + ("" if ended else "; the job runs on"))
            self.ledger.append("criu_dump_failed", error=str(exc), periodic=True, job_ended=ended,
                               progress_s=self.acct.now())

    def _stop_cause(self, sig: signal.Signals) -> str:
        """Why a dump signal came: an end time pulled in to near now is a preemption (one pulled in
        further, a shortened limit, is not); one near the end, the limit."""
        if self._watch is None:
            return "signal"
        if self._watch.refresh():
            self._pulled_in_is_preemption()
        if self._watch.pulled_in and not self._shortened:
            return "preemption"
        left = self._watch.remaining_s()
        return "time_limit" if left is not None and left <= self._near_s() else "signal"

    # -- dump -------------------------------------------------------------------------
    def _on_dump_signal(self, job: ops.Job, sig: signal.Signals, *, cause: str | None = None,
                        received: bool = True) -> int | None:
        cause = cause or self._stop_cause(sig)
        if self._defer(sig, cause, received):
            return None
        if received and self._heard is not None and sig in ENDING_SIGNALS:
            return None  # the job heard the stop already: its end decides
        heard = self._heard_by(job, sig) if received else []
        if heard:
            self._yield_to_job(sig, cause, heard)
            return None
        said = f"received {sig.name}" if received else f"{cause.replace('_', ' ')} notice"
        self.log(f"{said} ({cause}): dumping the job with criu")
        self.ledger.append("signal", signum=int(sig) if received else None, signame=sig.name if received else None,
                           step=None, source="criu-supervisor", cause=cause, progress_s=self.acct.now())
        try:
            with writer_lock(self.root):
                name = self._dump(job, sig, received=received)
        except _CommitFailed as exc:
            return self._job_lost(job, sig, str(exc), cause)
        except (HpcckptError, OSError) as exc:
            if not self._job_alive(job):
                # Gone: either it finished by itself while the dump was under way (the lock
                # or criu then fail for want of a process), or criu killed it (SIGKILL, at
                # the end of a dump it then reported failed, e.g. a timeout). Never say
                # "keeps running" of a job that is gone, and never signal it.
                code = self._gone_status(job)
                if code is not None and code < 128 and not self._told_to_stop():
                    return self._ended_during_dump(sig, exc, code)
                return self._job_lost(job, sig, f"{exc}; and the job is gone ({self._how_gone(code)})", cause)
            self._dump_failed(job, sig, exc)
            return None
        self._wait_gone(job)
        self.outcome.images.append(name)
        self._stop_record(cause, image=name, signame=sig.name if received else None, progress_s=self._dumped_at_s)
        self._close_tee()
        return self._requeue(name, cause)

    def _heard_by(self, job: ops.Job, sig: signal.Signals) -> list[str]:
        """The job's processes that heard ``sig`` as the supervisor did: under Slurm a stop's TERM
        reaches every process of the job at once, and one that does not ignore it (the job
        starts with it ignored) handles it (its own save, then an exit) or dies of it (a
        DataLoader worker): an image of it would be of a process that is ending."""
        if sig not in ENDING_SIGNALS or not identity.current().in_slurm:
            return []  # a warning, or a signal only the supervisor was sent (outside Slurm)
        heard = []
        for pid in proctree.tree(job.app_pid):
            how = proctree.disposition(pid, sig)
            if how in ("caught", "default"):
                heard.append(f"{proctree.inner_pid(pid) or pid} {how} ({proctree.command(pid, limit=60)})")
        return heard

    def _yield_to_job(self, sig: signal.Signals, cause: str, heard: list[str]) -> None:
        """The job heard the stop itself: no image of it now. Its end decides (``_job_exited``):
        exit 75 after its own save is a requeue that resumes from that save; another end of a
        stopped job is a requeue from the newest committed image; exit 0 is its natural end."""
        self._heard = (sig, cause)
        self.log(f"received {sig.name} ({cause}); the job's own processes heard it too (inner PID, what it does "
                 f"with {sig.name}: {'; '.join(heard)}): no image is made of a process handling or dying of it. "
                 "Waiting for the job's end: exit 75 (its own save) requeues and resumes from that save; any "
                 "other end of the stopped job requeues from the newest committed image")
        self.ledger.append("signal", signum=int(sig), signame=sig.name, step=None, source="criu-supervisor",
                           cause=cause, heard_by=heard, progress_s=self.acct.now())

    def _how_gone(self, code: int | None) -> str:
        if code is None:
            return "its exit status could not be collected; criu had probably ended it"
        if code == 128 + signal.SIGKILL:
            return "killed by SIGKILL: criu had already ended it, or the scheduler or the OOM killer did"
        if code > 128:
            try:
                name = signal.Signals(code - 128).name
            except ValueError:
                name = f"signal {code - 128}"
            return f"status {code}: killed by {name} from outside, e.g. the scheduler's time limit or preemption"
        return (f"it exited with status {code} while this run was being told to stop "
                f"({', '.join(s.name for s in self._ending_signals())})")

    def _ending_signals(self) -> list[signal.Signals]:
        return [s for s in self.pending if s in ENDING_SIGNALS]

    def _told_to_stop(self) -> bool:
        """Whether this run has a TERM/INT/HUP/XCPU pending (Slurm's time limit or preemption
        sends TERM to every process of the step): a job that then ended did not end naturally."""
        return bool(self._ending_signals())

    def _job_alive(self, job: ops.Job) -> bool:
        return job.poll() is None and proctree.alive(job.app_pid)

    def _gone_status(self, job: ops.Job) -> int | None:
        """The exit status of a job whose root is gone (None if it cannot be collected)."""
        self._wait_gone(job)
        return self._reap(job)

    def _ended_during_dump(self, sig: signal.Signals, exc: BaseException, code: int) -> int:
        """The job ended by itself (its own exit, not criu's SIGKILL) while it was being
        dumped: that is its natural end, exactly as without hpcckpt. Nothing is lost and
        nothing is requeued; the images stay as they were (the finished run consumes them)."""
        why = (f"the job ended by itself (status {code}) while it was being dumped, so the dump could not "
               f"complete ({exc})")
        self.log(f"{why}; no requeue: its exit status is the run's")
        self.ledger.append("criu_dump_failed", error=why, signame=sig.name, job_ended=True, stale=None,
                           exited_itself=True, exit_code=code)
        return self._job_exited(code, dumped=False)

    def _job_lost(self, job: ops.Job, sig: signal.Signals, why: str, cause: str) -> int:
        """criu ended the job without a committed image: its state since the last image is
        lost. Requeue so that the next run falls back (the application's own checkpoint or
        a fresh start), never restoring an older image the job had already run past."""
        stale = self._mark_stale()
        said = (f"; images up to {stale} are now stale and will not be restored" if stale else "")
        self.log(f"CRIU DUMP FAILED AND THE JOB HAS ENDED: {why}{said}; requeueing so that the next run "
                 f"falls back (--on-restore-failure={self.opts.on_restore_failure})")
        self.ledger.append("criu_dump_failed", error=why, signame=sig.name, job_ended=True, stale=stale,
                           progress_s=self.acct.now())
        self._wait_gone(job)
        self._stop_record(cause, image=None, signame=sig.name, dump_failed=True)
        self._close_tee()
        return self._requeue(None, cause)

    def _wait_gone(self, job: ops.Job) -> None:
        # criu killed the tree; collect unshare's status so no zombie outlives us.
        deadline = time.monotonic() + 30
        while self._reap(job) is None and time.monotonic() < deadline:
            time.sleep(0.01)

    def _dump_failed(self, job: ops.Job, sig: signal.Signals, exc: BaseException) -> None:
        from .failure import report

        rep = report(job, sig, exc, root=self.root, consumed=self._consumed())
        for line in rep.lines():
            self.log(line)
        self.ledger.append("criu_dump_failed", job_ended=False, progress_s=self.acct.now(), **rep.as_dict())
        ops.signal_pids(rep.forwarded_to, sig)

    def _cuda_checkpoint(self, job: ops.Job) -> tuple[Any, list[int], list[dict[str, Any]]]:
        from ..cuda import checkpoint_all, cuda_pids

        pids = cuda_pids(job.app_pid, driver=self.cuda, log=self.log)
        if not pids:
            return None, [], []
        from ..cuda.gpumap import job_gpus

        t0 = time.monotonic()
        cu = self.cuda()
        said: list[str] = []  # said only if some process turns out to have CUDA state
        gpus = job_gpus(pids, cu.gpus(), log=said.append)  # before the lock: checkpointed, they hold no GPU files
        candidates = pids
        pids = checkpoint_all(cu, pids, lock_timeout_ms=self.opts.cuda_lock_timeout_ms)
        if not pids:
            self.log(f"the CUDA lock said PIDs {candidates} have no CUDA context: dumped as CPU processes")
            return cu, [], []
        for line in said:
            self.log(line)
        self.log(f"CUDA state of host PIDs {pids} locked and checkpointed in {time.monotonic() - t0:.2f} s")
        return cu, pids, gpus

    def _resume_cuda(self, cu: Any, pids: list[int], exc: BaseException | None) -> None:
        """The dump did not happen, or it left the job running (``exc`` None): give every live
        CUDA process its GPU back (all of them, best effort each); if one cannot be, the job
        is stuck and the error says so."""
        from ..cuda.group import resume_all

        live = [p for p in pids if proctree.alive(p)]
        try:
            resume_all(cu, live)
        except CudaCheckpointError as cuda_exc:
            raise CudaCheckpointError(f"{exc}; {cuda_exc}" if exc else str(cuda_exc)) from exc
        if live:
            after = "the failed dump" if exc else "the periodic dump"
            self.log(f"CUDA state of host PIDs {live} restored and unlocked after {after}")

    def _resume_late(self) -> None:
        """A CUDA call reported STUCK after a failed dump may return later, leaving its process
        LOCKED or CHECKPOINTED (its CUDA calls block): give it its GPU back then."""
        driver = sys.modules.get("hpcckpt.cuda.driver")
        if driver is None:
            return  # no driver call was ever made
        for late in driver.take_late_returns():
            self.log(driver.late_text(late))
            self.ledger.append("cuda_late_return", pid=late.pid, call=late.what, result=late.result,
                               left=late.left.name if late.left is not None else None, after_s=late.after_s)
            if late.left not in (driver.ProcessState.LOCKED, driver.ProcessState.CHECKPOINTED):
                continue
            if not proctree.alive(late.pid):
                continue
            from ..cuda.group import resume_all

            try:
                resume_all(self.cuda(), [late.pid])
            except CudaCheckpointError as exc:
                self.log(f"could not bring PID {late.pid} back after its late {late.what}: {exc}")
                continue
            self.log(f"CUDA state of host PID {late.pid} restored and unlocked after its late {late.what}: "
                     "the job runs on")

    def _tracks_memory(self) -> bool:
        """Periodic images are worth chaining only where the kernel tracks dirty pages."""
        if self._track_mem is None:
            from .locate import tracks_memory

            self._track_mem = tracks_memory(self.criu())
            if not self._track_mem:
                self.log("this kernel has no soft-dirty memory tracking (criu check --feature mem_dirty_track): "
                         "every periodic image is a full dump")
        return self._track_mem

    def _parent_image(self) -> str | None:
        """This run's last image, if the job has not been restored since and the chain is short:
        with ``--track-mem`` the next dump then writes only the pages dirtied after it."""
        if self._parent is None or not (self.root / self._parent).is_dir() or not self._tracks_memory():
            return None
        depth = len(images.chain(images.Image(path=self.root / self._parent, seq=images.seq_of(self._parent) or 0)))
        return self._parent if depth < MAX_CHAIN else None

    def _dump(self, job: ops.Job, sig: signal.Signals | None, *, received: bool = True) -> str:
        """One image: at a stop (``sig``: the job ends with the dump) or periodic (None: it runs on).
        A stop noticed on the end time (``received=False``) records no signal: none came."""
        signame = sig.name if sig is not None and received else None
        self._resume_late()
        criu = self.criu()
        seq = images.next_seq(self.root)
        name = images.image_name(seq)
        parent = self._parent_image()
        self._dumped_at_s = self.acct.now()  # how far the job had got when it was stopped for the dump
        cu, cuda, gpus = self._cuda_checkpoint(job)
        dumped = False
        try:  # from the CUDA checkpoint to criu's result: any failure gives the GPUs back
            cuda_inner = [proctree.inner_pid(p) or p for p in cuda]
            with Transaction(self.root, name) as tx:
                t0 = time.monotonic()
                ops.dump(criu, job, tx.path, log=self.root / "logs" / f"dump-{seq:06d}.log", opts=self.opts.dump,
                         leave_running=sig is None, parent=parent,
                         track_mem=sig is None and self._tracks_memory())
                dumped = True
                dump_s = time.monotonic() - t0
                commit_s = self._commit(tx, self._manifest(job, seq, signame, criu, dump_s, cuda_inner, gpus,
                                                           max_inner_id=images.max_task_id(tx.path), parent=parent,
                                                           periodic=sig is None))
        except BaseException as exc:
            if cuda and (not dumped or sig is None):
                self._resume_cuda(cu, cuda, exc)
            raise
        if cuda and sig is None:
            self._resume_cuda(cu, cuda, None)
        self._parent = name
        image = images.Image(path=self.root / name, seq=seq)
        nbytes = image.bytes_total()
        removed = images.prune(self.root, keep=self.opts.keep)
        what = "periodic image (the job runs on)" if sig is None else "image"
        self.log(f"committed {what} {image.path}: {nbytes / 1e6:.1f} MB"
                 + (f" (pages not written since {parent} are taken from it)" if parent else "")
                 + f", dump {dump_s:.2f} s, commit {commit_s:.2f} s"
                 + (f"; removed {len(removed)} old image(s)" if removed else ""))
        self.ledger.append("criu_dump", image=name, bytes=nbytes, dump_s=dump_s, commit_s=commit_s,
                           cuda_pids=len(cuda), signame=signame, periodic=sig is None,
                           parent=parent, progress_s=self._dumped_at_s)
        return name

    def _commit(self, tx: Transaction, manifest: dict[str, Any]) -> float:
        t1 = time.monotonic()
        try:
            tx.commit(manifest)
        except (OSError, CheckpointCorrupt) as exc:
            if tx.committed:
                # Renamed into place and fsynced; only LATEST could not be written. The image
                # is whole, and images.newest() goes by sequence, so it is still the one restored.
                self.log(f"committed {tx.final} but could not update LATEST ({exc}); the image is complete "
                         "and a restore finds it by its sequence number")
                return time.monotonic() - t1
            raise _CommitFailed(f"criu dumped the job but committing {tx.path} failed: {exc}") from exc
        for warning in getattr(tx, "warnings", []):  # after the rename: committed, whatever failed
            self.log(f"{warning}; the image is complete and a restore finds it by its sequence number")
        return time.monotonic() - t1

    def _manifest(self, job: ops.Job, seq: int, signame: str | None, criu: Criu, dump_s: float,
                  cuda_inner: list[int], gpus: list[dict[str, Any]], *, max_inner_id: int,
                  parent: str | None, periodic: bool) -> dict[str, Any]:
        who = identity.current()
        return build_image(
            kind=images.KIND, seq=seq, job_id=who.job_id, restart_count=who.restart_count,
            cmd=list(self.opts.cmd), signal=signame, criu_version=criu.version,
            dump_s=dump_s, progress_s=self._dumped_at_s, parent=parent, periodic=periodic,
            stdio={"stdout": str(job.stdout), "stderr": str(job.stderr)},
            ns_layout=NS_LAYOUT, max_inner_id=max_inner_id, cuda_pids=cuda_inner, gpus=gpus,
            dump_options={"file_locks": self.opts.dump.file_locks,
                          "tcp_established": self.opts.dump.tcp_established,
                          "ext_unix_sk": self.opts.dump.ext_unix_sk})

    # -- requeue -----------------------------------------------------------------------
    def _requeue(self, image: str | None, cause: str, *, what: str | None = None) -> int:
        """Hand the job back to the scheduler; with Slurm ``scontrol requeue`` kills us."""
        self.outcome.action = "requeue"
        what = what or (f"after CRIU image {image}" if image else "after a failed CRIU dump that ended the job")
        self.log(f"requeueing ({what})")
        try:
            outcome = requeue(cluster=detect(), state_dir=self.dir, cause=cause, committed_step=None,
                              ledger=self.ledger, source="criu", note=what)
        except HpcckptError as exc:
            self.log(f"requeue failed: {exc}; the image stays committed: resubmit the job to resume it")
            self.outcome.detail = str(exc)
            return EXIT_REQUEUE
        self.outcome.detail = outcome.detail
        if not outcome.requeued:
            self.log(f"not requeued: {outcome.detail}; the image stays committed: resubmit to resume it")
            return 1
        return int(outcome.exit_code) if outcome.exit_code is not None else 0
