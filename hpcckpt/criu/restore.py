"""The start of a CRIU-mode run: the newest committed image restored, or the command started.

``Starter.restore``: verify every file of the image and of the images it takes unchanged
pages from, check that this node's GPUs can take its CUDA processes, ``criu restore`` into
fresh PID + mount namespaces, then CUDA restore + unlock (onto the same GPUs or, by UUID
pairs, onto others). ``Starter.start_fresh``: the command from its beginning, in fresh
namespaces, its dump signals ignored (Slurm's TERM reaches every process of the job, and
only the supervisor may act on it).
"""
from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..config import internal_var
from ..errors import CriuError, CudaCheckpointError
from ..lifecycle import identity
from ..lifecycle.history import OPENERS
from ..lifecycle.ledger import Ledger, process_start_time
from ..lifecycle.records import record_start
from ..proc import tree as proctree
from ..store.lock import writer_lock
from . import images, ops
from .options import NS_LAYOUT, RunOptions, Tools
from .watch import Progress


def restarted(ledger: Ledger) -> str | None:
    """Why this start is a restart (Slurm's or the local supervisor's restart count, or an
    earlier run in this directory that did not run to its end), None for a first start."""
    me = identity.current()
    if me.restart > 0:
        return f"job {me.job_id or '(local)'} was restarted, restart {me.restart}"
    last: dict[str, Any] | None = None  # the last run's opener, while that run has not finished
    for e in ledger.events():  # streamed: a ledger of any size in bounded memory
        if e.get("event") in OPENERS:
            last = e
        elif e.get("event") == "stop" and e.get("reason") in ("done", "error"):
            last = None
    if last is not None:
        job = last.get("job_id")
        return f"an earlier run{f' (job {job})' if job else ''} in this directory did not finish"
    return None


class Starter:
    """Starts one run's job. ``started(job, progress_s)``: the supervisor's, called once the
    job runs (before the start is recorded, as the end-time watch may record its poll)."""

    def __init__(self, opts: RunOptions, *, root: Path, ledger: Ledger, log: Callable[[str], None],
                 tools: Tools, tag: str, started: Callable[[ops.Job, float], None]) -> None:
        self.opts, self.root, self.ledger, self.log, self.tools = opts, root, ledger, log, tools
        self.tag, self._started = tag, started

    def stdio_paths(self) -> tuple[Path, Path]:
        base = self.root / "stdio" / self.tag
        return base.with_suffix(".out"), base.with_suffix(".err")

    def start_fresh(self, fallback: str | None, *, no_image: str | None = None) -> ops.Job:
        """Start the command from the beginning; ``no_image``: why this start is a restart that
        had no image to restore (recorded on the ``start`` event for ``hpcckpt history``)."""
        out, err = self.stdio_paths()
        env = dict(os.environ)
        if fallback:
            env[internal_var("CRIU_FALLBACK")] = fallback
        job = ops.launch(list(self.opts.cmd), stdout=out, stderr=err, env=env,
                         log=self.root / "logs" / f"unshare-{self.tag}.log", ignore=self._ignored())
        self.log(f"started {' '.join(self.opts.cmd)!r} in new PID + mount namespaces (host PID {job.app_pid}); "
                 f"stdout {out}, stderr {err}")
        # The run's opening record first: what the supervisor notes as it starts watching (the
        # end time's poll) belongs to this run.
        record_start(self.ledger, mode="criu", resumed_from=None, image=None, progress_s=0.0,
                     fallback=fallback, dump_every_s=self.opts.dump_every_s, no_image=no_image,
                     process_start=process_start_time(), **Progress.lost_since(self.ledger.events(), 0.0))
        self._started(job, 0.0)
        return job

    def _ignored(self) -> tuple[signal.Signals, ...]:
        """The dump signals, ignored by the job: Slurm's TERM reaches every process of the job,
        and only the supervisor may act on it (dump first, then the job ends)."""
        return tuple(s for s in self.opts.dump_signals if s not in (signal.SIGKILL, signal.SIGSTOP))

    def restore(self, image: images.Image) -> ops.Job:
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
            out, err = self.stdio_paths()
            logs = self.root / "logs"
            t1 = time.monotonic()
            job = ops.restore(self.tools.criu(), image.path, old_stdio=manifest.get("stdio", {}), new_stdout=out,
                              new_stderr=err, log=logs / f"restore-{self.tag}.log", work_dir=logs,
                              opts=self.opts.dump, last_pid=int(manifest["max_inner_id"]))
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
        self._started(job, progress_s)
        return job

    def _gpu_plan(self, manifest: dict[str, Any]) -> list[tuple[str, str]] | None:
        """Before criu runs: can this node's GPUs take the image's CUDA processes?"""
        if not manifest.get("cuda_pids"):
            return None
        from ..cuda.gpumap import plan

        cu = self.tools.cuda()
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
            restore_all(self.tools.cuda(), pids, pairs)
        except CudaCheckpointError:
            ops.kill_tree(job)
            ops.wait_gone(job)
            raise
        self.log(f"CUDA state restored and unlocked for host PIDs {pids}")

