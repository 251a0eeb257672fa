"""The user-facing API: ``Checkpointer`` and the ``@preemptible`` decorator.

Typical use::

    @preemptible(dir="/scratch/run1", every_steps=100)
    def train(ckpt):
        ckpt.register(model=model, optimizer=opt, scheduler=sched, sampler=sampler)
        for step, batch in ckpt.loop(loader, total_steps=10_000):
            ...

On a recorded signal (or an approaching deadline / maintenance window) all ranks
agree to stop at the next step boundary; the final checkpoint is made durable,
then the coordinator requeues the job and every rank exits with ``EXIT_REQUEUE``
(the local supervisor restarts such a process; under Slurm ``scontrol requeue``
has already ended the job).
"""
from __future__ import annotations

import dis
import functools
import inspect
import logging
import os
import sys
import threading
import time
import weakref
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, Callable, Iterable, Iterator, TypeVar

import torch

from .config import CheckpointOptions, env_value, resolve_options
from .data import Progress, find_resumable
from .engines import SaveContext, SaveHandle, make_engine
from .engines.base import live_tensors
from .errors import CheckpointCorrupt, CheckpointFailed, ConfigError, HpcckptError
from .exitcodes import EXIT_PROBLEM, EXIT_REQUEUE, flush_and_exit
from .levels import Levels
from .levels import restore as level_restore
from .lifecycle import identity, requeue
from .lifecycle.history import record_superseded
from .lifecycle.ledger import Ledger, process_start_time
from .cluster.base import Cause, Cluster
from .policy import WARNING_SIGNALS, AutoInterval, Figures, Policy, StopReason, estimate_save_s
from .ranks import Ranks
from .resume import Outcome, load_newest
from .signals import AfterRun, Received, SignalRecorder, quiet_workers
from .state import Flat, TrainState, init_dtensor_optimizer_state, rng_state, set_rng_state, stepping_optimizer
from .store.lock import WriterBusy, WriterLease, usable_root

log = logging.getLogger("hpcckpt")

F = TypeVar("F", bound=Callable[..., Any])

# Time between the end of an epoch's training pass and the next pass (its evaluation and other
# per-epoch code) from which the pass's end is checkpointed: a stop that comes in such a stretch
# (a preemption's TERM, whose grace is Slurm's KillWait, 30 s by default, or the site's GraceTime)
# waits for the next step boundary, and a job killed before it comes back from there.
LONG_TAIL_S = 30.0


class RequeueExit(SystemExit):
    """Raised after the final checkpoint is durable (and the job requeued): exit 75."""

    def __init__(self, reason: str, step: int) -> None:
        super().__init__(EXIT_REQUEUE)
        self.reason = reason
        self.step = step


class RefusedExit(SystemExit):
    """The job cannot progress within its time limit: exit 1, no requeue (the reason was logged)."""

    def __init__(self, reason: str, step: int) -> None:
        super().__init__(EXIT_PROBLEM)
        self.reason = reason
        self.step = step


def _detect_cluster() -> Any:
    from .cluster import detect
    return detect()


class Checkpointer:
    """Registers train state, restores it, saves it at step boundaries, stops on signals.

    Runs on every rank; saving and agreement are collective when torch.distributed is
    initialised (create the Checkpointer after ``init_process_group``).
    """

    def __init__(self, dir: str | os.PathLike[str] | None = None, *, options: CheckpointOptions | None = None,
                 cluster: Any = None, **overrides: Any) -> None:
        self.options = options or resolve_options(dir, **overrides)
        self.root = self.options.dir
        self.ranks = Ranks()
        self.cluster = cluster if cluster is not None else _detect_cluster()
        self.state = TrainState()
        self.state.rank, self.state.world = self.ranks.rank, self.ranks.world
        self.state.replicated = self.options.replicated
        self.state.check_replicas = self.options.check_replicas
        self.ledger = Ledger(self.root)
        # With levels, periodic saves are node-local ones; the shared level's are drained from them.
        self.policy = Policy(self.options.local_every_steps or self.options.every_steps, margin_s=self.options.deadline_margin_s,
                             auto=AutoInterval(overhead_bound=self.options.overhead_bound)
                             if self.options.auto_interval else None,
                             background=bool(getattr(self.cluster, "remote", False)))
        self.figures = Figures.read(self.root)  # costs measured by earlier allocations
        self.policy.seed(self.figures)
        self.policy.warning_window_s = env_value("warning_window_s", 300.0)
        self.policy.poll_s = env_value("poll_s", self.policy.poll_s)
        self._stop_at: tuple[int, ...] = env_value("stop_at_steps", ())  # hpcckpt check's stops
        trace = os.environ.get("HPCCKPT_CHECK_TRACE", "").strip()
        self._trace = Path(trace) if trace else None  # hpcckpt check: digests of the state at each step
        self._loss: str | None = None
        self._deferred: str | None = None  # why a warning signal waits for the deadline
        self._warned = False  # some rank received a warning signal
        self._start_step = 0
        self._startup_s: float | None = None  # process start to the first boundary's setup (_begin)
        self.signals = SignalRecorder(self.options.signals)
        self.step = 0
        self.resumed_from: int | None = None
        self.committed_step: int | None = None
        self._loaded: Flat | None = None
        self._load_attempted = False
        self._restore_s = 0.0
        self.progress = Progress()  # epoch, loader passes, finished: saved as "__progress__"
        self.state.objects[Progress.NAME] = self.progress
        self.progress.grads = self._accumulated_grads
        # Gradients accumulated since a registered optimizer last stepped: set by a hook on the
        # registered modules' parameters, cleared by the optimizers' post-hook (_hook_steps). A
        # boundary where it is set falls inside a gradient accumulation.
        self._accumulating = False
        self._trained = 0  # optimizer steps and gradient accumulations seen (a left pass's batch was trained)
        # A step whose boundary is still to run: the loop left a ckpt.batches pass after training its
        # batch ("boundary": counted, its boundary runs at the next boundary point), or an exception
        # left it ("count": counted there, if the script gets there). See Checkpointer._left_pass.
        self._owed: str | None = None
        self._last_epoch = False  # the epoch of ckpt.epochs() in progress is its last
        self._tail_step: int | None = None  # the step of the last epoch's end of training, committed
        self._step_hooks: dict[int, Any] = {}
        self._grad_hooks: dict[int, Any] = {}
        self._resume_rng: dict[str, Any] | None = None  # the saved RNG, set again where training resumes
        self._already_finished = False
        self._progress_restored = False
        self._last_step_t: float | None = None
        self._tail_from: float | None = None  # when the last training pass of ckpt.batches ended
        self._tail_s: float | None = None  # how long the code between two passes took, last measured
        self._loader_names: dict[int, str] = {}  # id of a loader object -> its key (``_loader_key``)
        self._keys_used: tuple[Any, set[str]] = (None, set())  # (epoch, keys whose pass began in it)
        self._legacy_keys: bool | None = None  # a run begun before call-site keys: "loader<N>" by first use
        self._sites_warned: set[str] = set()
        self._fresh_ok = False
        self._jit: Any = None  # hpcckpt.jit.JitGuard with jit=True, from the first step on
        self._initialized: list[torch.optim.Optimizer] = []  # optimizers whose state a restore created
        self._handles: list[SaveHandle] = []
        self._started = False
        self._closed = False
        # A trainer whose own loop resumes its data (set by the integrations): no loose-iterator warning.
        self.data_resumed_by: str | None = None
        self._driven = 0  # step boundaries run and training passes opened: epochs() tells a full-batch epoch by it
        self._epoch_steps_logged = False
        usable_root(self.root)  # made if needed; a ConfigError naming it and the fix, never a raw OSError
        me = identity.current()
        self._lease = WriterLease(self.root, job_id=me.raw_job_id, restart=me.restart, job=me.job_id)
        self._take_lease()
        self.levels: Levels | None = None  # multi-level checkpoints (local_every_steps)
        self.restored_level: str | None = None  # the level the resume read: node-local, partner or shared
        try:
            if self.options.local_every_steps is not None:
                self.levels = Levels.make(self.options, self.ranks, me.node, self.cluster.env.staging_dir())
            self.engine = make_engine(self.options.engine, SaveContext(
                root=self.levels.local if self.levels else self.root, keep=self.options.keep,
                job=self._job_info(), user={}, levels=self.levels), self.ranks,
                **(self._concurrent_options() if self.options.engine == "concurrent" else {}))
        except BaseException:
            self._lease.release()
            raise
        self.signals.install()
        self.progress.worker_seeds.install()  # until close(): the seeds evaluation loaders' workers take
        self.progress.worker_seeds.on_unsure = self._note_loader_seed

    def _take_lease(self) -> None:
        """The coordinator holds the directory's writer lease until ``close``; every rank learns a refusal."""
        refusal: dict[str, Any] | None = None
        if self.ranks.is_coordinator:
            try:
                self._lease.acquire()
            except WriterBusy as exc:
                refusal = {"message": str(exc), "job_id": exc.holder_job_id}
        refusal = self.ranks.broadcast_json(refusal)
        if refusal is None:
            return
        self.ranks.close()
        if not identity.current().in_slurm:
            raise WriterBusy(refusal["message"], holder_job_id=refusal["job_id"])
        # Under Slurm a second live job on this directory is a duplicate of this run (a
        # successor and a requeued original both started): the one without the lease is
        # superseded. It says so once, records it, and leaves quietly (status 0, not FAILED).
        if self.ranks.is_coordinator:
            record_superseded(self.ledger, holder=refusal["message"], holder_job_id=refusal["job_id"])
            print(f"hpcckpt: superseded: {refusal['message']}; this run leaves without training "
                  "(status 0)", file=sys.stderr, flush=True)
        raise SystemExit(0)

    def _concurrent_options(self) -> dict[str, Any]:
        o = self.options
        return {"max_async": o.max_async, "writer_threads": o.writer_threads, "on_busy": o.on_busy,
                "memory_budget_bytes": o.memory_budget_bytes, "direct": o.direct, "staging_bytes": o.staging_bytes,
                "chunk_bytes": o.chunk_bytes, "ring_chunk_bytes": o.ring_chunk_bytes}

    # -- registration and restore ---------------------------------------------

    def register(self, **objects: Any) -> int | None:
        """Register stateful objects by name and restore them if a checkpoint exists.

        Returns the restored step, or None on a fresh start.
        """
        for name, obj in objects.items():
            self.state.register(name, obj)
        objects = {name: self.state.objects[name] for name in objects}  # as registered (an Accelerator: its counter)
        self._hook_steps(objects)  # before the engine's post-hook, which may capture the state
        self.engine.bind(self.state)
        if not self._load_attempted:
            # The restore itself is the last check of a candidate: one that verifies but cannot
            # be restored into these objects is passed over for the one before (resume.load_newest).
            self._load(accept=lambda flat: self._restore(flat, objects))
        elif self._loaded is not None:
            self._restore(self._loaded, objects)
        return self.resumed_from

    def _restore(self, flat: Flat, objects: dict[str, Any]) -> None:
        """Put ``objects`` back from ``flat`` (and the loop's progress, on the first register())."""
        saved = flat.meta["objects"]
        missing = set(objects) - set(saved)
        if missing:
            raise ConfigError(f"checkpoint step {flat.meta.get('step')} under {self.root} has no state for "
                              f"{sorted(missing)}; it holds {sorted(n for n in saved if n != Progress.NAME)}")
        sub = TrainState()
        sub.objects.update(objects)
        with_progress = Progress.NAME in saved and not self._progress_restored  # the first register() of a resume
        if with_progress:
            sub.objects[Progress.NAME] = self.progress
        subset = Flat(flat.tensors, {**flat.meta, "objects": {n: v for n, v in saved.items() if n in sub.objects}})
        sub.restore(subset)
        self._progress_restored = self._progress_restored or with_progress
        self._put_grads(objects)
        self.state.user_meta.update(flat.meta.get("user", {}))
        self._resume_rng = rng_state()  # as saved; set again where training resumes (_resume_point)
        self._already_finished = self.progress.finished

    def _hook_steps(self, objects: dict[str, Any]) -> None:
        """Follow gradient accumulation (``_accumulated_grads``): each registered optimizer's
        steps, and the gradients reaching the first and last trained parameter of each
        registered module (two Python calls a backward, whatever the model's size)."""
        for name, obj in objects.items():
            if isinstance(obj, torch.optim.Optimizer):
                try:
                    stepping = stepping_optimizer(obj, name)
                except ConfigError:
                    continue  # a wrapper without hooks: the engine says so where it needs them
                if id(stepping) not in self._step_hooks:
                    self._step_hooks[id(stepping)] = stepping.register_step_post_hook(self._stepped)
            elif isinstance(obj, torch.nn.Module):
                trained = [p for p in obj.parameters() if p.requires_grad]
                for p in {id(p): p for p in trained[:1] + trained[-1:]}.values():
                    if id(p) not in self._grad_hooks and hasattr(p, "register_post_accumulate_grad_hook"):
                        self._grad_hooks[id(p)] = p.register_post_accumulate_grad_hook(self._accumulated)

    def _stepped(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._accumulating = False
        self._trained += 1

    def _accumulated(self, param: Any) -> None:
        self._accumulating = True
        self._trained += 1

    def _accumulated_grads(self) -> dict[str, dict[str, torch.Tensor]]:
        """The gradients of the registered modules when this boundary falls inside a gradient
        accumulation (a backward since a registered optimizer last stepped: a loop that steps
        every N batches): they are the partial sum the next batches add to, so a resume from
        here must have them. Empty at any other boundary (and without a registered optimizer)."""
        if not self._step_hooks or not self._accumulating:
            return {}
        out: dict[str, dict[str, torch.Tensor]] = {}
        for name, obj in self.state.objects.items():
            if isinstance(obj, torch.nn.Module):
                grads = {pname: p.grad for pname, p in obj.named_parameters()
                         if p.grad is not None and type(p.grad) is torch.Tensor}  # not a DTensor's
                if grads:
                    out[name] = grads
        return out

    def _put_grads(self, objects: dict[str, Any]) -> None:
        """After a resume inside a gradient accumulation: the registered modules get the gradients
        accumulated so far back (``_accumulated_grads``)."""
        back = []
        for name, obj in objects.items():
            saved = self.progress.restored_grads.pop(name, None)
            if not saved or not isinstance(obj, torch.nn.Module):
                continue
            back.append(name)
            params = dict(obj.named_parameters())
            for pname, grad in saved.items():
                p = params.get(pname)
                if p is None or p.shape != grad.shape or p.dtype != grad.dtype:
                    raise ConfigError(f"the checkpoint holds the gradient accumulated for {name}.{pname} "
                                      f"({tuple(grad.shape)}, {grad.dtype}), which {name} does not have as such; "
                                      "resume with the model that saved it")
                p.grad = grad.to(p.device, copy=True)
        if back:
            self._accumulating = True  # the accumulation goes on until the optimizer steps
            log.info("hpcckpt: resumed inside a gradient accumulation: the gradients accumulated since the last "
                     "optimizer step are back in %s", ", ".join(back))

    @property
    def user_meta(self) -> dict[str, Any]:
        """Small JSON metadata saved with every checkpoint (restored on resume)."""
        return self.state.user_meta

    def _load(self, accept: Callable[[Flat], None] | None = None) -> Flat | None:
        if self._load_attempted:
            return self._loaded
        self._load_attempted = True
        t0 = time.monotonic()
        if os.environ.get("HPCCKPT_CRIU_FALLBACK") == "fresh":
            # `hpcckpt run --mode criu --on-restore-failure fresh`: the user asked for a fresh start.
            log.warning("hpcckpt: HPCCKPT_CRIU_FALLBACK=fresh: not resuming from %s", self.root)
            return None
        fresh_ok = self.options.on_corrupt == "fresh"
        # Read straight into the live model/optimizer tensors where they match (no first touch of
        # new memory, no second copy: hdf5.read_tensors), unless a fresh start must stay possible:
        # then they only give shapes, devices and DTensor placements, and new memory is read.
        # The optimizers' parameter devices say where missing optimizer state belongs (GPU or host).
        self._fresh_ok = fresh_ok
        live = self._live_targets
        outcome, where = None, self.root
        if self.levels is not None:  # the fastest level holding the newest complete step
            found = level_restore.prepare(self.levels, self.ranks)
            if found is not None:
                step = found[0]
                outcome = load_newest(self.levels.local, self.ranks, into=live, on_skip=self._skipped,
                                      accept=accept, only_step=step)
                where, self.restored_level = self.levels.local, found[1]
                if outcome.flat is None:  # its damaged files mended from the partner copies, before an older level
                    found = level_restore.prepare(self.levels, self.ranks, verify=step)
                    if found is not None:
                        outcome = load_newest(self.levels.local, self.ranks, into=live, on_skip=self._skipped,
                                              accept=accept, only_step=step)
                        self.restored_level = found[1]
                if outcome.flat is None:
                    log.warning("hpcckpt: node-local step %d could not be restored; trying the shared level", step)
                    outcome, where, self.restored_level = None, self.root, None
        if outcome is None:
            outcome = load_newest(self.root, self.ranks, into=live, on_skip=self._skipped, accept=accept)
            if outcome.flat is not None and self.levels is not None:
                self.restored_level = level_restore.SHARED
        self._restore_s = time.monotonic() - t0
        if outcome.flat is not None:
            self._loaded = outcome.flat
            self.step = int(outcome.flat.meta["step"])
            self.resumed_from = self.committed_step = self.step
            level = f" ({self.restored_level} level)" if self.restored_level else ""
            log.warning("hpcckpt: resumed from step %d under %s%s (%.2fs)", self.step, where, level,
                        self._restore_s)
        else:
            for opt in self._initialized:  # a fresh start: the optimizers as they were, without state
                opt.state.clear()
            if outcome.damaged or outcome.unusable:
                self._nothing_restored(outcome, fresh_ok)
        return self._loaded

    def _live_targets(self) -> Any:
        """The live tensors a restore reads into; called once there is a checkpoint to read.

        Optimizers over DTensor (FSDP2) parameters get their state created first (a
        step with zero gradients and learning rate 0, as torch.distributed.checkpoint
        does), so that the restore fills DTensor shards in place instead of handing
        plain tensors to an optimizer that expects DTensors.
        """
        self._initialized = [obj for obj in self.state.objects.values()
                             if isinstance(obj, torch.optim.Optimizer) and init_dtensor_optimizer_state(obj)]
        return live_tensors(self.state.capture(step=self.step, plan=False).tensors, self.state.objects,
                            overwrite=not self._fresh_ok)

    def _skipped(self, step: int, problem: str) -> None:
        log.error("hpcckpt: skipping checkpoint step %d: %s", step, problem)
        if self.ranks.is_coordinator:
            self.ledger.append("skip_corrupt", step=step, problem=problem)

    def _nothing_restored(self, outcome: Outcome, fresh_ok: bool) -> None:
        """Every checkpoint is damaged: raise, unless the user asked for a fresh start (on_corrupt)."""
        seen = {d[0] for d in outcome.damaged}
        bad = sorted(outcome.damaged + [u for u in outcome.unusable if u[0] not in seen], reverse=True)
        listing = "; ".join(f"step {s}: {p}" for s, p in bad[:5])
        if outcome.refused is not None:  # every one refused alike: this job's code, not the checkpoints
            raise ConfigError(f"{outcome.refused.advice} (every checkpoint under {self.root} is refused the "
                              f"same way: steps {', '.join(str(s) for s, _ in outcome.damaged)})")
        if fresh_ok and not outcome.overwritten:
            log.warning("hpcckpt: no checkpoint under %s could be restored (%s); starting fresh as "
                        "on_corrupt='fresh' asks", self.root, listing)
            if self.ranks.is_coordinator:
                self.ledger.append("fresh_start", reason="every checkpoint damaged", steps=[s for s, _ in bad])
            return
        overwritten = (" (reading in place already overwrote the live model/optimizer tensors, so "
                       "start a new process)") if outcome.overwritten else ""
        raise CheckpointCorrupt(
            f"no checkpoint under {self.root} could be restored: {len(bad)} damaged ({listing}). Nothing was "
            f"loaded{overwritten}. See `hpcckpt verify {self.root} --all`; to start fresh, move the damaged "
            "step-* directories aside, or run with on_corrupt='fresh' (HPCCKPT_ON_CORRUPT=fresh).")

    def _job_info(self) -> dict[str, object]:
        return identity.current(self.cluster.env.environ).as_job(self.cluster.name)

    # -- the step loop ----------------------------------------------------------

    def steps(self, total_steps: int) -> Iterator[int]:
        """Yield step indices from the restored step to ``total_steps - 1``.

        After each yielded step (its optimizer step done) the boundary runs:
        periodic saves, and on a stop request the final save + requeue + exit.
        A run that resumes at or past ``total_steps`` says so and yields nothing.
        """
        self._begin()
        self._resume_point()
        self.progress.total = total_steps
        if self.step >= total_steps and self.resumed_from is not None:
            self._nothing_left(f"step {self.step} of total_steps={total_steps}")
        for s in range(self.step, total_steps):
            t0 = time.monotonic()
            yield s
            self.policy.observe_step(time.monotonic() - t0)
            self.step = s + 1
            self._boundary()
        self._finish()

    def loop(self, loader: Iterable[Any], total_steps: int, *, skip: str = "auto") -> Iterator[tuple[int, Any]]:
        """Yield ``(step, batch)`` across epochs of ``loader``, resuming mid-epoch exactly.

        Any DataLoader: ``shuffle=True`` with or without a generator, ``DistributedSampler``
        (its ``set_epoch`` is called at each new pass), a ``ResumableSampler``, an
        ``IterableDataset``. A resumed pass yields what the uninterrupted pass would
        have yielded from there on (``data.LoaderPosition``; ``skip`` says how).
        """
        pos = self._position(loader, None, skip=skip, set_epochs=True)
        it: Iterator[Any] | None = None
        for step in self.steps(total_steps):
            # The boundary (and so the state capture) ran inside next(): before this fetch.
            batch = _END if it is None else next(it, _END)
            if batch is _END:
                it, batch = _next_pass(pos)
                self.signals.guard_children()  # its workers may be the first of the process
            pos.took()
            yield step, batch

    def batches(self, loader: Iterable[Any], *, name: str | None = None, skip: str = "auto") -> Batches:
        """``loader`` for one epoch's training loop: ``for batch in ckpt.batches(loader):``.

        Each batch is one step; when the code asks for the next batch, the step's boundary
        runs (periodic save, or the stop: final save, requeue, exit 75). In a resumed run
        the interrupted epoch yields only the batches it had left, exactly those of the
        uninterrupted run (``data.LoaderPosition``). ``len()`` and other attributes are the
        loader's own, so it can be passed where the loader was. ``name`` tells loaders apart
        (default: the order in which they are first seen).
        """
        return Batches(self, loader, name=name, skip=skip)

    def epochs(self, *bounds: Any) -> Iterator[int]:
        """``for epoch in ckpt.epochs(E):`` (or ``epochs(1, E + 1)``, ``epochs(range(...))``).

        Resumes at the epoch in progress when the checkpoint was taken; the epoch's code runs
        as written (evaluation, ``scheduler.step()``, ``sampler.set_epoch``). When the last
        epoch ends, the final state is checkpointed and the run is marked finished; a re-run
        says so and yields nothing. An epoch that trains without ``batches``/``loop``/``step_done``
        (full-batch training) is one step, its end the step's boundary (``_epoch_was_a_step``).
        """
        epochs = _epoch_range(bounds)
        self._begin()
        first = (self.progress.epoch or 0) if self.resumed_from is not None else 0
        if self.resumed_from is not None and (self._already_finished or first >= len(epochs)):
            replay = self._already_finished and first < len(epochs)
            self._nothing_left(f"the end of training in epoch {first + 1} of {len(epochs)} (step {self.step})"
                               if replay else f"epoch {len(epochs) if self._already_finished else first} of "
                               f"{len(epochs)} (step {self.step})", replay=replay)
        for i in range(first, len(epochs)):
            self.progress.epoch = i
            self._last_epoch = i == len(epochs) - 1
            driven = self._driven
            try:
                yield epochs[i]
            except GeneratorExit:
                self._epochs_left(sys._getframe(), len(epochs))
                raise
            self._settle_owed(epoch_done=i)
            if self._driven == driven:
                self._epoch_was_a_step(i)
        self._last_epoch = False
        self.progress.epoch = len(epochs)
        self._finish()
        self.close()

    def _epochs_left(self, frame: FrameType, total: int) -> None:
        """The loop over ``epochs()`` was left inside an epoch (its generator closed there). By a
        ``break`` or ``return`` (early stopping): the run ended there, as at the last epoch's end
        (``_finish``: the final checkpoint, with nothing left for a re-run, and the guard of the
        code after the loop). By an exception: nothing (the script fails as it would have)."""
        if self._closed or not _left_by_loop(frame):
            return
        try:
            if self._owed == "count":
                self._count_step()
            self._owed = None
            self._last_epoch = False
            self.progress.epoch = total
            self._finish()
            self.close()
        except SystemExit as exc:  # a stop signal that came before the break: requeued by the guard
            # This runs while the generator is closed, where an exception would only be printed.
            self.close()
            flush_and_exit(exc.code if isinstance(exc.code, int) else EXIT_REQUEUE)
        except Exception:  # noqa: BLE001 - printed and ignored where it was raised (a closing generator)
            log.exception("hpcckpt: ending the run after the loop left ckpt.epochs() failed")

    def _epoch_was_a_step(self, i: int) -> None:
        """An epoch that ran no step boundary and opened no ``ckpt.batches`` pass (full-batch
        training: one optimizer step an epoch, as pytorch/examples' gcn and gat) is one step,
        and its end the step's boundary: periodic saves count epochs, and a stop (signal,
        time limit, maintenance) is taken there with the next epoch as the resume point.
        Before, such a loop never reached a boundary: a stop was recorded and never taken,
        and the job was killed with nothing saved since it started."""
        if not self._epoch_steps_logged:
            self._epoch_steps_logged = True
            log.info("hpcckpt: epoch %d ran no step of ckpt.batches/loop/step_done: each epoch counts as one "
                     "step (saves and stops at epoch ends)", i)
        self.progress.epoch = i + 1  # what a save here resumes at
        self.step_done()

    def _pass_ended(self) -> None:
        """A training pass of ``ckpt.batches`` has ended. When the code between the previous
        two passes (an evaluation, per-epoch work) took ``LONG_TAIL_S`` or more, this state is
        checkpointed now (every rank, when any measured so): a stop that comes during that code
        is only taken at the next step boundary, and a job killed before it would lose the
        epoch (with no periodic saves, the run). A resume from here runs the epoch's code again
        from its start, as after a stop at the epoch's last batch. In the last epoch of
        ``epochs()`` the run's end of training is checkpointed (``_training_ended``)."""
        self._tail_from = time.monotonic()
        if self._last_epoch:
            self._training_ended()
            return
        long_tail = self._tail_s is not None and self._tail_s >= LONG_TAIL_S
        if not self.ranks.max(int(long_tail)):
            return
        if self.committed_step == self.step or any(h.step == self.step for h in self._handles):
            return  # a periodic save of this step already
        log.info("hpcckpt: checkpointing the end of this epoch's training (step %d): the code between epochs "
                 "took %.0fs last time, and a stop during it waits for the next step", self.step, self._tail_s or 0)
        self.save()

    def _training_ended(self) -> None:
        """A training pass of the last epoch of ``epochs()`` ended (or the loop left it, a break at
        max_steps): this state, marked finished, is the run's final checkpoint. A re-run of the
        finished run (the requeue of a stop in the code after the loop, or the script started
        again) resumes here, trains nothing and runs the last epoch's code after its training
        again (its evaluation: what the code after the loop uses is set as in the uninterrupted
        run), then the code after the loop. A checkpoint of this step (a periodic one, or the one
        this run resumed from) is the same place already."""
        if self._already_finished:
            return
        if self.committed_step == self.step or any(h.step == self.step for h in self._handles):
            self._tail_step = self.step
            return
        self.progress.finished = True
        try:
            self._save_final()
            self._tail_step = self.step
        except (HpcckptError, OSError) as exc:
            log.error("hpcckpt: the checkpoint of the end of training (step %d) failed: %s", self.step, exc)
        finally:
            self.progress.finished = False

    def _left_pass(self, pos: Any, *, trained: bool, by_loop: bool) -> None:
        """The loop left a pass of ``ckpt.batches`` at a batch it had taken (the pass's generator
        was closed there, so that batch's boundary, which runs when the loop asks for the next
        batch, did not run). The pass is over (a resume of it yields nothing). When the batch was
        trained (a registered optimizer stepped, or a registered module accumulated gradients,
        since it was handed out; without those, it counts as trained) it is a step: by a
        ``break``/``return`` (a loop that ends at max_steps mid-epoch) it is counted now, so
        that the code after the loop sees ``ckpt.step`` right and the end of training is
        checkpointed with its true number, and its boundary (stop, periodic save) runs at the
        next boundary point (the epoch's end in ``epochs()``, or the next pass); by an exception
        it is counted there, if the script gets there."""
        pos.leave("left")
        try:
            if trained and not by_loop:
                self._owed = "count"
                return
            if trained:
                self._count_step()
                self._owed = "boundary"
            if by_loop:
                self._pass_ended()
        except Exception:  # noqa: BLE001 - printed and ignored where it was raised (a closing generator)
            log.exception("hpcckpt: the step of the batch the loop left ckpt.batches at could not be completed")

    def _count_step(self) -> None:
        """One more step done, without its boundary (``_left_pass``)."""
        now = time.monotonic()
        if self._last_step_t is not None:
            self.policy.observe_step(now - self._last_step_t)
        self._last_step_t = now
        self.step += 1
        self._trace_step()

    def _settle_owed(self, *, epoch_done: int | None = None) -> None:
        """The boundary of a step the loop left ``ckpt.batches`` at (``_left_pass``), at the next
        boundary point: the end of the epoch's code (``epoch_done``: a save here resumes at the
        next epoch) or the next pass. Not saved again where this step is already."""
        owed, self._owed = self._owed, None
        if owed is None:
            return
        if owed == "count":
            self._count_step()
        if epoch_done is not None:
            self.progress.epoch = epoch_done + 1
        again = self.committed_step == self.step or any(h.step == self.step for h in self._handles)
        self._boundary(trace=False, periodic=not again)

    def step_done(self) -> None:
        """One training step finished (a loop hpcckpt does not drive: ``while``, callbacks).

        Counts the step and runs its boundary: a periodic save, or on a stop request the
        final save, requeue and ``RequeueExit`` (exit 75). ``ckpt.step`` is the number of
        steps done (the restored one after ``register()``).
        """
        self._begin()
        self._resume_rng = None  # this loop's resume point was register() itself
        now = time.monotonic()
        if self._last_step_t is not None:
            self.policy.observe_step(now - self._last_step_t)
        self._last_step_t = now
        self.step += 1
        self._boundary()

    def _position(self, loader: Any, name: str | None, **options: Any) -> Any:
        """The saved pass of ``loader`` (``data.LoaderPosition``), by ``_loader_key``."""
        self._begin()  # the saved positions are restored there
        key = self._loader_key(loader, name)
        fresh = key not in self.progress.positions
        pos = self.progress.position(key, loader, **options)
        sampler = find_resumable(loader)
        pos.saves_sampler = sampler is not None and not any(o is sampler for o in self.state.objects.values())
        if fresh and sampler is not None and self.resumed_from is not None and not self._progress_restored:
            pos.load_state_dict({"passes": 1, "taken": 0})  # a checkpoint from before positions were saved
        return pos

    def _loader_key(self, loader: Any, name: str | None) -> str:
        """The name a loader's passes are saved under, the same in every run of the script.

        The same object is the same loader. Another object is named by ``name``, else by where
        the script hands it over (file and function of the first caller outside hpcckpt) and
        its order among the loaders that began a pass there in this epoch of ``epochs()``:
        a loader made anew each epoch (``ckpt.batches(range(...))``, a ``DataLoader`` or a
        ``tqdm`` built in the epoch's code) keeps its name from epoch to epoch and from run to
        run, two loaders trained in turn keep theirs. Before, a new object was the next
        ``loader<N>``: a resumed run gave its interrupted pass another loader's saved
        position (it trained none of that epoch's remaining batches, and skipped the next
        epoch's first ones), unless memory reuse happened to give the new object the old
        one's ``id``. Without ``epochs()`` a loader made anew each epoch needs ``name``.
        A run whose checkpoint names its loaders the old way keeps the old way."""
        if self._legacy_keys is None:
            saved = [k for k in self.progress.restored_loader_names() if k.startswith("loader")]
            self._legacy_keys = bool(saved) and all(k[6:].isdigit() for k in saved)
        known = self._loader_names.get(id(loader))
        if known is not None:
            pos = self.progress.positions.get(known)
            if self._legacy_keys or pos is not None and pos.loader is loader:
                self._use_key(known)
                return known
        quiet_workers(loader, self.signals.signals)  # before its workers start
        if name:
            key = name
        elif self._legacy_keys:
            key = f"loader{len(self._loader_names)}"
        else:
            site, used = _caller_site(), self._use_key(None)
            key = next(k for k in (f"{site}#{j}" for j in range(len(used) + 1)) if k not in used)
            if self.progress.epoch is None and not key.endswith("#0") and site not in self._sites_warned:
                self._sites_warned.add(site)
                log.warning("hpcckpt: %s hands ckpt.batches another loader object than before, and no ckpt.epochs() "
                            "loop tells its epochs apart: its passes are saved as another loader's (%s). Loaders "
                            "trained in turn need nothing; a loader made anew each epoch needs `for epoch in "
                            "ckpt.epochs(...)` or a name (ckpt.batches(loader, name=\"train\")), else a resumed run "
                            "resumes another pass than the one stopped", site, key)
        self._loader_names[id(loader)] = key
        self._use_key(key)
        return key

    def _use_key(self, key: str | None) -> set[str]:
        """The loader keys whose pass began in the current epoch (``key`` added)."""
        epoch = self.progress.epoch
        if self._keys_used[0] != epoch:
            self._keys_used = (epoch, set())
        if key is not None:
            self._keys_used[1].add(key)
        return self._keys_used[1]

    def _resume_point(self) -> None:
        """Training resumes here: the RNG becomes the saved one again, whatever ran since
        ``register()`` (a new DataLoader iterator, a peek, per-epoch setup) drew from it."""
        if self._resume_rng is not None:
            set_rng_state(self._resume_rng)
            self._resume_rng = None

    def _nothing_left(self, where: str, *, replay: bool = False) -> None:
        log.warning("hpcckpt: this run resumed at %s under %s: nothing left to train%s%s. To start fresh, move "
                    "%s aside or give another directory (dir=... or HPCCKPT_DIR)", where, self.root,
                    " (it finished before)" if self._already_finished else "",
                    "; the last epoch's code after its training (its evaluation) runs again, then the code after "
                    "the loop" if replay else "", self.root)
        if self.ranks.is_coordinator:
            self.ledger.append("nothing_left", step=self.step, where=where, finished=self._already_finished)

    def _begin(self) -> None:
        if self._started:
            return
        self._started = True
        self._load()
        if self.options.jit:  # collective: every rank starts it, after the restore
            from .jit import JitGuard
            self._jit = JitGuard(self)
            self._jit.start()
        started = process_start_time()
        self._startup_s = max(0.0, time.time() - started) if started is not None else None
        if self.ranks.is_coordinator:
            self.ledger.append("start", resumed_from=self.resumed_from, restore_s=round(self._restore_s, 6),
                               engine=self.options.engine, world_size=self.ranks.world,
                               process_start=started, level=self.restored_level)
        self._start_step = self.step
        if self._trace is not None and self.ranks.is_coordinator:
            from .check import append_trace
            append_trace(self._trace, {"dir": str(self.root), "resumed_from": self.resumed_from})
        self._warn_unsaved()
        self._check_time_left()

    def _warn_unsaved(self) -> None:
        """Log trained state that nothing registered saves (``coverage.unsaved``), once, on the
        coordinator; ``hpcckpt check`` then reports the run as not exact and names it."""
        if not self.ranks.is_coordinator:
            return
        from .coverage import unsaved
        self._report_unsaved(unsaved({n: o for n, o in self.state.objects.items() if n != Progress.NAME}))

    def _report_unsaved(self, lines: list[str]) -> None:
        """Log each line of what nothing saves and note it for ``hpcckpt check`` (coordinator)."""
        for line in lines:
            log.warning("hpcckpt: not saved: %s", line)
        if lines and self._trace is not None:
            from .check import append_trace
            append_trace(self._trace, {"note": "unsaved", "what": lines})

    def _note_loader_seed(self, signature: str) -> None:
        """hpcckpt check: an evaluation loader's workers drew their seed where the uninterrupted run's may not have."""
        if self._trace is not None and self.ranks.is_coordinator:
            from .check import append_trace
            append_trace(self._trace, {"note": "loader_seed", "what": signature})

    def _warn_loose_iterators(self) -> None:
        """At the first step of a run that takes no batch through ``ckpt.batches``/``loop``:
        name the DataLoader iterators the script keeps (``coverage.loose_loader_iterators``)."""
        if not self.ranks.is_coordinator:
            return
        from .coverage import loose_loader_iterators
        self._report_unsaved(loose_loader_iterators(self.state.objects))

    def report_loss(self, loss: Any) -> None:
        """Optional: this step's loss, compared step by step by ``hpcckpt check`` (else unused)."""
        if self._trace is not None:
            self._loss = float.hex(float(loss))

    def _trace_step(self) -> None:
        """hpcckpt check: one line per boundary with a digest of each part of the state (coordinator)."""
        from .check import append_trace, state_digests
        if self._trace is None or not self.ranks.is_coordinator:
            return
        flat = self.state.capture(step=self.step, plan=False)
        user_objects = {n: o for n, o in self.state.objects.items() if n != Progress.NAME}
        digests = {k: v for k, v in state_digests(user_objects, flat).items() if k != Progress.NAME}
        append_trace(self._trace, {"step": self.step, "digests": digests, "loss": self._loss})
        self._loss = None

    def _boundary(self, *, trace: bool = True, periodic: bool = True) -> None:
        self._driven += 1
        if self.step == self._start_step + 1 and not self.progress.positions and self.data_resumed_by is None:
            self._warn_loose_iterators()
        self.signals.guard_children()
        if self._jit is not None:
            self._jit.at_boundary(self.step)  # the small state of this boundary, for a JIT save
        if trace:
            self._trace_step()
        self._reap()
        new = self.signals.log_new()  # every rank logs what it received
        local, warned = self._signal_reason()
        for r in new:
            if self._deferred is not None and r.signum in WARNING_SIGNALS:
                continue  # recorded as signal_deferred: the deadline, not this signal, stops the run
            self.ledger.append("signal", signum=r.signum, signame=r.name, step=self.step,
                               rank=self.ranks.rank, signal_time=r.wall_s)
        if self.step in self._stop_at and self.step != self.resumed_from:
            log.warning("hpcckpt: stopping at step %d as HPCCKPT_STOP_AT_STEPS asks", self.step)
            local = StopReason.SIGNAL
        if local is StopReason.NONE and self.ranks.is_coordinator:
            self.policy.poll(self.cluster)
            local = self.policy.stop_reason()
        # One collective decides both: ranks judge a periodic save from their own timings
        # (every_steps="auto"), and a rank that saved alone would wait in the commit exchange.
        agreed = self.ranks.max(int(local) * 4 + int(warned) * 2 + int(periodic and self.policy.periodic_due(self.step)))
        reason = StopReason(agreed // 4)
        if agreed & 2:
            self._warned = True  # a rank holds a warning: the coordinator judges it at the next boundary
        if reason is not StopReason.NONE:
            self._stop(reason)
        elif agreed & 1:
            self.save()

    def save(self, *, final: bool = False, block: bool | None = None) -> SaveHandle:
        """Checkpoint the registered state as of ``self.step``. Collective on all ranks."""
        t0 = time.monotonic()
        flat = self.state.capture(step=self.step, extra=None)
        capture_s = time.monotonic() - t0  # state_dict() and co.: before the engine's save_s starts
        handle = self.engine.save(flat, self.step, final=final)
        handle.final = final
        handle.capture_s = capture_s
        handle.stall_s = time.monotonic() - t0  # the part training waited for (engines may add to it)
        self.policy.saved_at(self.step)
        self._handles.append(handle)
        if final or block:
            self._settle(handle)
        return handle

    def _settle(self, handle: SaveHandle) -> None:
        """Account for one finished save: a commit moves ``committed_step``; a failure raises.

        A failure is recorded as ``save_failed`` (never as a ``commit``), whoever saw the
        handle's error first (an engine may have waited on it already).
        """
        if handle in self._handles:
            # Engines commit in step order: the older saves still listed are accounted for first,
            # so committed_step and the ledger follow the commits (a final save settled at once
            # must not be followed by an older periodic one moving committed_step back).
            self._settle_quietly(self._handles[:self._handles.index(handle)])
            self._handles.remove(handle)
        try:
            handle.wait()
        except Exception:
            pass  # read back below, whether or not this was the first wait
        if handle.error is not None or handle.path is None:
            error = handle.error or CheckpointFailed(f"checkpoint of step {handle.step} under {self.root} "
                                                     "produced no checkpoint")
            log.error("hpcckpt: checkpoint of step %d failed: %s", handle.step, error)
            if self.ranks.is_coordinator:
                self.ledger.append("save_failed", step=handle.step, error=str(error), final=handle.final)
            raise error
        self.committed_step = handle.step
        if handle.save_s is not None:
            self.policy.observe_save(handle.save_s, getattr(handle, "stall_s", None),
                                     capture_s=getattr(handle, "capture_s", 0.0))
        if self.ranks.is_coordinator:
            self.ledger.append("commit", durable=handle.final, step=handle.step, save_s=handle.save_s,
                               engine=self.options.engine,
                               stall_s=getattr(handle, "stall_s", None), final=handle.final,
                               path=str(handle.path), **self.policy.report())
            self.figures.save_s, self.figures.step_s = self.policy.save_cost_s, self.policy.step_s
            # Not at every commit; a final one writes any change (so does close()).
            self.figures.write_if_moved(self.root, any_change=handle.final)

    def _settle_quietly(self, handles: list[SaveHandle]) -> None:
        """Settle each; a failed one is already logged and recorded, and training goes on."""
        for h in handles:
            try:
                self._settle(h)
            except Exception:  # noqa: BLE001 - reported by _settle; the previous checkpoint stands
                pass

    def _reap(self) -> None:
        """Account for finished background saves; a failed one is reported once and training goes on."""
        self._settle_quietly([h for h in self._handles if h.done()])

    def _save_final(self) -> None:
        """``save(final=True)``, tried once more if it fails (either engine; a ConfigError is not
        retried: it would fail the same way). Collective: a failed save fails on every rank."""
        try:
            self.save(final=True)
        except ConfigError:
            raise
        except (HpcckptError, OSError) as exc:
            log.warning("hpcckpt: the final checkpoint of step %d failed (%s); trying once more", self.step, exc)
            self.save(final=True)

    def _final_save(self) -> str | None:
        """The stop's checkpoint: None when it is durable, else why it failed (the previous
        committed one then stands)."""
        self._settle_quietly(list(self._handles))  # older saves first, so the final one is the newest
        if self.committed_step == self.step:
            return None
        try:
            self._save_final()
            return None
        except (HpcckptError, OSError) as exc:
            prev = (f"the previous committed checkpoint, step {self.committed_step}" if self.committed_step
                    is not None else "the beginning (no checkpoint was ever committed)")
            log.error("hpcckpt: the final checkpoint of step %d failed twice (%s); requeueing anyway: the job "
                      "resumes from %s", self.step, exc, prev)
            return str(exc)

    def _stop(self, reason: StopReason, *, save: bool = True) -> None:
        """Stop: the final checkpoint (unless ``save`` is False: nothing was trained that a
        checkpoint should keep), the ledger, the requeue decision, then ``RequeueExit``."""
        first = self.signals.first() if reason is StopReason.SIGNAL else None  # a deferred warning did not stop it
        log.warning("hpcckpt: stopping at step %d (%s)%s", self.step, reason.name.lower(),
                    "; taking the final checkpoint" if save else "")
        final_error = self._final_save() if save else None
        refusal = self._no_progress(reason)
        requeue = refusal is None
        if self.ranks.is_coordinator:
            extra: dict[str, Any] = {} if final_error is None else {"final_error": final_error}
            self.ledger.append("stop", reason=reason.name.lower(), step=self.step, committed_step=self.committed_step,
                               requeue=requeue, final_saved=save and final_error is None,
                               signame=first.name if first else None,
                               signal_time=first.wall_s if first else None, **extra)
        if refusal is not None:
            self._refuse(refusal)
        outcome: dict[str, Any] = {}
        if self.ranks.is_coordinator:
            self._keep_figures()  # before the requeue: Slurm may end the job right after it
            outcome = self._requeue(reason)
        self.ranks.broadcast_json(outcome)
        self.close()
        raise RequeueExit(reason.name.lower(), self.step)

    def _signal_reason(self) -> tuple[StopReason, bool]:
        """(SIGNAL, _) for a TERM-like signal or a warning that cannot wait. A warning long before
        the deadline leaves the stop to the deadline; the coordinator judges it from the end
        time (another rank's warning reaches it through the boundary's collective: ``True``)."""
        received = self.signals.received
        if any(r.signum not in WARNING_SIGNALS for r in received):
            return StopReason.SIGNAL, False
        if not (received or self._warned):
            return StopReason.NONE, False
        if not self.ranks.is_coordinator:
            return StopReason.NONE, self._deferred is None
        if self._deferred is None:
            why = self.policy.defer_warning(self.cluster)
            if why is None:
                return StopReason.SIGNAL, False
            self._deferred = why
            name = received[0].name if received else "a warning signal (another rank)"
            log.warning("hpcckpt: %s received %s", name, why)
            self.ledger.append("signal_deferred", step=self.step, signame=name, detail=why)
        return StopReason.NONE, False

    def _no_progress(self, reason: StopReason) -> str | None:
        """After a deadline stop: why requeueing would livelock (None: requeue).

        Counts the allocations in a row that ended at their deadline without a newer
        committed step (kept in the figures file); at the second one the job stops."""
        if reason is not StopReason.DEADLINE or not self.ranks.is_coordinator:
            return None
        progressed = self.committed_step is not None and self.committed_step > self._start_step
        self.figures.no_progress = 0 if progressed else self.figures.no_progress + 1
        self.figures.write(self.root)
        if self.figures.no_progress < 2:
            return None
        startup = f"; this run's start-up took {self._startup_s:.0f}s" if self._startup_s is not None else ""
        return (f"two allocations in a row reached their deadline without progress (step {self.step}); "
                f"each stops {self.policy.lead_figures()} before its end time{startup}. Give the job a longer "
                "time limit (--time), or lower deadline_margin_s (HPCCKPT_DEADLINE_MARGIN_S)")

    def _refuse(self, why: str) -> None:
        """Stop without a requeue (it would come back to the same end): exit 1 with the figures."""
        why = self.ranks.broadcast_json(why)
        log.error("hpcckpt: not requeueing: %s", why)
        if self.ranks.is_coordinator:
            self.ledger.append("refused", step=self.step, reason=why)
        self.close()
        raise RefusedExit(why, self.step)

    def _check_time_left(self) -> None:
        """At the start, with less time left than the stop needs (nothing could be trained):
        when even a process that started at once would have had too little, no allocation
        this long can train: refuse (exit 1, no requeue). When this run's own start-up took
        the time (a slow file system, a loaded node), the next allocation may well train: stop
        as at a deadline without progress, which requeues once and refuses at the second
        such allocation in a row (``_no_progress``)."""
        verdict: list[str] | None = None
        if self.ranks.is_coordinator:
            self.policy.poll(self.cluster, force=True)
            if self.policy.time_left() is not None and not self.policy.measured:
                self._estimate_save()
            left, lead = self.policy.time_left(), self.policy.lead_s()
            if left is not None and left < lead:
                startup = self._startup_s or 0.0
                if left + startup < lead:
                    verdict = ["refuse", (
                        f"this allocation has {left:.0f}s left, less than the stop needs before the end time "
                        f"({self.policy.lead_figures()}, measured by earlier runs); nothing could be trained. "
                        "Give the job a longer time limit (--time), or lower deadline_margin_s "
                        "(HPCCKPT_DEADLINE_MARGIN_S)")]
                else:
                    verdict = ["stop", (
                        f"this run's start-up took {startup:.0f}s of its allocation: {left:.0f}s are left, less "
                        f"than the stop needs before the end time ({self.policy.lead_figures()}); stopping "
                        "without training (a second allocation in a row without progress stops the job)")]
        verdict = self.ranks.broadcast_json(verdict)
        if verdict is None:
            return
        if verdict[0] == "refuse":
            self._refuse(verdict[1])
        log.warning("hpcckpt: %s", verdict[1])
        # Nothing to save: a resumed run stands at its committed step, and a fresh one has at
        # most the first step of a step_done() loop in memory (labelled step 0, a checkpoint of
        # it would be wrong); the next allocation starts from the same place.
        self._stop(StopReason.DEADLINE, save=False)

    def _estimate_save(self) -> None:
        """No save was measured yet (the first allocation) and the end time is known: the stop's
        reserve comes from this state's size and the checkpoint directory's rate, measured now
        (``policy.estimate_save_s``), not from the assumed ``save_cost_s`` default (10 s, which
        made a 1-minute allocation stop without training for a 0.02 s save, and is too little
        for a state of tens of GB). The first save measured replaces the estimate."""
        try:
            flat = self.state.capture(step=self.step)  # what this rank writes (aliases, no copy)
            nbytes = sum(t.numel() * t.element_size() for t in flat.tensors.values())
            save_s, rate = estimate_save_s(self.root, nbytes)
        except (OSError, HpcckptError) as exc:
            log.warning("hpcckpt: could not measure the checkpoint directory's write rate (%s); the stop's reserve "
                        "assumes a %.0fs save until one is measured", exc, self.policy.save_cost_s)
            return
        self.policy.assume_save(save_s)
        log.info("hpcckpt: no save measured yet: the final save of this state (%.1f MB) is estimated at %.2fs "
                 "(%.0f MB/s measured under %s); the stop comes %s before the end time", nbytes / 1e6, save_s,
                 rate / 1e6, self.root, self.policy.lead_figures())

    def _requeue(self, reason: StopReason) -> dict[str, Any]:
        """The lifecycle's requeue (coordinator only; it records the outcome); exit 75 follows either way."""
        # A deadline that came from a pulled-in end time is what Slurm does at a GraceTime
        # preemption; the cluster's record (PreemptTime) confirms it or makes it a shortened limit.
        cause = Cause.PREEMPTION if reason is StopReason.DEADLINE and self.policy.end_moved_earlier else reason.cause
        return _requeue_logged(self.cluster, self.root, self.ledger, cause, self.committed_step,
                               within_s=self.policy.time_left())

    def _finish(self) -> None:
        """The run ended: its final state is checkpointed (a re-run then says it finished)."""
        self._settle_quietly(list(self._handles))
        # A run with checkpoints (or an epoch loop, whose resume would run the last epoch's end
        # again) keeps its final state: a re-run then resumes there and says it finished.
        if not self._already_finished and self._tail_step == self.step == self.committed_step:
            # The last epoch's end of training is the final checkpoint (``_training_ended``): a re-run
            # runs that epoch's code after its training again, then the code after the loop.
            self.progress.finished = True
        elif not self._already_finished and (self.committed_step is not None or self.progress.epoch is not None):
            self.progress.finished = True
            try:
                self._save_final()
            except (HpcckptError, OSError) as exc:
                log.error("hpcckpt: the checkpoint of the finished run (step %d) failed: %s", self.step, exc)
        if self.ranks.is_coordinator:
            self.ledger.append("stop", reason="done", step=self.step, committed_step=self.committed_step, requeue=False)
        self._guard_after_run()

    def _guard_after_run(self) -> None:
        """From the run's end to the process's exit a stop signal requeues the job (``AfterRun``):
        the code after the training loop has no step boundary, and the next run, resuming at
        the final checkpoint, finds the run finished and runs that code again. A time-limit
        warning waits as it does in the run (the policy's ``defer_warning``: the end time is
        known, further than the stop's lead and within the warning window); TERM does not. A
        stop signal that came after the last step's boundary (a warning the run deferred aside)
        is judged at once. Not when the run kept no checkpoint (it saved none, so it keeps no
        final state either): a requeue would train it all again."""
        if self.committed_step is None:
            return
        late = next((r for r in self.signals.received if r.signum not in WARNING_SIGNALS), None)
        if late is None and self._deferred is None and self.ranks.is_coordinator:
            # A warning the last boundary did not see (the coordinator judges warnings in the
            # run; another rank leaves a warning it got to the coordinator's judgement there).
            late = next(iter(self.signals.received), None)
        self.signals.uninstall()
        # The guard holds what the requeue needs, not the Checkpointer: a script that goes on to
        # load another model must not keep this run's model and optimizer alive through it.
        stop = functools.partial(_stopped_after_run, step=self.step, committed_step=self.committed_step,
                                 coordinator=(self.ledger, self.cluster, self.root) if self.ranks.is_coordinator
                                 else None)
        guard = AfterRun(self.options.signals, stop,
                         may_wait=functools.partial(_warning_may_wait, self.policy, self.cluster))
        if guard.install() and late is not None:
            guard.fire(late)

    # -- lifecycle ---------------------------------------------------------------

    def _keep_figures(self) -> None:
        """The coordinator writes the figures that ``write_if_moved`` left for later."""
        if self.ranks.is_coordinator and self.figures.unwritten:
            self.figures.write(self.root)

    def close(self) -> None:
        """Release everything (idempotent): background saves finish first, the writer lease last."""
        if self._closed:
            return
        self._closed = True
        self._keep_figures()  # first: the JIT guard's close may end the process
        if self._jit is not None:  # first: a failure it saw ends the process here, with exit 75
            jit, self._jit = self._jit, None
            jit.close()
        self.engine.close()  # first: its finisher thread uses the background group
        for hook in (*self._step_hooks.values(), *self._grad_hooks.values()):
            hook.remove()
        self._step_hooks.clear()
        self._grad_hooks.clear()
        self.ranks.close()
        self.signals.uninstall()
        self.progress.worker_seeds.uninstall()
        self._lease.release()  # last: saves in flight are durable before another writer may start

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


def _warning_may_wait(policy: Policy, cluster: Cluster, got: Received) -> str | None:
    """After the run: why ``got`` need not stop the script yet (a time-limit warning that can
    wait, as in the run); None for TERM and for a warning that cannot."""
    return policy.defer_warning(cluster) if got.signum in WARNING_SIGNALS else None


def _stopped_after_run(got: Received, *, step: int, committed_step: int | None,
                       coordinator: tuple[Ledger, Cluster, Path] | None) -> None:
    """A stop signal after the run finished (``Checkpointer._guard_after_run``): the coordinator
    records it and requeues the job; every rank exits 75."""
    log.warning("hpcckpt: received %s after the run's last step (step %d, committed): the code after the "
                "training loop is stopped and the job requeued; the next run finds the run finished and runs "
                "that code again", got.name, step)
    if coordinator is not None:
        ledger, cluster, root = coordinator
        ledger.append("stop", reason="after_run", step=step, committed_step=committed_step, requeue=True,
                      final_saved=True, signame=got.name, signal_time=got.wall_s)
        _requeue_logged(cluster, root, ledger, StopReason.SIGNAL.cause, committed_step)
    if _script_returned():
        # The script has returned: the interpreter is joining its threads or running atexit
        # callbacks, where a SystemExit is printed and ignored and the process would exit 0,
        # so the requeue just recorded would not happen where exit 75 is how it is made (a
        # local supervisor). End here with 75, as a stop inside the script would.
        flush_and_exit(EXIT_REQUEUE)
    raise RequeueExit("after_run", step)


def _script_returned() -> bool:
    """Whether the interpreter is past the script's last line. The main thread is marked
    stopped only near the end of ``threading._shutdown`` (after the threading atexit calls,
    e.g. joining executors' workers), so a signal handled before that also looks for the
    ``_shutdown`` frame on the interrupted stack."""
    if not threading.main_thread().is_alive():
        return True
    shutdown = getattr(threading, "_shutdown", None)
    code = getattr(shutdown, "__code__", None)
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def _caller_site() -> str:
    """``file.py:function`` of the innermost caller outside hpcckpt (where a loader is handed over)."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and str(frame.f_globals.get("__name__", "")).partition(".")[0] == "hpcckpt":
        frame = frame.f_back
    if frame is None:
        return "?"
    code = frame.f_code
    return f"{os.path.basename(code.co_filename)}:{getattr(code, 'co_qualname', code.co_name)}"


def _requeue_logged(cluster: Cluster, root: Path, ledger: Ledger, cause: str,
                    committed_step: int | None, *, within_s: float | None = None) -> dict[str, Any]:
    """The lifecycle's requeue on the Checkpointer's behalf, its decision logged."""
    outcome = requeue(cluster=cluster, state_dir=root, cause=cause, committed_step=committed_step, ledger=ledger,
                      source="checkpointer", within_s=within_s).as_dict()
    log.warning("hpcckpt: requeue decision: %s", outcome)
    return outcome


_END: Any = object()


def _epoch_range(bounds: tuple[Any, ...]) -> range:
    """``epochs(E)``, ``epochs(start, stop)`` or ``epochs(range(...))`` -> a range."""
    if len(bounds) == 1 and isinstance(bounds[0], range):
        return bounds[0]
    try:
        return range(*(int(b) for b in bounds))
    except (TypeError, ValueError):
        raise ConfigError(f"Checkpointer.epochs{bounds!r}: give a number of epochs, start and stop, or a "
                          "range, e.g. ckpt.epochs(10) or ckpt.epochs(1, args.epochs + 1)") from None


def _next_pass(pos: Any) -> tuple[Iterator[Any], Any]:
    """The next pass's iterator and first batch; a resumed pass that had ended gives way to a new one."""
    for _ in range(2):
        resumed = pos.pending
        it = pos.open()
        batch = next(it, _END)
        if batch is not _END:
            return it, batch
        if not resumed:
            break
    raise ConfigError(f"the DataLoader given to Checkpointer.loop yields no batch (pass {pos.passes}); "
                      "check its dataset, batch_size and drop_last")


class Batches:
    """One epoch of a loader as the training loop sees it (``Checkpointer.batches``).

    Iterating it opens the loader's training pass (resumed or new), yields its batches and
    runs a step boundary each time the loop asks for the next one. Everything else
    (``len()``, ``.dataset``, ``.batch_size``) is the loader's own.
    """

    def __init__(self, ckpt: Checkpointer, loader: Iterable[Any], *, name: str | None, skip: str) -> None:
        self._ckpt, self._loader, self._name, self._skip = ckpt, loader, name, skip

    def __len__(self) -> int:
        return len(self._loader)  # type: ignore[arg-type]  # a loader without len() raises TypeError, as its own would

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._loader, attr)

    def __iter__(self) -> Iterator[Any]:
        mine: list[Any] = []  # a weak reference to the pass itself, for _warn_if_enumerated
        it = self._pass(None, mine)
        mine.append(weakref.ref(it))
        return it

    @property
    def start(self) -> int:
        """The number of batches of this epoch trained before the stop when the epoch resumes
        (the number its first batch had in the uninterrupted run), else 0: for a loop that
        numbers the batches a wrapper of its own yields, ``enumerate(log_every(batches),
        start=batches.start)``. Read it before the epoch's pass begins."""
        pos = self._ckpt._position(self._loader, self._name, skip=self._skip)
        return pos.taken if pos.pending else 0

    def enumerate(self, start: int = 0) -> Iterator[tuple[int, Any]]:
        """``enumerate(batches, start)`` numbered as in the uninterrupted run: in a resumed
        epoch the first batch gets the index it had there (``start`` plus the batches trained
        before the stop), where ``enumerate()`` would count from ``start`` again."""
        return self._pass(start, None)

    def _pass(self, start: int | None, mine: list[Any] | None) -> Iterator[Any]:
        ck = self._ckpt
        ck._settle_owed()  # the loop left the previous pass at a step whose boundary is still to run
        ck._driven += 1  # an epoch of ckpt.epochs() that opens a pass is not itself a step, even if it is empty
        pos = ck._position(self._loader, self._name, skip=self._skip)  # begins the run first (the restore)
        ck._resume_point()
        resumed = pos.pending
        it = pos.open()
        if not resumed:
            pos.in_epoch = ck.progress.epoch
        ck.signals.guard_children()  # its workers may be the first of the process (torch's SIGCHLD handler)
        ck._last_step_t = time.monotonic()
        if ck._tail_from is not None:
            ck._tail_s, ck._tail_from = ck._last_step_t - ck._tail_from, None
        if mine and pos.taken and pos.over is None:
            _warn_if_enumerated(ck, mine[0](), pos.taken, self._loader)
        mark = ck._trained
        try:
            for batch in it:
                index = pos.taken
                pos.took()
                mark = ck._trained
                yield batch if start is None else (start + index, batch)
                ck.step_done()
        except GeneratorExit:  # the loop left the pass at this batch (a break), or an exception did
            ck._left_pass(pos, trained=ck._trained != mark or not (ck._step_hooks or ck._grad_hooks),
                          by_loop=_left_by_loop(sys._getframe()))
            raise
        pos.leave("end")
        ck._pass_ended()


# What the frame that drops a generator is doing when a loop over it ended without an exception:
# popping the loop's iterator (a break or a return inside the loop: POP_TOP, or POP_ITER from 3.14),
# or finding that an iterator wrapping it stopped (itertools.islice: FOR_ITER, END_FOR).
_LOOP_LEFT_OPS = frozenset(dis.opmap[n] for n in ("POP_TOP", "POP_ITER", "END_FOR", "FOR_ITER") if n in dis.opmap)
_SUSPENDED_OPS = frozenset(dis.opmap[n] for n in ("YIELD_VALUE", "SEND") if n in dis.opmap)


def _left_by_loop(frame: FrameType) -> bool:
    """Whether the generator running in ``frame`` (in its ``except GeneratorExit``) is closed
    because a loop over it ended without an exception: a ``break`` or ``return`` inside the loop,
    or a wrapper that stopped (``islice``), possibly through generators of the script that are
    closed with it. False for an exception that unwinds the loop (its iterator is dropped then
    too), an explicit ``close()``, or a collection at another point: told by the instruction the
    frame that dropped it was at."""
    f = frame.f_back
    for _ in range(64):
        if f is None:
            return False
        code, at = f.f_code.co_code, f.f_lasti
        if not 0 <= at < len(code):
            return False
        if code[at] in _SUSPENDED_OPS and f.f_code.co_flags & (inspect.CO_GENERATOR | inspect.CO_ASYNC_GENERATOR):
            f = f.f_back  # a wrapper generator of the script, closed with it
            continue
        return code[at] in _LOOP_LEFT_OPS
    return False


def _next_index(e: enumerate) -> int | None:
    """The number an ``enumerate`` gives its next item (its ``start`` before its first)."""
    try:
        return int(e.__reduce__()[1][1])
    except (TypeError, IndexError, ValueError):
        return None


def _enumerated(it: Any, taken: int) -> str | None:
    """Whether an ``enumerate()`` numbers the batches of the pass ``it``: wrapping it, or a
    generator that runs on top of it in this call (torchvision references' ``MetricLogger.log_every``,
    ``tqdm``). The wrappers are running, so their hold on the pass is on their value stacks,
    which the collector does not see: they are told by their code objects on the call stack.
    One that counts from ``taken`` (``enumerate(..., start=batches.start)``) numbers them right."""
    import gc
    import sys
    import types
    if any(type(r) is enumerate and _next_index(r) != taken for r in gc.get_referrers(it)):
        return "direct"
    running: set[types.CodeType] = set()
    frame = sys._getframe(2)  # the pass itself (_pass, via _warn_if_enumerated); what runs it is above
    for _ in range(16):  # the generators between the pass and the loop that numbers the batches
        frame = frame.f_back  # type: ignore[assignment]  # None ends the walk below
        if frame is None:
            break
        if frame.f_code.co_flags & (inspect.CO_GENERATOR | inspect.CO_ASYNC_GENERATOR):
            running.add(frame.f_code)
    if not running:
        return None
    for obj in gc.get_objects():
        if type(obj) is not enumerate or _next_index(obj) == taken:
            continue
        inner = gc.get_referents(obj)
        if any(type(g) is types.GeneratorType and g.gi_running and g.gi_code in running for g in inner):
            return "wrapped"
    return None


def _warn_if_enumerated(ck: Checkpointer, it: Any, taken: int, loader: Any) -> None:
    """A resumed epoch iterated through ``enumerate()``: its count starts at 0 again, ``taken``
    batches short of the uninterrupted run's, so code that depends on it (sampling from the
    model in train mode every N batches: BatchNorm statistics) diverges silently. Found once
    a resumed pass, at its first batch, among the objects that refer to the pass (~17 ms for
    170,000 objects) and, when generators of the script run it, among every enumerate
    (``_enumerated``: one ``gc.get_objects()`` more)."""
    how = _enumerated(it, taken) if it is not None else None
    if how is None:
        return
    try:
        of = f" of {len(loader)}"
    except TypeError:
        of = ""
    log.warning("hpcckpt: this epoch resumes at its batch %d%s, but the loop numbers its batches with "
                "enumerate(), which counts from 0 again: code that depends on that number (logging or "
                "sampling every N batches, an i == 0 branch) runs at other batches than in the uninterrupted "
                "run, and where that code changes the model (a forward pass in train mode updates BatchNorm "
                "statistics) the run diverges. %s", taken, of,
                "Number them with `for i, batch in ckpt.batches(loader).enumerate():` (the uninterrupted run's "
                "numbers)" if how == "direct" else
                "It numbers what a generator of the script yields from ckpt.batches(loader) (a logger's "
                "log_every, tqdm): start its count where the epoch resumes, `batches = ckpt.batches(loader)` "
                "then `enumerate(wrapper(batches), start=batches.start)`")
    if ck._trace is not None and ck.ranks.is_coordinator:
        from .check import append_trace
        append_trace(ck._trace, {"note": "enumerate", "taken": taken})


def preemptible(fn: F | None = None, /, **checkpoint_options: Any) -> Any:
    """Decorate ``train(ckpt, *args, **kwargs)``: it receives a ready ``Checkpointer``.

    Options are those of ``Checkpointer`` (``dir``, ``engine``, ``every_steps``, ``keep``,
    ``signals``...); ``HPCCKPT_*`` variables fill what is not given. On a stop the
    process exits with ``EXIT_REQUEUE`` after the final checkpoint is durable.
    """
    def wrap(f: F) -> F:
        @functools.wraps(f)
        def run(*args: Any, **kwargs: Any) -> Any:
            with Checkpointer(**checkpoint_options) as ckpt:
                return f(ckpt, *args, **kwargs)
        return run  # type: ignore[return-value]  # wraps(f) keeps f's signature at run time; mypy cannot see it
    return wrap(fn) if fn is not None else wrap
