"""Saves: the checkpoints of a run, from the capture to the commit.

``save`` captures the registered state and hands it to the engine; ``settle`` accounts for
a finished save (a commit moves ``committed_step`` and is recorded; a failure is recorded
as ``save_failed`` and raised). Engines commit in step order, so saves are settled in the
order they were taken. ``final`` is the stop's save, tried twice.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

from ..engines import Engine, SaveHandle
from ..errors import CheckpointFailed, ConfigError, HpcckptError
from ..lifecycle.ledger import Ledger
from ..policy import Figures, Policy
from ..ranks import Ranks
from ..state import TrainState

log = logging.getLogger("hpcckpt")


class Saves:
    """The saves of one Checkpointer: those in flight (``handles``) and the newest committed step."""

    def __init__(self, *, state: TrainState, engine: Engine, policy: Policy, figures: Figures, ledger: Ledger,
                 ranks: Ranks, root: Path, engine_name: str) -> None:
        self.state, self.engine, self.policy, self.figures = state, engine, policy, figures
        self.ledger, self.ranks, self.root, self.engine_name = ledger, ranks, root, engine_name
        self.handles: list[SaveHandle] = []
        self.committed_step: int | None = None

    def holds(self, step: int) -> bool:
        """Whether ``step`` is committed or being saved already."""
        return self.committed_step == step or any(h.step == step for h in self.handles)

    def save(self, step: int, *, final: bool = False, block: bool | None = None) -> SaveHandle:
        """Checkpoint the registered state as of ``step``. Collective on all ranks."""
        t0 = time.monotonic()
        flat = self.state.capture(step=step, extra=None)
        capture_s = time.monotonic() - t0  # state_dict() and co.: before the engine's save_s starts
        handle = self.engine.save(flat, step, final=final)
        handle.final = final
        handle.capture_s = capture_s
        handle.stall_s = time.monotonic() - t0  # the part training waited for (engines may add to it)
        self.policy.saved_at(step)
        self.handles.append(handle)
        if final or block:
            self.settle(handle)
        return handle

    def settle(self, handle: SaveHandle) -> None:
        """Account for one finished save: a commit moves ``committed_step``; a failure raises.

        A failure is recorded as ``save_failed`` (never as a ``commit``), whoever saw the
        handle's error first (an engine may have waited on it already).
        """
        if handle in self.handles:
            # Engines commit in step order: the older saves still listed are accounted for first,
            # so committed_step and the ledger follow the commits (a final save settled at once
            # must not be followed by an older periodic one moving committed_step back).
            self.settle_quietly(self.handles[:self.handles.index(handle)])
            self.handles.remove(handle)
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
                               engine=self.engine_name,
                               stall_s=getattr(handle, "stall_s", None), final=handle.final,
                               path=str(handle.path), **self.policy.report())
            self.figures.save_s, self.figures.step_s = self.policy.save_cost_s, self.policy.step_s
            # Not at every commit; a final one writes any change (so does close()).
            self.figures.write_if_moved(self.root, any_change=handle.final)

    def settle_quietly(self, handles: list[SaveHandle]) -> None:
        """Settle each; a failed one is already logged and recorded, and training goes on."""
        for h in handles:
            try:
                self.settle(h)
            except Exception:  # noqa: BLE001 - reported by settle; the previous checkpoint stands
                pass

    def reap(self) -> None:
        """Account for finished background saves; a failed one is reported once and training goes on."""
        self.settle_quietly([h for h in self.handles if h.done()])

    def settle_all(self) -> None:
        """Account for every save in flight, waiting for each (a stop, the run's end)."""
        self.settle_quietly(list(self.handles))

    def save_final(self, step: int) -> None:
        """``save(final=True)``, tried once more if it fails (either engine; a ConfigError is not
        retried: it would fail the same way). Collective: a failed save fails on every rank."""
        try:
            self.save(step, final=True)
        except ConfigError:
            raise
        except (HpcckptError, OSError) as exc:
            log.warning("hpcckpt: the final checkpoint of step %d failed (%s); trying once more", step, exc)
            self.save(step, final=True)

    def final(self, step: int) -> tuple[int | None, str | None]:
        """The stop's checkpoint (``lifecycle.stop.FinalSave``): the committed step after it, and
        None when it is durable, else why it failed (the previous committed one then stands)."""
        self.settle_all()  # older saves first, so the final one is the newest
        if self.committed_step == step:
            return self.committed_step, None
        try:
            self.save_final(step)
            return self.committed_step, None
        except (HpcckptError, OSError) as exc:
            prev = (f"the previous committed checkpoint, step {self.committed_step}" if self.committed_step
                    is not None else "the beginning (no checkpoint was ever committed)")
            log.error("hpcckpt: the final checkpoint of step %d failed twice (%s); requeueing anyway: the job "
                      "resumes from %s", step, exc, prev)
            return self.committed_step, str(exc)
