"""The engine contract: how one step's state becomes a committed checkpoint.

Call sequence (every rank, in step order)::

    handle = engine.save(flat, step, final=...)   # main thread, at a step boundary
      -> engine writes this rank's file into the shared temp dir and makes it durable
      -> commit_step(): all ranks exchange their records; the coordinator alone
         writes the manifest, renames, updates LATEST and prunes; every rank learns
         the outcome, so one rank's failure fails the save on all ranks
    handle.wait()                                  # raises the save's error exactly once
    engine.close()

Loading does not depend on the engine that is configured now: ``store.read.load_rank``
reads whatever format the manifest names.
"""
from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointFailed
from ..levels import Levels
from ..levels import save as level_save
from ..ranks import Ranks
from ..state import Flat, TrainState
from ..store import catalog, placement
from ..store.commit import Transaction, discard, fsync_path, remove_trash
from ..store.lock import CommitLock
from ..store.manifest import build as build_manifest
from ..store.publish import commit_and_prune, gather_records, record_failures

log = logging.getLogger("hpcckpt.engines")



class LiveTensors(dict):
    """Live tensors by flat name (``TrainState.capture``) plus, per registered optimizer,
    the devices its parameters are on: where its missing state belongs on a resume.

    ``overwrite=False``: the tensors only say what to build (shapes, devices, DTensor
    placements); a restore reads into new memory, so a failed one leaves them intact.
    """

    def __init__(self, tensors: Mapping[str, Any], optimizer_devices: Mapping[str, set[torch.device]],
                 *, overwrite: bool = True) -> None:
        super().__init__(tensors)
        self.optimizer_devices = dict(optimizer_devices)
        self.overwrite = overwrite


def live_tensors(tensors: Mapping[str, Any], objects: Mapping[str, Any], *, overwrite: bool = True) -> LiveTensors:
    """``tensors`` with the devices of each optimizer's parameters (``param_groups``) in ``objects``."""
    devices = {name: {p.device for g in obj.param_groups for p in g["params"]}
               for name, obj in objects.items() if isinstance(obj, torch.optim.Optimizer)}
    return LiveTensors(tensors, devices, overwrite=overwrite)


class SaveHandle:
    """A save in progress. ``wait()`` raises a background error exactly once."""

    def __init__(self, step: int, *, final: bool = False) -> None:
        self.step = step
        self.path: Path | None = None
        self.save_s: float | None = None
        self.stall_s: float | None = None  # how long training was blocked by this save
        self.capture_s = 0.0  # the state's capture (state_dict()) before the engine's save
        self.final = final
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._raised = False

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """True once finished; raises the save's error the first time it is seen."""
        if not self._done.wait(timeout):
            return False
        if self._error is not None and not self._raised:
            self._raised = True
            raise self._error
        return True

    @property
    def error(self) -> BaseException | None:
        return self._error

    def finish(self, *, path: Path | None = None, error: BaseException | None = None,
               save_s: float | None = None) -> None:
        self.path, self._error, self.save_s = path, error, save_s
        self._done.set()


@dataclass(frozen=True, kw_only=True)
class SaveContext:
    root: Path  # where the engine writes: the checkpoint directory, or this node's node-local level
    keep: int
    job: dict[str, Any]
    user: dict[str, Any]
    levels: Levels | None = None  # multi-level checkpoints: commits go through levels.save


class Engine(ABC):
    name: str = "base"

    def __init__(self, ctx: SaveContext, ranks: Ranks) -> None:
        self.ctx = ctx
        self.ranks = ranks
        # Checkpoints retention renamed aside (invisible) at a commit, deleted once that
        # save's handle is finished (``empty_trash``): a save is reported durable without
        # waiting for old files to be unlinked. Only the committing thread touches it.
        self._trash: list[Path] = []
        # Renamed aside by retention after a commit's fsync of the root (keep=1), not yet
        # durable: they move to ``_trash`` at the next fsync of the root (``commit_and_prune``,
        # ``settle_trash``). Only the committing thread touches it.
        self._unsynced: list[Path] = []
        self._commit_lock: CommitLock | None = None  # made at the first commit, closed by close()

    @abstractmethod
    def save(self, flat: Flat, step: int, *, final: bool = False) -> SaveHandle:
        """Start saving ``flat`` as step ``step``; main thread, at a step boundary."""

    def bind(self, state: TrainState) -> None:
        """Called whenever objects are registered (e.g. to hook optimizers); main thread."""

    def pending(self) -> list[SaveHandle]:
        return []

    def close(self) -> None:
        """Wait for saves in flight (their errors are reported by their handles)."""
        self.settle_trash()
        self.close_commit_lock()

    # -- shared by all engines ------------------------------------------------

    def close_commit_lock(self) -> None:
        if self._commit_lock is not None:
            self._commit_lock.close()

    def settle_trash(self) -> None:
        """At close: make the renames aside still waiting for a commit's fsync of the root
        durable, then delete them (the committing thread, or after it stopped). Should the
        fsync fail, they stay as invisible leftovers for a later sweep."""
        if self._unsynced:
            try:
                fsync_path(self.ctx.root)
            except OSError as exc:
                log.warning("hpcckpt: could not make pruned checkpoints' removal durable: %s", exc)
            else:
                self._trash += self._unsynced
            self._unsynced.clear()
        self.empty_trash()  # what earlier fsyncs made durable goes either way

    def empty_trash(self) -> None:
        """Delete what retention renamed aside at the last commits (the committing thread)."""
        if self._trash:
            doomed, self._trash[:] = list(self._trash), []
            remove_trash(doomed)

    def _recycled(self, tmp: Path) -> bool:
        """Whether the save's temporary directory ``tmp`` is a pruned checkpoint's, reused whole
        with its entries (``Transaction``'s ``recycled``); the concurrent engine's recycler."""
        return False

    @property
    def write_root(self) -> Path:
        """Where a save is written: ``ctx.root``; with levels, ``Levels.write_root`` (this node's
        node-local root, or the shared level once the node-local one failed)."""
        return self.ctx.levels.write_root if self.ctx.levels is not None else self.ctx.root

    def temp_path(self, step: int) -> Path:
        """The shared temporary directory of this save (same name on every rank; collective)."""
        return Transaction.temp_path(self.write_root, catalog.step_name(step), self.ranks.token())

    def temp_dir(self, step: int) -> Path:
        """``temp_path``, created (collective)."""
        return Transaction.temp_dir(self.write_root, catalog.step_name(step), self.ranks.token())

    def commit_step(self, step: int, tmp: Path, record: dict[str, Any] | None,
                    error: BaseException | None, started: float, *, ranks: Ranks | None = None,
                    final: bool = False) -> Path:
        """Exchange rank records; the coordinator commits. Collective over all ranks.

        A background thread passes ``ranks=self.ranks.background()`` so that its
        collectives never interleave with the main thread's on one group. With levels
        (``ctx.levels``) every node commits its node-local copy and the shared level is
        drained from it when due (``levels.save.commit``).
        """
        ranks = ranks or self.ranks
        if self.ctx.levels is not None:
            path, level_warnings = level_save.commit(self.ctx.levels, ranks, engine=self.name, job=self.ctx.job,
                                                     user=self.ctx.user, step=step, tmp=tmp, record=record,
                                                     error=error, final=final)
            for warning in level_warnings:
                log.warning("hpcckpt: %s", warning)
            log.info("hpcckpt: committed step %d in %.3fs (%s)", step, time.monotonic() - started, path)
            return path
        mine = {"ok": error is None, "record": record, "step": step, "tmp": str(tmp),
                "error": f"{type(error).__name__}: {error}" if error else None}
        everyone = gather_records(ranks, mine)
        outcome: dict[str, Any]
        if ranks.is_coordinator:
            failed = record_failures(everyone, step)  # never commit a mix of steps
            if failed:
                outcome = {"ok": False, "errors": failed}
            else:
                warnings: list[str] = []
                try:
                    committed = self._commit(step, tmp, [m["record"] for m in everyone], warnings)
                    outcome = {"ok": True, "path": str(committed), "warnings": warnings}
                except Exception as exc:  # reported to every rank below
                    outcome = {"ok": False, "errors": {0: f"commit failed: {type(exc).__name__}: {exc}"}}
            if not outcome["ok"]:
                tmps = [Path(p) for p in {str(m["tmp"]) for m in everyone}]  # one, unless ranks were out of step
                discard(tmps[0].parent, tmps)
        else:
            outcome = {}
        outcome = ranks.broadcast_json(outcome)
        if not outcome["ok"]:
            errors = {int(r): e for r, e in outcome["errors"].items()}
            raise CheckpointFailed(
                f"checkpoint of step {step} under {self.ctx.root} failed; the previous checkpoint is untouched",
                errors)
        for warning in outcome.get("warnings") or []:
            log.warning("hpcckpt: %s", warning)
        log.info("hpcckpt: committed step %d in %.3fs (%s)", step, time.monotonic() - started, outcome["path"])
        return Path(outcome["path"])

    def placement_fields(self, flat: Flat) -> dict[str, Any]:
        """What this rank's commit record says about the distributed tensors (``store.placement``)."""
        return placement.record_fields(placement.Plan(shared=flat.shared, pieces=flat.pieces,
                                                      fingerprints=flat.fingerprints),
                                       coordinator=self.ranks.is_coordinator)

    def _commit(self, step: int, tmp: Path, records: list[dict[str, Any]],
                warnings: list[str] | None = None) -> Path:
        """Commit and prune; coordinator only. Faults after the rename (root fsync, LATEST,
        pruning) go to ``warnings``: the step is committed, a failed save would be a lie."""
        manifest = build_manifest(step=step, engine=self.name, job=self.ctx.job, user=self.ctx.user, records=records)
        txn = Transaction(self.ctx.root, catalog.step_name(step), temp=tmp, recycled=self._recycled(tmp))
        if self._commit_lock is None:
            self._commit_lock = CommitLock(self.ctx.root)
        path, faults, removed = commit_and_prune(txn, manifest, keep=self.ctx.keep, trash=self._trash,
                                                 unsynced=self._unsynced,
                                                 lock=self._commit_lock)
        if warnings is not None:
            warnings += faults
        for p in removed:
            log.info("hpcckpt: retention removed %s", p)
        return path


def cpu_copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True).contiguous()
