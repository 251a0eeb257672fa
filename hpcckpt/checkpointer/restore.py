"""Restore: the newest checkpoint that verifies and fits, read back into the registered objects.

``load`` finds it (the fastest level holding it first, with levels) and reads it straight
into the live tensors where they match; ``restore`` puts each ``register()`` call's objects
back (the loop's progress with the first), the gradients of an accumulation in progress
too. Every checkpoint damaged: a clear error, or a fresh start where ``on_corrupt='fresh'``.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..config import read_internal
from ..data import Progress
from ..engines.base import live_tensors
from ..errors import CheckpointCorrupt, ConfigError
from ..levels import Levels
from ..levels import restore as level_restore
from ..lifecycle.ledger import Ledger
from ..ranks import Ranks
from ..resume import Outcome, load_newest
from ..state import Flat, TrainState, init_dtensor_optimizer_state, rng_state, set_rng_state
from .accumulation import Accumulation

log = logging.getLogger("hpcckpt")


class Restore:
    """The restore of one Checkpointer: tried once, at the first ``register()`` or the run's start."""

    def __init__(self, *, root: Path, ranks: Ranks, ledger: Ledger, levels: Levels | None, state: TrainState,
                 progress: Progress, on_corrupt: str, accumulation: Accumulation) -> None:
        self.root, self.ranks, self.ledger, self.levels = root, ranks, ledger, levels
        self.state, self.progress, self.accumulation = state, progress, accumulation
        self.fresh_ok = on_corrupt == "fresh"
        self.loaded: Flat | None = None
        self.attempted = False
        self.restore_s = 0.0
        self.restored_level: str | None = None  # the level the resume read: node-local, partner or shared
        self.progress_restored = False
        self.already_finished = False  # the checkpoint restored is the end of a finished run
        self._resume_rng: dict[str, Any] | None = None  # the saved RNG, set again where training resumes
        self._initialized: list[torch.optim.Optimizer] = []  # optimizers whose state a restore created

    def load(self, step: int, accept: Callable[[Flat], None] | None = None) -> Flat | None:
        """The restored checkpoint (None: a fresh start); read once, later calls return it."""
        if self.attempted:
            return self.loaded
        self.attempted = True
        t0 = time.monotonic()
        if read_internal("CRIU_FALLBACK") == "fresh":
            # `hpcckpt run --mode criu --on-restore-failure fresh`: the user asked for a fresh start.
            log.warning("hpcckpt: _HPCCKPT_CRIU_FALLBACK=fresh: not resuming from %s", self.root)
            return None
        # Read straight into the live model/optimizer tensors where they match (no first touch of
        # new memory, no second copy: hdf5.read_tensors), unless a fresh start must stay possible:
        # then they only give shapes, devices and DTensor placements, and new memory is read.
        # The optimizers' parameter devices say where missing optimizer state belongs (GPU or host).
        live = lambda: self._live_targets(step)  # noqa: E731 - called once there is a checkpoint to read
        outcome, where = self._from_levels(live, accept) if self.levels is not None else (None, self.root)
        if outcome is None:
            outcome = load_newest(self.root, self.ranks, into=live, on_skip=self._skipped, accept=accept)
            if outcome.flat is not None and self.levels is not None:
                self.restored_level = level_restore.SHARED
        self.restore_s = time.monotonic() - t0
        if outcome.flat is not None:
            self.loaded = outcome.flat
            level = f" ({self.restored_level} level)" if self.restored_level else ""
            log.warning("hpcckpt: resumed from step %d under %s%s (%.2fs)", int(outcome.flat.meta["step"]), where,
                        level, self.restore_s)
        else:
            for opt in self._initialized:  # a fresh start: the optimizers as they were, without state
                opt.state.clear()
            if outcome.damaged or outcome.unusable:
                self._nothing_restored(outcome)
        return self.loaded

    def _from_levels(self, live: Callable[[], Any], accept: Callable[[Flat], None] | None) -> tuple[Outcome | None, Path]:
        """The fastest level holding the newest complete step (None: read the shared directory)."""
        assert self.levels is not None
        found = level_restore.prepare(self.levels, self.ranks)
        if found is None:
            return None, self.root
        step = found[0]
        outcome = load_newest(self.levels.local, self.ranks, into=live, on_skip=self._skipped,
                              accept=accept, only_step=step)
        self.restored_level = found[1]
        if outcome.flat is None:  # its damaged files mended from the partner copies, before an older level
            found = level_restore.prepare(self.levels, self.ranks, verify=step)
            if found is not None:
                outcome = load_newest(self.levels.local, self.ranks, into=live, on_skip=self._skipped,
                                      accept=accept, only_step=step)
                self.restored_level = found[1]
        if outcome.flat is None:
            log.warning("hpcckpt: node-local step %d could not be restored; trying the shared level", step)
            self.restored_level = None
            return None, self.root
        return outcome, self.levels.local

    def restore(self, flat: Flat, objects: dict[str, Any]) -> None:
        """Put ``objects`` back from ``flat`` (and the loop's progress, on the first register())."""
        saved = flat.meta["objects"]
        missing = set(objects) - set(saved)
        if missing:
            raise ConfigError(f"checkpoint step {flat.meta.get('step')} under {self.root} has no state for "
                              f"{sorted(missing)}; it holds {sorted(n for n in saved if n != Progress.NAME)}")
        sub = TrainState()
        sub.objects.update(objects)
        with_progress = Progress.NAME in saved and not self.progress_restored  # the first register() of a resume
        if with_progress:
            sub.objects[Progress.NAME] = self.progress
        subset = Flat(flat.tensors, {**flat.meta, "objects": {n: v for n, v in saved.items() if n in sub.objects}})
        sub.restore(subset)
        self.progress_restored = self.progress_restored or with_progress
        self.accumulation.put_back(objects, self.progress.restored_grads)
        self.state.user_meta.update(flat.meta.get("user", {}))
        self._resume_rng = rng_state()  # as saved; set again where training resumes (resume_point)
        self.already_finished = self.progress.finished

    def resume_point(self) -> None:
        """Training resumes here: the RNG becomes the saved one again, whatever ran since
        ``register()`` (a new DataLoader iterator, a peek, per-epoch setup) drew from it."""
        if self._resume_rng is not None:
            set_rng_state(self._resume_rng)
            self._resume_rng = None

    def forget_rng(self) -> None:
        """A loop whose resume point was ``register()`` itself (``step_done``): nothing to set again."""
        self._resume_rng = None

    def _live_targets(self, step: int) -> Any:
        """The live tensors a restore reads into; called once there is a checkpoint to read.

        Optimizers over DTensor (FSDP2) parameters get their state created first (a
        step with zero gradients and learning rate 0, as torch.distributed.checkpoint
        does), so that the restore fills DTensor shards in place instead of handing
        plain tensors to an optimizer that expects DTensors.
        """
        self._initialized = [obj for obj in self.state.objects.values()
                             if isinstance(obj, torch.optim.Optimizer) and init_dtensor_optimizer_state(obj)]
        return live_tensors(self.state.capture(step=step, plan=False).tensors, self.state.objects,
                            overwrite=not self.fresh_ok)

    def _skipped(self, step: int, problem: str) -> None:
        log.error("hpcckpt: skipping checkpoint step %d: %s", step, problem)
        if self.ranks.is_coordinator:
            self.ledger.append("skip_corrupt", step=step, problem=problem)

    def _nothing_restored(self, outcome: Outcome) -> None:
        """Every checkpoint is damaged: raise, unless the user asked for a fresh start (on_corrupt)."""
        seen = {d[0] for d in outcome.damaged}
        bad = sorted(outcome.damaged + [u for u in outcome.unusable if u[0] not in seen], reverse=True)
        listing = "; ".join(f"step {s}: {p}" for s, p in bad[:5])
        if outcome.refused is not None:  # every one refused alike: this job's code, not the checkpoints
            raise ConfigError(f"{outcome.refused.advice} (every checkpoint under {self.root} is refused the "
                              f"same way: steps {', '.join(str(s) for s, _ in outcome.damaged)})")
        if self.fresh_ok and not outcome.overwritten:
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
