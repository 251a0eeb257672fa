"""hpcckpt as torchtitan's checkpoint manager: its checkpoints and its Slurm stops.

torchtitan's ``Trainer`` builds its checkpointer from ``Trainer.Config.checkpoint``, a
``BaseCheckpointManager.Config`` whose ``build()`` makes the manager the config's class
declares, and calls it at three points of ``train()``: ``load(step)`` before the first
step, ``maybe_wait_for_staging()`` before each ``optimizers.step()``, and
``save(curr_step, last_step)`` after each step. ``HpcckptCheckpointManager`` is such a
manager; a job selects it in its config and changes nothing else::

    from hpcckpt.integrations.torchtitan import HpcckptCheckpointManager

    config = Trainer.Config(
        ...,
        checkpoint=HpcckptCheckpointManager.Config(enable=True, interval=500, folder="checkpoint",
                                                   keep_latest_k=3, engine="concurrent"),
    )

What it registers with a ``Checkpointer`` (under ``dump_folder/folder``): each model part
(``model``, or ``model_part0``... with pipeline stages), the optimizers the
``OptimizersContainer`` steps (``optimizer``, or ``optimizer_0``...: their step hooks are
where the concurrent engine orders each ``step()`` after its snapshot, so
``maybe_wait_for_staging`` has nothing left to do; ``optimizer_objects`` says why not the
container itself), ``lr_scheduler``,
``dataloader`` (its own ``state_dict``: torchtitan's loaders resume themselves) and every
entry of ``states`` (the trainer's ``train_state``: step and tokens seen). ``load`` restores
the newest verified checkpoint (any mesh: DTensors are resharded) and begins the run's
``Checkpointer.steps(total_steps)`` (``total_steps``: the config's, else the trainer's
``training.steps``); each ``save`` is one of its step boundaries: a checkpoint every
``interval`` steps, and on a stop (SIGTERM/SIGUSR2 from Slurm, the job's end time) the final
save on every rank, the requeue and ``RequeueExit`` (exit 75) out of ``Trainer.train()``;
after the last step, the finished run's checkpoint. Not supported (a ConfigError says so at
build, with what to do instead): ``load_step`` other than -1, ``initial_load_path``,
``exclude_from_loading``, ``last_save_in_hf``, ``create_seed_checkpoint`` and
``enable_first_step_checkpoint``. Checkpoints are in hpcckpt's format;
``hpcckpt.interop.dcp.export`` writes one out for DCP readers.

``TitanCheckpoints`` is the same manager without torchtitan (the base class and its config
come from torchtitan; the work does not): a loop shaped like torchtitan's drives it the
same way (tests/integration/test_torchtitan.py).
"""
from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError

log = logging.getLogger("hpcckpt")

MODEL, OPTIMIZER, LR_SCHEDULER, DATALOADER = "model", "optimizer", "lr_scheduler", "dataloader"
# torchtitan's keep_latest_k=0 keeps every checkpoint; hpcckpt's keep is a count.
KEEP_ALL = 1_000_000


class TitanCheckpoints:
    """torchtitan's checkpoint-manager calls (``load``, ``save``, ``maybe_wait_for_staging``,
    ``close``) on a ``Checkpointer`` whose ``steps(total_steps)`` runs the step boundaries.

    ``model_parts``: the trainer's modules (one, or one per pipeline stage); ``optimizers``,
    ``lr_schedulers``, ``dataloader``: its containers (anything with ``state_dict`` /
    ``load_state_dict``; ``dataloader`` may be None); ``states``: more named objects
    (``{"train_state": trainer}``); ``total_steps``: the run's length (torchtitan's
    ``training.steps``). ``options``: more ``Checkpointer`` options (``max_async``, ``direct``...).
    """

    def __init__(self, *, folder: str | Path, interval: int, total_steps: int, keep_latest_k: int = 10,
                 engine: str = "concurrent", load_only: bool = False, model_parts: list[Any], optimizers: Any,
                 lr_schedulers: Any, dataloader: Any, states: dict[str, Any],
                 options: dict[str, Any] | None = None) -> None:
        from ..api import Checkpointer
        if not model_parts:
            raise ConfigError("hpcckpt's torchtitan manager: model_parts is empty; pass the trainer's model parts")
        if not isinstance(total_steps, int) or total_steps < 1:
            raise ConfigError(f"hpcckpt's torchtitan manager: total_steps={total_steps!r}; give the run's length in "
                              "steps (torchtitan's training.steps), e.g. 1000")
        parts = {MODEL: model_parts[0]} if len(model_parts) == 1 else {
            f"{MODEL}_part{i}": m for i, m in enumerate(model_parts)}
        objects: dict[str, Any] = {**parts, **optimizer_objects(optimizers), LR_SCHEDULER: lr_schedulers}
        if dataloader is not None:
            objects[DATALOADER] = dataloader
        clash = sorted(set(objects) & set(states))
        if clash:
            raise ConfigError(f"hpcckpt's torchtitan manager: states {clash} clash with the trainer's own objects "
                              f"{sorted(objects)}; give them other names")
        objects.update(states)
        self.objects, self.interval, self.total_steps, self.load_only = objects, interval, total_steps, load_only
        self.ckpt = Checkpointer(folder, engine=engine, every_steps=None if load_only else interval,
                                 keep=keep_latest_k or KEEP_ALL, **(options or {}))
        self.ckpt.data_resumed_by = "torchtitan"  # its dataloader is registered and restores its own position
        self._steps: Iterator[int] | None = None
        self._begun = False
        self._closed = False

    def load(self, step: int = -1) -> bool:
        """Restore the newest verified checkpoint (``step=-1``, torchtitan's default) and begin the
        run; False on a fresh start."""
        if step != -1:
            raise ConfigError(f"checkpoint.load_step={step}: hpcckpt's torchtitan manager restores the newest "
                              "verified checkpoint (load_step=-1); to resume an older one, move the newer "
                              "step-* directories out of the checkpoint folder")
        self._begin()
        if self.ckpt.resumed_from is not None:
            log.info("hpcckpt: torchtitan resumes from step %d", self.ckpt.resumed_from)
        return self.ckpt.resumed_from is not None

    def _begin(self) -> None:
        if self._begun:
            return
        self._begun = True
        self.ckpt.register(**self.objects)
        self._steps = self.ckpt.steps(self.total_steps)
        self._next()  # the run's start; nothing left when a finished run is resumed

    def _next(self) -> None:
        if self._steps is None:
            return
        try:
            next(self._steps)
        except StopIteration:
            self._steps = None
        except SystemExit:
            # RequeueExit / RefusedExit: the final checkpoint is durable (or the run was refused).
            # The Checkpointer is closed before the trainer unwinds (torchtitan's main catches only
            # Exception and would not close it), so the writer lease is released at once.
            self.close()
            raise

    def save(self, curr_step: int, last_step: bool = False) -> bool:
        """The boundary after step ``curr_step`` (torchtitan counts from 1): a periodic save, a
        stop (``RequeueExit``), and after the last step the finished run's checkpoint. True
        when this boundary checkpoints."""
        if self.load_only:
            return False
        self._begin()  # a trainer that saves without loading first registers here
        if self._steps is None:
            return False
        if curr_step != self.ckpt.step + 1:
            raise ConfigError(f"hpcckpt's torchtitan manager: save({curr_step}) after step {self.ckpt.step}: "
                              "call save(step) once after every training step, as torchtitan's Trainer does")
        self._next()
        return last_step or curr_step % self.interval == 0

    def maybe_wait_for_staging(self) -> None:
        """Nothing: the concurrent engine's optimizer pre-hook orders ``optimizers.step()`` after the snapshot."""

    def close(self) -> None:
        """Settle the saves in flight and release the directory (idempotent)."""
        if not self._closed:
            self._closed = True
            self.ckpt.close()


def optimizer_objects(optimizers: Any) -> dict[str, Any]:
    """The optimizers to register: the ones an ``OptimizersContainer`` steps (``optimizer``, or
    ``optimizer_0``... when there are several), else ``optimizers`` itself.

    Not the container: it is a ``torch.optim.Optimizer`` whose own parameter groups carry no
    learning rate, so a restore into fresh DTensor parameters could not create its state (one
    step at lr 0, as DCP does), and its own ``state`` is empty. The inner optimizers hold the
    state and run torch's step hooks, where the concurrent engine orders each ``step()`` after
    the snapshot it is still copying.
    """
    import torch
    inner = list(getattr(optimizers, "optimizers", None) or ())
    if not inner or not all(isinstance(o, torch.optim.Optimizer) for o in inner):
        return {OPTIMIZER: optimizers}
    if len(inner) == 1:
        return {OPTIMIZER: inner[0]}
    return {f"{OPTIMIZER}_{i}": o for i, o in enumerate(inner)}


_UNSUPPORTED: tuple[tuple[str, Any, str], ...] = (("load_step", -1, "the newest verified checkpoint is restored (load_step=-1)"),
                ("initial_load_path", None, "start from an hpcckpt checkpoint, or adopt a dcp.save one with "
                                            "hpcckpt.interop.dcp.adopt"),
                ("exclude_from_loading", [], "every registered object is restored"),
                ("last_save_in_hf", False, "export the final checkpoint with hpcckpt.interop.dcp.export instead"),
                ("create_seed_checkpoint", False, "use torchtitan's CheckpointManager for a seed checkpoint"),
                ("enable_first_step_checkpoint", False, "checkpoints come every interval steps and at a stop"))


def check_config(config: Any) -> None:
    """Refuse the torchtitan checkpoint options this manager does not carry out, naming each and why."""
    bad = [(name, why) for name, default, why in _UNSUPPORTED
           if getattr(config, name, default) is not None and getattr(config, name, default) != default]
    if bad:
        raise ConfigError("hpcckpt's torchtitan manager: " + "; ".join(
            f"checkpoint.{name}={getattr(config, name)!r} is not supported ({why})" for name, why in bad))


def _total_steps(config: Any, states: dict[str, Any]) -> int:
    """The run's length: the manager's ``total_steps``, else the trainer's ``training.steps``."""
    total = config.total_steps
    if total is None:
        trainer = states.get("train_state")
        total = getattr(getattr(getattr(trainer, "config", None), "training", None), "steps", None)
    if total is None:
        raise ConfigError("hpcckpt's torchtitan manager: the run's length is unknown (no "
                          "states['train_state'].config.training.steps); set "
                          "HpcckptCheckpointManager.Config(total_steps=...)")
    return int(total)


def _manager_class() -> type:
    """``HpcckptCheckpointManager``, a torchtitan ``BaseCheckpointManager`` (needs torchtitan)."""
    try:
        from torchtitan.components.checkpointer import BaseCheckpointManager
    except ImportError as exc:
        raise ImportError(f"hpcckpt.integrations.torchtitan.HpcckptCheckpointManager needs torchtitan (0.3 or newer, "
                          f"whose checkpointer is torchtitan.components.checkpointer.BaseCheckpointManager): {exc}; "
                          "pip install torchtitan, or drive TitanCheckpoints from your own loop") from None

    class HpcckptCheckpointManager(BaseCheckpointManager):
        """torchtitan's checkpoint manager, on hpcckpt (see the module docstring)."""

        @dataclass(kw_only=True, slots=True)
        class Config(BaseCheckpointManager.Config):
            engine: str = "concurrent"
            """hpcckpt engine: concurrent (saves overlap training) or sync."""

            total_steps: int | None = None
            """The run's length; None: the trainer's training.steps (states["train_state"].config)."""

        def __init__(self, config: Any, *, dataloader: Any, model_parts: list[Any], optimizers: Any,
                     lr_schedulers: Any, states: dict[str, Any], sd_adapter: Any = None,
                     base_folder: str = "") -> None:
            self.enable = config.enable
            if not self.enable:
                return
            self.save_future = None
            check_config(config)
            self.folder = str(Path(base_folder) / config.folder) if base_folder else config.folder
            self.titan = TitanCheckpoints(folder=self.folder, interval=config.interval,
                                          total_steps=_total_steps(config, states),
                                          keep_latest_k=config.keep_latest_k, engine=config.engine,
                                          load_only=config.load_only, model_parts=model_parts,
                                          optimizers=optimizers, lr_schedulers=lr_schedulers,
                                          dataloader=dataloader, states=states)

        def _load(self, step: int = -1) -> bool:
            return self.titan.load(step)

        def _save(self, curr_step: int, last_step: bool = False) -> bool:
            return self.titan.save(curr_step, last_step)

        def _maybe_wait_for_staging(self) -> None:
            self.titan.maybe_wait_for_staging()

        def _wait_for_saving(self) -> None:
            """Never called: ``save_future`` stays None (hpcckpt settles its saves at the boundaries and at close)."""

        def _close(self) -> None:
            if hasattr(self, "titan"):
                self.titan.close()

    HpcckptCheckpointManager.__module__ = __name__
    HpcckptCheckpointManager.__qualname__ = "HpcckptCheckpointManager"
    return HpcckptCheckpointManager


def __getattr__(name: str) -> Any:
    """``HpcckptCheckpointManager`` is made (and torchtitan imported) on first use."""
    if name == "HpcckptCheckpointManager":
        cls = _manager_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["HpcckptCheckpointManager", "TitanCheckpoints", "check_config"]  # noqa: F822 (made by __getattr__)
