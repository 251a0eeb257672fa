"""Where the training program is beyond its objects (``Progress``), saved as ``__progress__``."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..errors import CheckpointCorrupt
from .loaders import iterating_loader
from .position import LoaderPosition
from .sampler import _is_int
from .workers import WorkerSeeds


class Progress:
    """Where the training program is, beyond its objects: the epoch of ``Checkpointer.epochs``,
    each loader's pass (``LoaderPosition``), and whether the run finished. Saved with
    every checkpoint under the reserved name ``__progress__``."""

    NAME = "__progress__"

    def __init__(self) -> None:
        self.epoch: int | None = None  # index into the range given to Checkpointer.epochs
        self.finished = False
        self.total: int | None = None  # the step count the run was given (steps/loop), when known
        self.positions: dict[str, LoaderPosition] = {}
        self._restored_loaders: dict[str, Any] = {}
        # Gradients accumulated over the steps since the last optimizer step (a loop that steps every
        # N batches), by module and parameter: saved only when a save falls inside an accumulation
        # (``grads`` says which, the Checkpointer's), put back by the Checkpointer after a resume.
        self.grads: Callable[[], dict[str, dict[str, torch.Tensor]]] | None = None
        self.restored_grads: dict[str, Any] = {}
        self.worker_seeds = WorkerSeeds()
        self.worker_seeds.training = self._training_loaders

    def _training_loaders(self) -> set[int]:
        """The ids of the loaders trained through ``ckpt.batches``/``loop`` (and those they iterate)."""
        out: set[int] = set()
        for pos in self.positions.values():
            out.add(id(pos.loader))
            out.add(id(iterating_loader(pos.loader)))
        return out

    def position(self, name: str, loader: Any, **options: Any) -> LoaderPosition:
        """The position of ``loader`` (created on first use, with its saved state if any)."""
        pos = self.positions.get(name)
        if pos is None or pos.loader is not loader:
            pos = self.positions[name] = LoaderPosition(loader, **options)
            saved = self._restored_loaders.pop(name, None)
            if saved is not None:
                pos.load_state_dict(saved)
                if self.epoch is not None and pos.in_epoch is not None and pos.in_epoch != self.epoch:
                    pos.settle()
        return pos

    def restored_loader_names(self) -> list[str]:
        """The loaders the restored checkpoint holds positions of, still unclaimed."""
        return list(self._restored_loaders)

    def state_dict(self) -> dict[str, Any]:
        loaders = {**self._restored_loaders, **{n: p.state_dict() for n, p in self.positions.items()}}
        state = {"epoch": self.epoch, "finished": self.finished, "total": self.total, "loaders": loaders}
        grads = self.grads() if self.grads is not None else {}
        if grads:
            state["grads"] = grads
        seeds = self.worker_seeds.state_dict()
        if seeds:
            state["worker_seeds"] = seeds
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if not isinstance(state, Mapping):
            raise CheckpointCorrupt(f"the progress state is a {type(state).__name__}, not a mapping")
        epoch, finished, total = state.get("epoch"), state.get("finished", False), state.get("total")
        loaders = state.get("loaders") or {}
        if not ((epoch is None or _is_int(epoch) and epoch >= 0) and isinstance(finished, bool)
                and (total is None or _is_int(total) and total >= 0) and isinstance(loaders, Mapping)):
            raise CheckpointCorrupt(f"the progress state is damaged (epoch={epoch!r}, finished={finished!r}, "
                                    f"total={total!r}, loaders: {type(loaders).__name__})")
        for name, saved in loaders.items():
            try:
                LoaderPosition.check_state(saved)
            except CheckpointCorrupt as exc:
                raise CheckpointCorrupt(f"loader {name!r}: {exc}") from None
        grads = state.get("grads") or {}
        if not (isinstance(grads, Mapping) and all(
                isinstance(g, Mapping) and all(isinstance(t, torch.Tensor) for t in g.values()) for g in grads.values())):
            raise CheckpointCorrupt("the progress state's accumulated gradients are damaged")
        if state.get("worker_seeds") is not None:
            self.worker_seeds.load_state_dict(state["worker_seeds"])
        self.epoch, self.finished, self.total = epoch, finished, total
        self._restored_loaders = dict(loaders)
        self.restored_grads = {name: dict(g) for name, g in grads.items()}
