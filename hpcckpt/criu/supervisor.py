"""``hpcckpt run --mode criu``: the supervisor a batch script runs instead of the bare command.

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
          _HPCCKPT_CRIU_FALLBACK=fresh), or exit (``fail``).
  signal: a dump signal -> CUDA lock + checkpoint -> criu dump into a Transaction ->
          commit (checksummed, fsync, rename, LATEST) -> retention -> requeue and exit.
          Any other catchable signal is forwarded to the job. The job starts with the dump
          signals ignored (USR2, TERM by default): Slurm sends TERM to every process of the
          job at a preemption's end and at the time limit, and only we may act on it. Under
          Slurm the end time is read every --end-poll-s: pulled in to near now (a GraceTime
          preemption, which sends no signal at its start) it is a dump at once, pulled in
          further (a shortened limit) it only re-plans the dump; a time-limit warning the
          coarse tick delivered early (or --time-min's short allocation at its start) waits
          until the lead before the end (lifecycle.timing.bounded_lead_s).
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

Where each part lives: this module, the command's process tree and the run's end (the main
loop, a stop signal, the job's exit, the requeue); ``lifecycle.timing.StopTiming``, when the
stop comes (the end time watched, an early warning deferred, a preemption told from a
shortened limit); ``dump.py``, the dump path; ``restore.py``, the start (restore or fresh);
``images.py``, the images and their marks (consumed, stale, behind the job's own save).

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
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..cluster import detect
from ..errors import CheckpointCorrupt, CriuError, CudaCheckpointError, HpcckptError, NoCheckpoint
from ..exitcodes import EXIT_REQUEUE
from ..lifecycle import identity, requeue
from ..lifecycle.ledger import Ledger
from ..lifecycle.records import record_stop
from ..lifecycle.supervise import FORWARDED, SignalInbox, as_recorded, run_forwarding
from ..lifecycle.timing import StopTiming
from ..proc import tree as proctree
from ..store.lock import writer_lock
from . import images, ops
from .dump import CommitFailed, Dumper, dump_margin_s
from .options import CriuOutcome, RunOptions, Tools, first_line, multi_node_refusal
from .restore import Starter, restarted
from .watch import Progress, Tee

__all__ = ["CriuOutcome", "RunOptions", "Supervisor", "multi_node_refusal"]

# Signals that end a run from outside (the scheduler's time limit, preemption, scancel, a
# hang-up): a job that ends while one is pending has not reached its natural end. Not the
# signals that trigger a dump (RunOptions.dump_signals), nor config.STOP_SIGNALS.
ENDING_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGXCPU)
STALE = images.STALE


def _incarnation() -> str:
    me = identity.current()
    return f"{me.job_id or 'local'}-r{me.restart_count}-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"


class Supervisor:
    """One CRIU-mode run: its job started or restored, watched, dumped at its stop, requeued."""

    def __init__(self, opts: RunOptions, *, log: Callable[[str], None] | None = None,
                 cuda_driver: Callable[[], Any] | None = None) -> None:
        self.opts = opts
        self.dir = Path(opts.dir).resolve()
        self.root = images.criu_root(self.dir)
        self.ledger = Ledger(self.dir)
        self.log = log or (lambda msg: print(f"hpcckpt run: {msg}", file=sys.stderr, flush=True))
        self.inbox = SignalInbox()
        self.pending = self.inbox.pending  # the signals recorded, in order
        self.tools = Tools(opts.criu_path, cuda_driver)
        self.outcome = CriuOutcome(exit_code=1, action="exited")
        self.acct = Progress()
        self._tee: Tee | None = None
        self.dumper = Dumper(opts, root=self.root, ledger=self.ledger, log=self.log, acct=self.acct,
                             tools=self.tools)
        self.starter = Starter(opts, root=self.root, ledger=self.ledger, log=self.log, tools=self.tools,
                               tag=_incarnation(), started=self._started)
        self.timing = StopTiming(lead_s=opts.lead_s, need_s=lambda: dump_margin_s(self.ledger), log=self.log,
                                 ledger=self.ledger, what="dump", source="criu-supervisor", progress=self.acct.now)
        self._heard: tuple[signal.Signals, str] | None = None  # a stop the job's own processes heard too
        # The job's processes and their (SigIgn, SigCgt) masks at the loop's last turn (_survey)
        self._masks: dict[int, tuple[int, int]] = {}

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
        nodes = detect().env.num_nodes
        if nodes > 1:
            why = multi_node_refusal(nodes)
            self.log(f"NOT IN CRIU MODE: {why}; the command runs on untouched, with no image and no requeue")
            self.ledger.append("criu_refused", reason=why, nodes=nodes)
            self.outcome.exit_code = run_forwarding(self.opts.cmd, self.inbox, log=self.log)
            return self.outcome
        try:
            restored = self._restore_or_start()
        except ops.JobExited as done:  # a job that ends at once is over, never started again
            self.log(str(done))
            self.outcome.exit_code = self._job_exited(done.code, dumped=False)
            return self.outcome
        if restored is None:
            return self.outcome
        self.outcome.exit_code = self._loop(restored)
        return self.outcome

    # -- start ---------------------------------------------------------------------
    def _started(self, job: ops.Job, progress_s: float) -> None:
        """The job runs (fresh or restored): count its progress, copy its output, watch its end."""
        self.acct.begin(progress_s)
        self.dumper.started()
        self._tee = Tee([(job.stdout, 2 if self.opts.json_stdout else 1), (job.stderr, 2)])
        self._tee.start()
        if self.opts.end_poll_s > 0:
            self.timing.watch_end(detect(), self.opts.end_poll_s)

    def _close_tee(self) -> None:
        if self._tee is not None:
            self._tee.close()

    def _restore_or_start(self) -> ops.Job | None:
        try:
            image = images.newest(self.root)
        except NoCheckpoint:
            again = restarted(self.ledger)
            if again:
                self.log(f"NO CRIU IMAGE to restore ({again}, but {self.root} holds none): the command starts "
                         "from the beginning")
            return self.starter.start_fresh(None, no_image=again)
        if images.marked(self.root, images.CONSUMED) == image.name:
            self.log(f"{image.path} belongs to a run that already finished; starting the command from the "
                     "beginning")
            return self.starter.start_fresh(None)
        if images.marked(self.root, images.OWN_SAVE) == image.name:
            self.log(f"the job saved itself and exited 75 after {image.name}: the command starts afresh and "
                     "resumes from its own checkpoint")
            return self.starter.start_fresh(None, no_image="the job's own save (exit 75)")
        if images.stale(self.root, image):
            return self._restore_failed(image, CriuError(
                f"{image.name} is stale: a later dump ended the job but could not be committed, so the job "
                "had run past this image and restoring it would rewind its work"))
        try:
            job = self.starter.restore(image)
        except ops.RestoredJobExited as done:
            self.log(f"restored {image.name}; {done}")
            self.outcome.restored_from = image.name
            self.outcome.exit_code = self._job_exited(done.code, dumped=False)
            return None
        except (CheckpointCorrupt, CriuError, CudaCheckpointError, OSError) as exc:
            return self._restore_failed(image, exc)
        self.outcome.restored_from = image.name
        return job

    def _restore_failed(self, image: images.Image, exc: Exception) -> ops.Job | None:
        fallback = self.opts.on_restore_failure
        self.log(f"cannot restore {image.path}: {exc}")
        self.ledger.append("criu_restore_failed", image=image.name, error=str(exc), fallback=fallback)
        if fallback == "fail":
            self.log("--on-restore-failure=fail: not starting the job")
            self.outcome.exit_code, self.outcome.action, self.outcome.detail = 1, "restore-failed", str(exc)
            return None
        self.log(f"NOT RESTORED: {image.name} cannot be used ({first_line(exc)}); the command starts from the "
                 f"beginning (--on-restore-failure={fallback}; with `app` it resumes from its own checkpoint if it "
                 "writes one)")
        return self.starter.start_fresh(fallback)

    # -- main loop --------------------------------------------------------------
    def _reap(self, job: ops.Job) -> int | None:
        # Only through the job's own Popen: a waitpid(-1) here, or a dropped Popen that a
        # later subprocess call reaps, would take the status and leave nothing true to report.
        return job.poll()

    def _loop(self, job: ops.Job) -> int:
        while True:
            self.dumper.resume_late()
            code = self._reap(job)
            if code is not None:
                return self._job_exited(code, dumped=False)
            result = self._duties(job)
            if result is not None:
                return result
            while self.pending:
                sig = self.pending.pop(0)
                if sig in self.opts.dump_signals:
                    result = self._on_dump_signal(job, sig)
                    if result is not None:
                        return result
                else:
                    self.log(f"forwarding {sig.name} to the job (PID {job.init_pid})")
                    ops.kill_tree(job, sig)
            self.inbox.sleep(1.0)

    def _duties(self, job: ops.Job) -> int | None:
        """The dumpability check, a preemption seen on the end time, periodic images."""
        self._survey(job)
        self.dumper.check_dumpable(job)
        if self.timing.preempted():
            left = self.timing.remaining_s()
            self.log(f"the job's end time was pulled in ({left:.0f} s left): a preemption (GraceTime); dumping now")
            return self._on_dump_signal(job, signal.SIGTERM, cause="preemption", received=False)
        if self.timing.planned_due():
            return self._on_dump_signal(job, signal.SIGUSR2, cause="time_limit", received=False)
        if self.dumper.periodic_due():
            self.dumper.periodic(job)
        return None

    # -- a stop ----------------------------------------------------------------------
    def _on_dump_signal(self, job: ops.Job, sig: signal.Signals, *, cause: str | None = None,
                        received: bool = True) -> int | None:
        cause = cause or self.timing.cause(sig)
        if self.timing.defer(sig, cause, received):
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
                name = self.dumper.dump(job, sig, received=received)
        except CommitFailed as exc:
            return self._job_lost(job, sig, str(exc), cause)
        except (HpcckptError, OSError) as exc:
            return self._dump_did_not_stop(job, sig, cause, exc)
        ops.wait_gone(job)
        self.outcome.images.append(name)
        self._stop_record(cause, image=name, signame=sig.name if received else None,
                          progress_s=self.dumper.dumped_at_s)
        self._close_tee()
        return self._requeue(name, cause)

    def _dump_did_not_stop(self, job: ops.Job, sig: signal.Signals, cause: str, exc: BaseException) -> int | None:
        """The dump failed. Gone: either the job finished by itself while the dump was under way
        (the lock or criu then fail for want of a process), or criu killed it (SIGKILL, at the end
        of a dump it then reported failed, e.g. a timeout). Never say "keeps running" of a job
        that is gone, and never signal it. Alive: it runs on, and the failure is reported."""
        if not self._job_alive(job):
            code = self._gone_status(job)
            if code is not None and code < 128 and not self._told_to_stop():
                return self._ended_during_dump(sig, exc, code)
            return self._job_lost(job, sig, f"{exc}; and the job is gone ({self._how_gone(code)})", cause)
        from .failure import report

        rep = report(job, sig, exc, root=self.root, consumed=images.marked(self.root, images.CONSUMED))
        for line in rep.lines():
            self.log(line)
        self.ledger.append("criu_dump_failed", job_ended=False, progress_s=self.acct.now(), **rep.as_dict())
        ops.signal_pids(rep.forwarded_to, sig)
        return None

    def _survey(self, job: ops.Job) -> None:
        """Note the job's processes and what each does with the ending signals, at every turn
        of the loop under Slurm (a few /proc reads): a stop's TERM may end a DataLoader worker
        (and its parent reap it) before the supervisor looks, and the note still says it heard
        it. Not while an ending signal waits to be handled: the note must predate the stop."""
        if any(s in ENDING_SIGNALS for s in self.pending) or not identity.current().in_slurm:
            return
        masks = {}
        for pid in proctree.tree(job.app_pid):
            got = proctree.signal_masks(pid)
            if got is not None:
                masks[pid] = got
        self._masks = masks

    def _heard_by(self, job: ops.Job, sig: signal.Signals) -> list[str]:
        """The job's processes that heard ``sig`` as the supervisor did: under Slurm a stop's TERM
        reaches every process of the job at once, and one that does not ignore it (the job
        starts with it ignored) handles it (its own save, then an exit) or dies of it (a
        DataLoader worker): an image of it would be of a process that is ending. A process the
        last survey saw not ignoring ``sig`` and that is gone now counts too (ended by it)."""
        if sig not in ENDING_SIGNALS or not identity.current().in_slurm:
            return []  # a warning, or a signal only the supervisor was sent (outside Slurm)
        heard = []
        live = proctree.tree(job.app_pid)
        for pid in live:
            how = proctree.disposition(pid, sig)
            if how in ("caught", "default"):
                heard.append(f"{proctree.inner_pid(pid) or pid} {how} ({proctree.command(pid, limit=60)})")
        for pid, masks in self._masks.items():
            how = proctree.handling(masks, sig)
            if pid not in live and how != "ignored" and not proctree.alive(pid):
                heard.append(f"{pid} {how} (gone before the supervisor looked: ended by it)")
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

    # -- the job's end ------------------------------------------------------------------
    def _job_exited(self, code: int, *, dumped: bool) -> int:
        self.log(f"job exited with status {code}")
        self.outcome.action = "exited"
        if dumped:
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
        images.mark(self.root, images.CONSUMED)
        return code

    def _own_save_requeue(self) -> int:
        """Exit 75: the job saved itself and asks for a requeue, as in every mode. No image of the
        exit is made or restored: the next run starts the command afresh and it resumes from its
        own save."""
        sig, cause = self._heard if self._heard is not None else (None, self._exit_cause())
        cause = as_recorded(cause, log=self.log)
        self.log(f"the job exited 75 (its own save: requeue me){f' after {sig.name}' if sig else ''}: requeueing; "
                 "the next run starts the command afresh and it resumes from its own checkpoint")
        images.mark(self.root, images.OWN_SAVE)
        self._stop_record(cause, image=None, exit_code=EXIT_REQUEUE, own_save=True,
                          signame=sig.name if sig else None)
        self._close_tee()
        return self._requeue(None, cause, what="after the job's own save (exit 75)")

    def _exit_cause(self) -> str:
        """Why a job that exited 75 by itself stopped: the signal it was sent, else its own choice."""
        pending = self._ending_signals()
        return self.timing.cause(pending[0]) if pending else "signal"

    def _killed_from_outside(self, code: int) -> bool:
        return code > 128 and (code - 128 in (signal.SIGKILL, *ENDING_SIGNALS) or self._told_to_stop())

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
        ops.wait_gone(job)
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
        stale = images.mark(self.root, STALE)
        said = (f"; images up to {stale} are now stale and will not be restored" if stale else "")
        self.log(f"CRIU DUMP FAILED AND THE JOB HAS ENDED: {why}{said}; requeueing so that the next run "
                 f"falls back (--on-restore-failure={self.opts.on_restore_failure})")
        self.ledger.append("criu_dump_failed", error=why, signame=sig.name, job_ended=True, stale=stale,
                           progress_s=self.acct.now())
        ops.wait_gone(job)
        self._stop_record(cause, image=None, signame=sig.name, dump_failed=True)
        self._close_tee()
        return self._requeue(None, cause)

    # -- records and requeue --------------------------------------------------------------
    def _stop_record(self, reason: str, *, progress_s: float | None = None, **fields: Any) -> None:
        """One ``stop`` per run: why it ended and how far the job had got (seconds of running)."""
        record_stop(self.ledger, mode="criu", reason=reason, step=None,
                    progress_s=self.acct.now() if progress_s is None else progress_s, **fields)

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
