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

The ``Checkpointer`` is a facade: its parts live in ``hpcckpt.checkpointer`` (options and
lease, restore, gradient accumulation, loader identity, passes, saves, the check's trace),
and when and why a run stops in ``hpcckpt.lifecycle.stop``.
"""
from __future__ import annotations

import functools
import logging
import os
import sys
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from .checkpointer import setup
from .checkpointer.accumulation import Accumulation
from .checkpointer.driven import Driven
from .checkpointer.loaders import END, LoaderKeys, left_by_loop, next_pass, warn_if_enumerated
from .checkpointer.passes import Passes
from .checkpointer.restore import Restore
from .checkpointer.saves import Saves
from .checkpointer.trace import Trace
from .cluster.base import Cluster
from .config import CheckpointOptions, env_value, resolve_options
from .data import LoaderPosition, Progress
from .engines import SaveHandle
from .errors import ConfigError, HpcckptError
from .exitcodes import EXIT_REQUEUE
from .lifecycle import identity
from .lifecycle.ledger import Ledger, process_start_time
from .lifecycle.records import record_start
from .lifecycle.stop import RefusedExit, RequeueExit, Run, Stop
from .policy import StopReason
from .ranks import Ranks
from .signals import SignalRecorder

if TYPE_CHECKING:
    from .jit import JitGuard

log = logging.getLogger("hpcckpt")

F = TypeVar("F", bound=Callable[..., Any])

__all__ = ["EXIT_REQUEUE", "Batches", "Checkpointer", "RefusedExit", "RequeueExit", "preemptible"]


def _detect_cluster() -> Cluster:
    from .cluster import detect
    return detect()


class Checkpointer:
    """Registers train state, restores it, saves it at step boundaries, stops on signals.

    Runs on every rank; saving and agreement are collective when torch.distributed is
    initialised (create the Checkpointer after ``init_process_group``).
    """

    def __init__(self, dir: str | os.PathLike[str] | None = None, *, options: CheckpointOptions | None = None,
                 cluster: Cluster | None = None, **overrides: Any) -> None:
        self.options = options or resolve_options(dir, **overrides)
        self.root = self.options.dir
        self.ranks = Ranks()
        self.cluster: Cluster = cluster if cluster is not None else _detect_cluster()
        self.state = setup.train_state(self.options, self.ranks)
        self.ledger = Ledger(self.root)
        self.policy, self.figures = setup.stop_policy(self.options, self.cluster, self.root)
        self.signals = SignalRecorder(self.options.signals)
        self._stop = Stop(ranks=self.ranks, ledger=self.ledger, cluster=self.cluster, root=self.root,
                          policy=self.policy, figures=self.figures, signals=self.signals,
                          stop_at=env_value("stop_at_steps", ()), close=self.close)
        self.step = 0
        self.resumed_from: int | None = None
        self.progress = Progress()  # epoch, loader passes, finished: saved as "__progress__"
        self.state.objects[Progress.NAME] = self.progress
        self._accumulation = Accumulation(self.state)
        self.progress.grads = self._accumulation.grads
        self._trace = Trace(setup.check_trace(), coordinator=self.ranks.is_coordinator)
        self._keys = LoaderKeys(self.progress, self.state, self.signals.signals)
        self._passes = Passes(self)
        # A trainer whose own loop resumes its data (set by the integrations): no loose-iterator warning.
        self.data_resumed_by: str | None = None
        self._start_step = 0
        self._startup_s: float | None = None  # process start to the first boundary's setup (_begin)
        self._jit: JitGuard | None = None  # with jit=True, from the first step on
        self._started = self._closed = False
        me = identity.current()
        self._lease = setup.take_lease(self.root, me, self.ranks, self.ledger)
        try:
            self.levels, self.engine = setup.open_engine(self.options, self.ranks, self.cluster, me)
        except BaseException:
            self._lease.release()
            raise
        self._saves = Saves(state=self.state, engine=self.engine, policy=self.policy, figures=self.figures,
                            ledger=self.ledger, ranks=self.ranks, root=self.root, engine_name=self.options.engine)
        self._restore = Restore(root=self.root, ranks=self.ranks, ledger=self.ledger, levels=self.levels,
                                state=self.state, progress=self.progress, on_corrupt=self.options.on_corrupt,
                                accumulation=self._accumulation)
        self.signals.install()
        self.progress.worker_seeds.install()  # until close(): the seeds evaluation loaders' workers take
        self.progress.worker_seeds.on_unsure = self._trace.loader_seed

    @property
    def committed_step(self) -> int | None:
        """The newest committed checkpoint's step (None: none yet)."""
        return self._saves.committed_step

    @committed_step.setter
    def committed_step(self, step: int | None) -> None:  # a just-in-time checkpoint committed (jit)
        self._saves.committed_step = step

    @property
    def restored_level(self) -> str | None:
        """The level the resume read (node-local, partner or shared; None without levels)."""
        return self._restore.restored_level

    # -- registration and restore ---------------------------------------------

    def register(self, **objects: Any) -> int | None:
        """Register stateful objects by name and restore them if a checkpoint exists.

        Returns the restored step, or None on a fresh start.
        """
        for name, obj in objects.items():
            self.state.register(name, obj)
        objects = {name: self.state.objects[name] for name in objects}  # as registered (an Accelerator: its counter)
        self._accumulation.hook(objects)  # before the engine's post-hook, which may capture the state
        self.engine.bind(self.state)
        if not self._restore.attempted:
            # The restore itself is the last check of a candidate: one that verifies but cannot
            # be restored into these objects is passed over for the one before (resume.load_newest).
            self._load(accept=lambda flat: self._restore.restore(flat, objects))
        elif self._restore.loaded is not None:
            self._restore.restore(self._restore.loaded, objects)
        return self.resumed_from

    def _load(self, accept: Callable[[Any], None] | None = None) -> None:
        if self._restore.attempted:
            return
        flat = self._restore.load(self.step, accept)
        if flat is not None:
            self.step = int(flat.meta["step"])
            self.resumed_from = self.committed_step = self.step

    @property
    def user_meta(self) -> dict[str, Any]:
        """Small JSON metadata saved with every checkpoint (restored on resume)."""
        return self.state.user_meta

    # -- the step loop ----------------------------------------------------------

    def steps(self, total_steps: int) -> Iterator[int]:
        """Yield step indices from the restored step to ``total_steps - 1``.

        After each yielded step (its optimizer step done) the boundary runs:
        periodic saves, and on a stop request the final save + requeue + exit.
        A run that resumes at or past ``total_steps`` says so and yields nothing.
        """
        self._begin()
        self._restore.resume_point()
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
            batch = END if it is None else next(it, END)
            if batch is END:
                it, batch = next_pass(pos)
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
        (full-batch training) is one step, its end the step's boundary (``Passes.epoch_was_a_step``).
        """
        epochs, passes = _epoch_range(bounds), self._passes
        self._begin()
        first = (self.progress.epoch or 0) if self.resumed_from is not None else 0
        finished = self._restore.already_finished
        if self.resumed_from is not None and (finished or first >= len(epochs)):
            replay = finished and first < len(epochs)
            self._nothing_left(f"the end of training in epoch {first + 1} of {len(epochs)} (step {self.step})"
                               if replay else f"epoch {len(epochs) if finished else first} of "
                               f"{len(epochs)} (step {self.step})", replay=replay)
        for i in range(first, len(epochs)):
            self.progress.epoch = i
            passes.last_epoch = i == len(epochs) - 1
            driven = passes.driven
            try:
                yield epochs[i]
            except GeneratorExit:
                passes.epochs_left(sys._getframe(), len(epochs))
                raise
            passes.settle_owed(epoch_done=i)
            if passes.driven == driven:
                passes.epoch_was_a_step(i)
        passes.last_epoch = False
        self.progress.epoch = len(epochs)
        self._finish()
        self.close()

    def step_done(self) -> None:
        """One training step finished (a loop hpcckpt does not drive: ``while``, callbacks).

        Counts the step and runs its boundary: a periodic save, or on a stop request the
        final save, requeue and ``RequeueExit`` (exit 75). ``ckpt.step`` is the number of
        steps done (the restored one after ``register()``).
        """
        self._begin()
        self._restore.forget_rng()  # this loop's resume point was register() itself
        self._passes.observe_step()
        self.step += 1
        self._boundary()

    def driven(self, total_steps: int, *, by: str) -> Driven:
        """The step boundaries of a trainer's own loop (``by`` names it, e.g. "Lightning"), whose
        callbacks call ``begin()``, ``boundary()`` after each optimizer step and ``end()``
        (``checkpointer.driven.Driven``). The trainer resumes its data itself."""
        self.data_resumed_by = by
        return Driven(self, total_steps)

    def report_loss(self, loss: Any) -> None:
        """Optional: this step's loss, compared step by step by ``hpcckpt check`` (else unused)."""
        self._trace.report_loss(loss)

    def _position(self, loader: Any, name: str | None, **options: Any) -> LoaderPosition:
        """The saved pass of ``loader`` (``data.LoaderPosition``), by ``LoaderKeys.key``."""
        self._begin()  # the saved positions are restored there
        return self._keys.position(loader, name, resumed=self.resumed_from is not None,
                                   progress_restored=self._restore.progress_restored, **options)

    def _nothing_left(self, where: str, *, replay: bool = False) -> None:
        finished = self._restore.already_finished
        log.warning("hpcckpt: this run resumed at %s under %s: nothing left to train%s%s. To start fresh, move "
                    "%s aside or give another directory (dir=... or HPCCKPT_DIR)", where, self.root,
                    " (it finished before)" if finished else "",
                    "; the last epoch's code after its training (its evaluation) runs again, then the code after "
                    "the loop" if replay else "", self.root)
        if self.ranks.is_coordinator:
            self.ledger.append("nothing_left", step=self.step, where=where, finished=finished)

    def _begin(self) -> None:
        """The run's start, at its first loop: the restore, the JIT guard, the ``start`` record."""
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
            record_start(self.ledger, mode="inprocess", resumed_from=self.resumed_from,
                         restore_s=round(self._restore.restore_s, 6), engine=self.options.engine,
                         world_size=self.ranks.world, process_start=started, level=self.restored_level)
        self._start_step = self.step
        self._trace.note({"dir": str(self.root), "resumed_from": self.resumed_from})
        self._trace.warn_unsaved(self.state)
        self._stop.check_time_left(self._run(), state_bytes=self._state_bytes)

    def _run(self) -> Run:
        return Run(self.step, self.committed_step, self._start_step, self._startup_s)

    def _state_bytes(self) -> int:
        """What this rank's save writes (aliases, no copy): the stop's first estimate of its cost."""
        flat = self.state.capture(step=self.step)
        return sum(t.numel() * t.element_size() for t in flat.tensors.values())

    def _boundary(self, *, trace: bool = True, periodic: bool = True) -> None:
        self._passes.driven += 1
        if self.step == self._start_step + 1 and not self.progress.positions and self.data_resumed_by is None:
            self._trace.warn_loose_iterators(self.state)
        self.signals.guard_children()
        if self._jit is not None:
            self._jit.at_boundary(self.step)  # the small state of this boundary, for a JIT save
        if trace:
            self._trace.step(self.state, self.step)
        self._saves.reap()
        reason, due = self._stop.at_boundary(self.step, resumed_from=self.resumed_from, periodic=periodic)
        if reason is not StopReason.NONE:
            self._stop.stop(reason, self._run(), final_save=functools.partial(self._saves.final, self.step))
        elif due:
            self.save()

    def save(self, *, final: bool = False, block: bool | None = None) -> SaveHandle:
        """Checkpoint the registered state as of ``self.step``. Collective on all ranks."""
        return self._saves.save(self.step, final=final, block=block)

    def _finish(self) -> None:
        """The run ended: its final state is checkpointed (a re-run then says it finished)."""
        self._saves.settle_all()
        finished = self._restore.already_finished
        # A run with checkpoints (or an epoch loop, whose resume would run the last epoch's end
        # again) keeps its final state: a re-run then resumes there and says it finished.
        if not finished and self._passes.tail_step == self.step == self.committed_step:
            # The last epoch's end of training is the final checkpoint (``Passes.training_ended``): a
            # re-run runs that epoch's code after its training again, then the code after the loop.
            self.progress.finished = True
        elif not finished and (self.committed_step is not None or self.progress.epoch is not None):
            self.progress.finished = True
            try:
                self._saves.save_final(self.step)
            except (HpcckptError, OSError) as exc:
                log.error("hpcckpt: the checkpoint of the finished run (step %d) failed: %s", self.step, exc)
        self._stop.done(self.step, self.committed_step)
        self._stop.guard_after_run(self.step, self.committed_step, self.options.signals)

    # -- lifecycle ---------------------------------------------------------------

    def close(self) -> None:
        """Release everything (idempotent): background saves finish first, the writer lease last."""
        if self._closed:
            return
        self._closed = True
        self._stop.keep_figures()  # first: the JIT guard's close may end the process
        if self._jit is not None:  # first: a failure it saw ends the process here, with exit 75
            jit, self._jit = self._jit, None
            jit.close()
        self.engine.close()  # first: its finisher thread uses the background group
        self._accumulation.remove()
        self.ranks.close()
        self.signals.uninstall()
        self.progress.worker_seeds.uninstall()
        self._lease.release()  # last: saves in flight are durable before another writer may start

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


def _epoch_range(bounds: tuple[Any, ...]) -> range:
    """``epochs(E)``, ``epochs(start, stop)`` or ``epochs(range(...))`` -> a range."""
    if len(bounds) == 1 and isinstance(bounds[0], range):
        return bounds[0]
    try:
        return range(*(int(b) for b in bounds))
    except (TypeError, ValueError):
        raise ConfigError(f"Checkpointer.epochs{bounds!r}: give a number of epochs, start and stop, or a "
                          "range, e.g. ckpt.epochs(10) or ckpt.epochs(1, args.epochs + 1)") from None


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
        passes, trained = ck._passes, ck._accumulation
        passes.settle_owed()  # the loop left the previous pass at a step whose boundary is still to run
        passes.driven += 1  # an epoch of ckpt.epochs() that opens a pass is not itself a step, even if it is empty
        pos = ck._position(self._loader, self._name, skip=self._skip)  # begins the run first (the restore)
        ck._restore.resume_point()
        resumed = pos.pending
        it = pos.open()
        if not resumed:
            pos.in_epoch = ck.progress.epoch
        ck.signals.guard_children()  # its workers may be the first of the process (torch's SIGCHLD handler)
        passes.pass_opened()
        if mine and pos.taken and pos.over is None:
            warn_if_enumerated(mine[0](), pos.taken, self._loader, ck._trace.note)
        mark = trained.trained
        try:
            for batch in it:
                index = pos.taken
                pos.took()
                mark = trained.trained
                yield batch if start is None else (start + index, batch)
                ck.step_done()
        except GeneratorExit:  # the loop left the pass at this batch (a break), or an exception did
            passes.left_pass(pos, trained=trained.trained != mark or not trained.hooked,
                             by_loop=left_by_loop(sys._getframe()))
            raise
        pos.leave("end")
        passes.pass_ended()


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
