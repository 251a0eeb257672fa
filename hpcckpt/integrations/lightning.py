"""PyTorch Lightning: signal -> next optimizer step -> durable checkpoint -> requeue -> exact resume.

The three-line change::

    from hpcckpt import ResumableSampler
    from hpcckpt.integrations.lightning import HpcckptCallback

    loader = DataLoader(ds, batch_size=32, sampler=ResumableSampler(len(ds), seed=0))
    trainer = Trainer(max_steps=10_000, callbacks=[HpcckptCallback(dir="/scratch/run1/ckpt")])

What the callback registers with a ``Checkpointer`` (concurrent engine by default): the
LightningModule, every optimizer and LR scheduler, the fit loop's progress counters
(epoch, batch, optimizer steps, scheduler steps) and the sampler's position. The
boundary runs after each optimizer step (``on_train_batch_end`` where the global step
moved), so gradients are never half-accumulated in a checkpoint.

Lightning's own SLURM handling is switched off so that there is exactly one requeue:
``SLURMEnvironment.auto_requeue`` (which saves inside the USR1 handler and requeues
from it) is set to False, and Lightning's SIGTERM notifier is replaced by hpcckpt's
recording handlers once training starts.

Hook order (Lightning calls these on every rank):
``setup`` (auto-requeue off) -> ``on_fit_start`` (Checkpointer, data loaded, state
registered and restored) -> Lightning installs its signal handlers -> ``on_train_start``
(hpcckpt's handlers back on top) -> ``on_train_batch_start`` (first resumed batch: the RNG
the uninterrupted run has there) -> ``on_train_batch_end`` per batch (sampler position;
the boundary after an optimizer step, or after validation when validation follows it)
-> ``on_validation_end`` (a boundary that waited for validation) -> ``on_train_end`` (pending
saves settled) -> ``teardown`` (closed).
"""
from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from typing import Any

import torch

from ..api import Checkpointer
from ..checkpointer.driven import Driven
from ..data import ResumableSampler, find_resumable
from ..errors import ConfigError
from ..signals import quiet_workers
from ..state import rng_state, set_rng_state
from ._extras import require

log = logging.getLogger("hpcckpt")


def _lightning() -> Any:
    """``lightning.pytorch`` (package ``lightning``), else the older ``pytorch_lightning``."""
    try:
        return require("lightning.pytorch", "lightning", "lightning")
    except ConfigError:
        try:
            return require("pytorch_lightning", "lightning", "lightning")
        except ConfigError:
            raise ConfigError(
                "hpcckpt.integrations.lightning needs PyTorch Lightning (package `lightning` or "
                "`pytorch-lightning`); install it with `pip install 'hpcckpt[lightning]'`") from None


pl = _lightning()
_SLURMEnvironment = require("lightning.fabric.plugins.environments", "lightning", "lightning").SLURMEnvironment \
    if pl.__name__.startswith("lightning.") else pl.plugins.environments.SLURMEnvironment

_UNBOUNDED_STEPS = 2**62


class _LoopState:
    """The fit loop's progress counters (epoch, batch, optimizer and scheduler steps) as state."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        return dict(self.trainer.fit_loop.state_dict())

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        # Lightning's own restart path: the loop marks itself as restarting and resumes
        # from counters saved at on_train_batch_end, as for its ModelCheckpoint.
        self.trainer.fit_loop.load_state_dict(dict(state))


find_sampler = find_resumable  # the ResumableSampler that drives a loader (sampler or batch sampler's)


def _total_steps(trainer: Any) -> int:
    total = trainer.max_steps if trainer.max_steps is not None and trainer.max_steps >= 0 \
        else trainer.estimated_stepping_batches
    return int(total) if isinstance(total, int) or math.isfinite(total) else _UNBOUNDED_STEPS


class HpcckptCallback(pl.Callback):  # type: ignore[name-defined]  # pl is found at import time (lightning or pytorch_lightning)
    """Preemption-safe, exactly resumable Lightning training (see the module docstring).

    Keyword arguments are ``Checkpointer`` options (``every_steps``, ``keep``, ``signals``,
    ``engine``...); ``HPCCKPT_*`` variables fill the rest. ``engine`` defaults to
    ``"concurrent"``: periodic saves copy parameters and optimizer state while the next
    forward/backward runs.
    ``exact_ddp`` (default True) keeps DDP's gradient bucket layout fixed across a resume
    (``find_unused_parameters=True``), which a bit-identical multi-rank resume needs.
    """

    def __init__(self, dir: str | os.PathLike[str] | None = None, *, exact_ddp: bool = True,
                 **options: Any) -> None:
        super().__init__()
        self.exact_ddp = exact_ddp
        if "engine" not in options and "HPCCKPT_ENGINE" not in os.environ:
            options["engine"] = "concurrent"
        self.dir = dir
        self.options = options
        self.ckpt: Checkpointer | None = None
        self.sampler: ResumableSampler | None = None
        self._driven: Driven | None = None  # Lightning's steps, from on_train_start
        self._rng: dict[str, Any] | None = None
        self._last_global_step = 0
        self._epoch_turned = False
        self._closed = False

    # -- setup: one requeue, state registered and restored -------------------------------

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        env = getattr(getattr(trainer, "_accelerator_connector", None), "cluster_environment", None)
        if isinstance(env, _SLURMEnvironment) and env.auto_requeue:
            # Lightning would save inside its USR1 handler and requeue from there too.
            log.warning("hpcckpt: turning off Lightning's SLURM auto-requeue; hpcckpt requeues once, "
                        "after a durable checkpoint")
            env.auto_requeue = False
        self._keep_ddp_buckets(trainer)

    def _keep_ddp_buckets(self, trainer: Any) -> None:
        """DDP rebuilds its gradient buckets after its first step, in the order gradients became
        ready; a resumed run's first step would then choose another layout (another summation
        order across ranks) than the uninterrupted run, which differs in the last bits.
        find_unused_parameters=True keeps the constructor's layout (as the demo does)."""
        kwargs = getattr(trainer.strategy, "_ddp_kwargs", None)
        if not self.exact_ddp or not isinstance(kwargs, dict) or kwargs.get("find_unused_parameters"):
            return
        if kwargs.get("static_graph"):
            return  # a static graph fixes the layout too
        log.warning("hpcckpt: DDP with find_unused_parameters=True so that a resumed run keeps the "
                    "gradient bucket layout of the uninterrupted one (bit-identical resume); "
                    "HpcckptCallback(exact_ddp=False) leaves DDP as configured")
        kwargs["find_unused_parameters"] = True

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self.ckpt = Checkpointer(self.dir, **self.options)
        # Load the training data now, as Lightning would at the start of fit: its length
        # is read with the sampler at position 0 (the whole epoch), and the sampler is
        # iterated lazily, at the first batch, so a position restored below still applies.
        trainer.fit_loop.setup_data()
        self.sampler = self._training_sampler(trainer)
        objects: dict[str, Any] = {"module": pl_module, "loops": _LoopState(trainer), "sampler": self.sampler}
        for i, opt in enumerate(trainer.optimizers):
            objects[f"optimizer_{i}"] = opt
        for i, config in enumerate(trainer.lr_scheduler_configs):
            objects[f"scheduler_{i}"] = config.scheduler
        scaler = getattr(trainer.precision_plugin, "scaler", None)  # 16-mixed on CUDA: a GradScaler
        if scaler is not None:
            objects["scaler"] = scaler
        restored = self.ckpt.register(**objects)
        if restored is not None:
            self._after_restore(trainer)
        self._last_global_step = int(trainer.global_step)

    def _training_sampler(self, trainer: Any) -> ResumableSampler:
        combined = trainer.fit_loop._combined_loader
        loaders = list(combined.flattened) if combined is not None else []
        samplers = [find_sampler(dl) for dl in loaders]
        if len(loaders) != 1 or samplers[0] is None:
            raise ConfigError(
                "HpcckptCallback resumes mid-epoch exactly only with one training DataLoader whose sampler "
                "is hpcckpt.ResumableSampler, e.g. DataLoader(ds, batch_size=32, sampler=ResumableSampler("
                "len(ds), seed=0)); under DDP give it num_replicas=world_size, rank=global_rank and pass "
                f"Trainer(use_distributed_sampler=False). Found {len(loaders)} loader(s) with samplers "
                f"{[type(getattr(dl, 'sampler', None)).__name__ for dl in loaders]}")
        return samplers[0]

    def _after_restore(self, trainer: Any) -> None:
        """Put the data position where the uninterrupted run has it; keep the RNG for later."""
        assert self.sampler is not None
        self._rng = rng_state()  # as captured; set again at the first resumed batch
        self._epoch_turned = self.sampler.consumed >= self.sampler.per_rank
        if self._epoch_turned:
            # Saved after the last batch of an epoch: the next batch is the next epoch's first
            # (the sampler is iterated lazily, so this applies to whichever iterator Lightning uses).
            self.sampler.set_epoch(self.sampler.epoch + 1)
        else:
            self.sampler.resume_next_iter()  # Lightning's next iterator is the training one

    def _resume_rng(self, trainer: Any) -> None:
        """The RNG the uninterrupted run has at this batch: as captured, plus, when an epoch
        ended in between, the one draw with which its new DataLoader iterator took its seed
        from the global RNG (the line torch.utils.data's iterator runs). Whatever Lightning's
        restart did in between (sanity check, epoch-end hooks, a new iterator) is undone."""
        assert self._rng is not None
        set_rng_state(self._rng)
        self._rng = None
        loader = trainer.fit_loop._combined_loader.flattened[0]
        if self._epoch_turned and getattr(loader, "generator", None) is None:
            torch.empty((), dtype=torch.int64).random_()

    # -- training: signals, data position, boundaries ------------------------------------

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        assert self.ckpt is not None
        # Lightning installed its handlers just before this hook (SIGTERM notifier that
        # ends fit on its own); put hpcckpt's recorders back on top so they alone decide.
        connector = getattr(trainer, "_signal_connector", None)
        if connector is not None:
            connector.received_sigterm = False
        self.ckpt.signals.uninstall()
        self.ckpt.signals.install()
        for loader in getattr(getattr(trainer.fit_loop, "_combined_loader", None), "flattened", None) or ():
            quiet_workers(loader, self.ckpt.signals.signals)  # where its workers have not started yet
        # Its restored fit loop resumes its loaders. Nothing left: steps() said so and finished.
        self._driven = self.ckpt.driven(_total_steps(trainer), by="Lightning")
        self._driven.begin()

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self._rng is not None:
            self._resume_rng(trainer)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        assert self.sampler is not None and self._driven is not None
        size = int(trainer.fit_loop._combined_loader.flattened[0].batch_size or 1)
        self.sampler.advance(min(size, self.sampler.per_rank - self.sampler.consumed))
        if int(trainer.global_step) == self._last_global_step:
            return  # accumulating gradients: not a step boundary
        self._last_global_step = int(trainer.global_step)
        # When validation runs right after this batch, the boundary waits for its end (Driven.boundary).
        self._driven.boundary(wait=self._validation_follows(trainer))

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if self._driven is not None:
            self._driven.evaluated()

    @staticmethod
    def _validation_follows(trainer: Any) -> bool:
        loop = trainer.fit_loop.epoch_loop
        try:
            return bool(loop._should_check_val_fx(trainer.fit_loop._data_fetcher)) and not loop._skip_next_val
        except AttributeError:  # another Lightning version: validation RNG draws are then not covered
            return False

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.ckpt is not None and self._driven is not None:
            # Training may end before the step count Lightning estimated (max_epochs with a
            # shorter last epoch, early stopping): pending saves are settled as steps() would.
            self._driven.end()

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        if self.ckpt is not None and not self.ckpt._started:
            # Lightning ran no training at all (a finished run resumed at its last step: its
            # loop is done before on_train_start). The run still begins and ends in the ledger,
            # as steps() records it for a plain loop: start, nothing_left, done.
            for _ in self.ckpt.steps(self.ckpt.step):
                pass

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._close()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            self._close()

    def _close(self) -> None:
        if self.ckpt is not None and not self._closed:
            self._closed = True
            self.ckpt.close()


__all__ = ["HpcckptCallback", "ResumableSampler", "find_sampler"]
