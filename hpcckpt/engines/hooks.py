"""The concurrent engine's optimizer hooks (``ConcurrentEngine``'s step part).

``optimizer.step()`` may overwrite parameters and optimizer state only once every save in flight
has copied them: its pre-hook waits for that (``wait_copied``), the only stall of a save besides
``save()`` itself. Its post-hook notices new shapes (the optimizer state appears after the first
step) and has staging prepared in the background.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..errors import ConfigError
from ..state import TrainState, stepping_optimizer
from ..store.layout import Layout
from .base import Engine
from .job import SaveJob
from .staging import EngineStats

log = logging.getLogger("hpcckpt.engines.concurrent")


class StepHooks(Engine):
    """The step-hook part of ``ConcurrentEngine`` (a mixin: the engine holds the state below)."""

    stats: EngineStats
    _cond: threading.Condition
    _inflight: list[SaveJob]
    _state: TrainState | None
    _safe: set[str]
    _safe_prefixes: tuple[str, ...]
    _safe_masks: dict[int, tuple[Layout, np.ndarray]]
    _hooks: dict[int, list[Any]]
    _optimizers: list[torch.optim.Optimizer]
    _prep_sig: tuple[int, ...] | None
    _closed: bool
    if TYPE_CHECKING:
        def prepare(self, tensors: dict[str, torch.Tensor]) -> None: ...

    def bind(self, state: TrainState) -> None:
        """Hook every registered optimizer; main thread.

        The pre-hook keeps ``optimizer.step()`` from overwriting un-staged sources;
        the post-hook starts laying out staging in the background once the state's
        shapes are known (optimizer state appears only after the first step).
        """
        self._state = state
        self._safe = state.background_safe()
        self._safe_masks.clear()
        for name, obj in state.objects.items():
            if not isinstance(obj, torch.optim.Optimizer):
                continue
            try:
                stepping = stepping_optimizer(obj, name)  # a wrapper's (Accelerate's) inner optimizer
            except ConfigError as exc:
                # No hook tells when its step() may overwrite what a save still copies: every
                # parameter and optimizer state is then copied inside save(), as the rest is
                # (the write still runs in the background). Correct, only a longer stall.
                if "rng/" in self._safe and len(self._safe) > 1:
                    log.warning("hpcckpt: %s; the concurrent engine copies the whole state inside save()", exc)
                self._safe = {"rng/"}
                continue
            if id(stepping) not in self._hooks:
                self._hooks[id(stepping)] = [stepping.register_step_pre_hook(self._before_step),
                                             stepping.register_step_post_hook(self._after_step)]
                self._optimizers.append(stepping)
        self._safe_prefixes = tuple(s for s in self._safe if s.endswith("/"))
        self._prepare_if_new_shapes(at_bind=True)

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """optimizer.step() may overwrite parameters and state only once they are staged."""
        self.wait_copied()

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Main thread, after each step: prepare staging when the optimizer state's shape changed."""
        self._prepare_if_new_shapes(at_bind=False)

    def _prepare_if_new_shapes(self, *, at_bind: bool) -> None:
        """Costs a tuple of lengths per step; a capture (no copy) only when it changed.

        At bind time only when the shapes are already final: no optimizer, or one that
        already holds state (a fresh optimizer's state appears with its first step).
        """
        sig = tuple(len(o.state) for o in self._optimizers)
        if sig == self._prep_sig or self._state is None or self._closed:
            return
        if at_bind and self._optimizers and not any(sig):
            return
        self._prep_sig = sig
        self.prepare(self._state.capture(step=0).tensors)

    def wait_copied(self) -> float:
        """Block until every save in flight has copied its sources; returns the seconds blocked.

        The seconds are added to the blocked saves' ``handle.stall_s`` (the policy's
        measured overhead) and to ``stats.hook_wait_s``.
        """
        with self._cond:
            pending = [j for j in self._inflight if not j.copied.is_set()]
        if not pending:
            return 0.0
        t0 = time.monotonic()
        for job in pending:
            if job.cuda_event is not None:
                # The GPU orders optimizer.step() after the D2H copy; the host does not wait
                # (CPU sources were copied by save(): ``_routes``). The training device's
                # stream, which need not be the current device's.
                torch.cuda.current_stream(job.device).wait_event(job.cuda_event)
            elif job.ring is None and job.batch is not None:
                job.batch.wait_copied()
                job.copied.set()
            else:
                job.copied.wait()  # the finisher streams the ring and sets it
        waited = time.monotonic() - t0
        self.stats.hook_wait_s += waited
        for job in pending:
            job.handle.stall_s = (job.handle.stall_s or 0.0) + waited
        return waited

    def _is_safe(self, name: str) -> bool:
        if name in self._safe:  # a parameter: exact name (O(1); states have hundreds of tensors)
            return True
        return any(name.startswith(s) for s in self._safe_prefixes)  # optimizer state: one prefix each
