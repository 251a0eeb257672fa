"""Hugging Face ``Trainer``: signal -> next optimizer step -> durable checkpoint -> requeue -> exact resume.

The three-line change::

    from hpcckpt.integrations.hf import HpcckptTrainerCallback

    ckpt = HpcckptTrainerCallback(dir="/scratch/run1/ckpt")
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[ckpt])
    trainer.train(resume_from_checkpoint=ckpt.resume_point(trainer))

What is saved with a ``Checkpointer`` (concurrent engine by default): the model, the
optimizer, the LR scheduler, the ``TrainerState`` (global step, epoch, log history) and
the RNG states. On a resume, ``resume_point`` restores the model and the state and hands
the Trainer its own resume path, so the Trainer does what it does for its own
checkpoints: skip the batches of the current epoch (its data order is seeded per
epoch) and set the RNG where it did. Only the loading is hpcckpt's: the optimizer,
scheduler and RNG come from the verified hpcckpt checkpoint, not from pickles.

Call order: ``resume_point`` (before ``train``; model + TrainerState restored) ->
Trainer builds optimizer and scheduler -> its optimizer/scheduler load (here: registered
and restored) -> ``on_train_begin`` (fresh start: registered) -> ``on_step_end`` after each
optimizer step (the boundary: periodic save, or stop with exit 75; after ``on_evaluate``
when the Trainer evaluates at that step) -> ``on_train_end``.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Mapping
from typing import Any

from ..api import Checkpointer
from ..checkpointer.driven import Driven
from ..errors import ConfigError
from ..signals import quiet_workers
from ..state import rng_state, set_rng_state
from ._extras import require

log = logging.getLogger("hpcckpt")

transformers = require("transformers", "hf", "transformers")
TrainerCallback = transformers.TrainerCallback
_STATE_FILE = "trainer_state.json"  # the name the Trainer reads from its resume path


class _TrainerStateItem:
    """The live ``trainer.state`` (the Trainer replaces the object on a resume) as JSON state."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.loaded: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        # What TrainerState.save_to_json writes (a dataclass of JSON values).
        return {"json": json.dumps(dataclasses.asdict(self.trainer.state), sort_keys=True)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.loaded = json.loads(state["json"])


def _unwrap(obj: Any, attr: str) -> Any:
    """Accelerate wraps the optimizer/scheduler; register what ``step()`` really mutates."""
    return getattr(obj, attr, obj)


class HpcckptTrainerCallback(TrainerCallback):  # type: ignore[misc,valid-type]  # object when transformers is absent
    """Preemption-safe, exactly resumable ``Trainer`` runs (see the module docstring).

    Keyword arguments are ``Checkpointer`` options; ``engine`` defaults to ``"concurrent"``.
    """

    def __init__(self, dir: str | os.PathLike[str] | None = None, **options: Any) -> None:
        if "engine" not in options and "HPCCKPT_ENGINE" not in os.environ:
            options["engine"] = "concurrent"
        self.dir = dir
        self.options = options
        self.ckpt: Checkpointer | None = None
        self._trainer: Any = None
        self._rng: dict[str, Any] | None = None
        self._driven: Driven | None = None  # the Trainer's steps, from on_train_begin
        self._registered_training = False
        self._shadowed = False  # get_batch_samples shadowed on the trainer (``_train_nothing``)

    # -- resume ----------------------------------------------------------------------

    def resume_point(self, trainer: Any) -> str | None:
        """Restore model and TrainerState from the newest verified checkpoint; return the
        path to pass as ``trainer.train(resume_from_checkpoint=...)`` (None: fresh start)."""
        if self.ckpt is not None:
            raise ConfigError("HpcckptTrainerCallback.resume_point was called twice; call it once, "
                              "as trainer.train(resume_from_checkpoint=callback.resume_point(trainer))")
        self._trainer = trainer
        self.ckpt = Checkpointer(self.dir, **self.options)
        item = _TrainerStateItem(trainer)
        if self.ckpt.register(model=trainer.model, trainer_state=item) is None:
            return None
        self._rng = rng_state()  # as captured: the Trainer sets it where it did when saving
        assert item.loaded is not None
        resume = self.ckpt.root / "hf-resume"
        resume.mkdir(mode=0o700, exist_ok=True)
        tmp = resume / f".{_STATE_FILE}.tmp-{os.getpid()}"
        tmp.write_text(json.dumps(item.loaded))
        os.replace(tmp, resume / _STATE_FILE)
        self._route_loads(trainer)
        log.warning("hpcckpt: resuming the Trainer at global step %s from %s", item.loaded.get("global_step"),
                    self.ckpt.root)
        return str(resume)

    def _route_loads(self, trainer: Any) -> None:
        """The Trainer's loads from its resume path come from the hpcckpt checkpoint instead."""
        trainer._load_from_checkpoint = lambda *_a, **_k: None  # restored in resume_point
        trainer._load_optimizer_and_scheduler = lambda _path: self._register_training(trainer)
        trainer._load_scaler = lambda _path: None  # the scaler is registered with the optimizer
        trainer._load_rng_state = lambda _path: self._set_rng()

    def _set_rng(self) -> None:
        if self._rng is not None:
            set_rng_state(self._rng)

    def _register_training(self, trainer: Any) -> None:
        assert self.ckpt is not None
        if self._registered_training:
            return
        self._registered_training = True
        objects: dict[str, Any] = {"optimizer": _unwrap(trainer.optimizer, "optimizer")}
        if trainer.lr_scheduler is not None:
            objects["scheduler"] = _unwrap(trainer.lr_scheduler, "scheduler")
        scaler = getattr(getattr(trainer, "accelerator", None), "scaler", None)
        if scaler is not None:
            objects["scaler"] = scaler
        self.ckpt.register(**objects)

    # -- training --------------------------------------------------------------------

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.ckpt is None or self._trainer is None:
            raise ConfigError("HpcckptTrainerCallback needs trainer.train(resume_from_checkpoint="
                              "callback.resume_point(trainer)); resume_point was not called")
        self._register_training(self._trainer)  # fresh start: nothing was loaded
        if kwargs.get("train_dataloader") is not None:  # its workers start with the first epoch, after this
            quiet_workers(kwargs["train_dataloader"], self.ckpt.signals.signals)
        total = int(state.max_steps) if state.max_steps and state.max_steps > 0 else 2**62
        # The Trainer skips the trained batches itself.
        self._driven = self.ckpt.driven(total, by="the Hugging Face Trainer")
        if not self._driven.begin():  # a re-run of a finished run: steps() said nothing is left, and finished
            self._train_nothing(control)

    def _train_nothing(self, control: Any) -> None:
        """The Trainer resumed at ``max_steps`` still trains one more step before it checks
        whether to stop (its epoch loop takes a batch first): this run's Trainer gets no batch
        (``get_batch_samples`` shadowed on the instance until ``on_train_end``) and is told to
        stop, so the re-run of a finished run (after a stop in the code after ``train()``)
        changes nothing and goes on to that code."""
        control.should_training_stop = True
        trainer = self._trainer
        if trainer is None or not callable(getattr(trainer, "get_batch_samples", None)):
            log.warning("hpcckpt: this Trainer has no get_batch_samples(); the re-run of a finished run may "
                        "train a step past max_steps (upgrade transformers)")
            return
        trainer.get_batch_samples = lambda epoch_iterator, num_batches, device: ([], None)
        self._shadowed = True

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # When the Trainer evaluates right after this step (its own checkpoints are taken there
        # too), the boundary waits for the evaluation's end (Driven.boundary).
        if self._driven is not None:
            self._driven.boundary(wait=bool(control.should_evaluate))

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._driven is not None:
            self._driven.evaluated()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.ckpt is None:
            return
        if self._driven is not None:
            self._driven.end()  # ended before max_steps (epochs, early stopping): settle saves
        if self._shadowed and self._trainer is not None:
            del self._trainer.get_batch_samples  # the class's own again
            self._shadowed = False
        self.ckpt.close()


__all__ = ["HpcckptTrainerCallback"]
