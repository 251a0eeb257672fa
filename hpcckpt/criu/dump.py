"""The dump path of CRIU mode: one image of the running job, committed.

``Dumper.dump``: the CUDA lock and checkpoint of the job's CUDA processes, ``criu dump`` into
a ``store.commit.Transaction``, the commit (checksummed, fsync, rename, LATEST), retention.
At a stop the job ends with the dump; a periodic image (``--dump-every``) leaves it running,
chained to this run's last one by ``--track-mem`` where the kernel tracks dirty pages. Any
failure after the CUDA checkpoint gives every CUDA process its GPU back (one that cannot be
is named and the job said to be stuck); a CUDA call reported STUCK that returns later is
given back then (``resume_late``). What criu would refuse (io_uring, perf events, TCP) is
said once, soon after the start (``check_dumpable``).
"""
from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import CheckpointCorrupt, CriuError, CudaCheckpointError, HpcckptError
from ..lifecycle import identity
from ..lifecycle.ledger import Ledger
from ..proc import tree as proctree
from ..store.commit import Transaction
from ..store.lock import writer_lock
from ..store.manifest import build_image
from . import images, ops
from .locate import Criu
from .options import NS_LAYOUT, RunOptions, Tools
from .watch import Progress

# When the dumpability check runs (seconds after the job starts or is restored): early,
# and again once a launcher such as torchrun has started its workers.
CHECK_AT_S = (5.0, 45.0)
DUMP_MARGIN_S = 15.0  # a deferred time-limit dump starts at least this long before the end
MAX_CHAIN = 8  # images in a --track-mem chain (each holding only what the one before lacks)


class CommitFailed(CriuError):
    """criu dumped (and so ended) the job, but the image could not be committed."""


def dump_margin_s(ledger: Ledger) -> float:
    """Three times the slowest dump + commit this run directory has seen, and 15 s at least."""
    costs = (float(e.get("dump_s") or 0) + float(e.get("commit_s") or 0) for e in ledger.events()
             if e.get("event") == "criu_dump")  # streamed: bounded memory
    return max(DUMP_MARGIN_S, 3 * max(costs, default=0.0))


class Dumper:
    """Images of one run's job: at a stop, periodic, and what comes between."""

    def __init__(self, opts: RunOptions, *, root: Path, ledger: Ledger, log: Callable[[str], None],
                 acct: Progress, tools: Tools) -> None:
        self.opts, self.root, self.ledger, self.log, self.acct, self.tools = opts, root, ledger, log, acct, tools
        self.checks_at = list(CHECK_AT_S)
        self.parent: str | None = None  # this run's last image, dumped with --track-mem
        self.last_dump = time.monotonic()
        self.dumped_at_s = 0.0  # how far the job had got when it was stopped for the last dump
        self._track_mem: bool | None = None

    def started(self) -> None:
        """The job runs (fresh or restored): no image of this run yet."""
        self.last_dump = time.monotonic()
        self.parent = None

    # -- between stops ---------------------------------------------------------------
    def check_dumpable(self, job: ops.Job) -> None:
        if not self.checks_at or self.acct.run_s() < self.checks_at[0]:
            return
        self.checks_at.pop(0)
        from . import dumpable

        found = dumpable.problems(job.app_pid, tcp_allowed=self.opts.dump.tcp_established)
        if found:
            self.checks_at.clear()  # said once
            for line in dumpable.lines(found):
                self.log(line)
        elif self.checks_at:
            return
        self.ledger.append("criu_check", ok=not found, problems=[p.as_dict() for p in found],
                           fix=dumpable.fix(found) if found else "")

    def periodic_due(self) -> bool:
        return self.opts.dump_every_s > 0 and time.monotonic() - self.last_dump >= self.opts.dump_every_s

    def periodic(self, job: ops.Job) -> None:
        """An image while the job runs on (criu dump --leave-running): a kill without warning
        then loses at most one interval."""
        self.last_dump = time.monotonic()
        try:
            with writer_lock(self.root):
                self.dump(job, None)
        except (HpcckptError, OSError) as exc:
            ended = not (job.poll() is None and proctree.alive(job.app_pid))
            self.log(f"periodic CRIU dump failed: {exc}" + ("" if ended else "; the job runs on"))
            self.ledger.append("criu_dump_failed", error=str(exc), periodic=True, job_ended=ended,
                               progress_s=self.acct.now())

    # -- one image ---------------------------------------------------------------------
    def dump(self, job: ops.Job, sig: signal.Signals | None, *, received: bool = True) -> str:
        """One image: at a stop (``sig``: the job ends with the dump) or periodic (None: it runs on).
        A stop noticed on the end time (``received=False``) records no signal: none came."""
        signame = sig.name if sig is not None and received else None
        self.resume_late()
        criu = self.tools.criu()
        seq = images.next_seq(self.root)
        name = images.image_name(seq)
        parent = self._parent_image()
        self.dumped_at_s = self.acct.now()
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
        self.parent = name
        self._committed(name, seq, parent, dump_s, commit_s, cuda=len(cuda), signame=signame, periodic=sig is None)
        return name

    def _committed(self, name: str, seq: int, parent: str | None, dump_s: float, commit_s: float, *,
                   cuda: int, signame: str | None, periodic: bool) -> None:
        image = images.Image(path=self.root / name, seq=seq)
        nbytes = image.bytes_total()
        removed = images.prune(self.root, keep=self.opts.keep)
        what = "periodic image (the job runs on)" if periodic else "image"
        self.log(f"committed {what} {image.path}: {nbytes / 1e6:.1f} MB"
                 + (f" (pages not written since {parent} are taken from it)" if parent else "")
                 + f", dump {dump_s:.2f} s, commit {commit_s:.2f} s"
                 + (f"; removed {len(removed)} old image(s)" if removed else ""))
        self.ledger.append("criu_dump", image=name, bytes=nbytes, dump_s=dump_s, commit_s=commit_s,
                           cuda_pids=cuda, signame=signame, periodic=periodic,
                           parent=parent, progress_s=self.dumped_at_s)

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
            raise CommitFailed(f"criu dumped the job but committing {tx.path} failed: {exc}") from exc
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
            dump_s=dump_s, progress_s=self.dumped_at_s, parent=parent, periodic=periodic,
            stdio={"stdout": str(job.stdout), "stderr": str(job.stderr)},
            ns_layout=NS_LAYOUT, max_inner_id=max_inner_id, cuda_pids=cuda_inner, gpus=gpus,
            dump_options={"file_locks": self.opts.dump.file_locks,
                          "tcp_established": self.opts.dump.tcp_established,
                          "ext_unix_sk": self.opts.dump.ext_unix_sk})

    # -- memory tracking -----------------------------------------------------------------
    def _tracks_memory(self) -> bool:
        """Periodic images are worth chaining only where the kernel tracks dirty pages."""
        if self._track_mem is None:
            from .locate import tracks_memory

            self._track_mem = tracks_memory(self.tools.criu())
            if not self._track_mem:
                self.log("this kernel has no soft-dirty memory tracking (criu check --feature mem_dirty_track): "
                         "every periodic image is a full dump")
        return self._track_mem

    def _parent_image(self) -> str | None:
        """This run's last image, if the job has not been restored since and the chain is short:
        with ``--track-mem`` the next dump then writes only the pages dirtied after it."""
        if self.parent is None or not (self.root / self.parent).is_dir() or not self._tracks_memory():
            return None
        depth = len(images.chain(images.Image(path=self.root / self.parent, seq=images.seq_of(self.parent) or 0)))
        return self.parent if depth < MAX_CHAIN else None

    # -- CUDA ----------------------------------------------------------------------------
    def _cuda_checkpoint(self, job: ops.Job) -> tuple[Any, list[int], list[dict[str, Any]]]:
        from ..cuda import checkpoint_all, cuda_pids

        pids = cuda_pids(job.app_pid, driver=self.tools.cuda, log=self.log)
        if not pids:
            return None, [], []
        from ..cuda.gpumap import job_gpus

        t0 = time.monotonic()
        cu = self.tools.cuda()
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

    def resume_late(self) -> None:
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
                resume_all(self.tools.cuda(), [late.pid])
            except CudaCheckpointError as exc:
                self.log(f"could not bring PID {late.pid} back after its late {late.what}: {exc}")
                continue
            self.log(f"CUDA state of host PID {late.pid} restored and unlocked after its late {late.what}: "
                     "the job runs on")
