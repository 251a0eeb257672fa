"""Finding and reading the newest checkpoint that every rank can restore.

Safe against a writer that commits and prunes in the same directory meanwhile (an
evaluation job reading a training run's checkpoints, or a requeued job overlapping
its previous instance): a candidate that disappears while it is read is not damage,
it sends the search back to a fresh listing. Only a checkpoint that is still there
and fails to read counts as corrupt. ``hpcckpt.api.Checkpointer`` restores through
``load_newest``; so can any reader.

Call sequence (every rank, collective)::

    outcome = load_newest(root, ranks, into=...)
      round: the coordinator lists committed candidates, newest first, and tells all ranks
        each candidate: every rank reads its part -> agreed code (max over ranks):
          OK -> done | VANISHED -> next round | CORRUPT -> remembered, next candidate
      no round left with an untried candidate -> outcome without state
"""
from __future__ import annotations

import itertools
import logging
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .engines import load_rank
from .errors import CheckpointCorrupt, ConfigError, HpcckptError, StateRefused
from .ranks import Ranks
from .state import Flat, python_rng, unflatten
from .store import catalog

log = logging.getLogger("hpcckpt")

OK, CORRUPT, VANISHED = 0, 1, 2
OLDER_WINDOW = 32  # older step directories offered per round, newest first
MAX_ROUNDS = 200  # an extra round: a checkpoint vanished (the writer committed again), or a window was used up


class CheckpointsVanishing(HpcckptError):
    """Checkpoints kept disappearing while being read (something prunes this directory hard)."""


@dataclass
class Outcome:
    """What ``load_newest`` found. ``damaged``: (step, problem), newest first."""

    flat: Flat | None = None
    step: int | None = None
    path: Path | None = None
    damaged: list[tuple[int, str]] = field(default_factory=list)
    unusable: list[tuple[int, str]] = field(default_factory=list)  # step-N dirs that are not committed
    overwritten: bool = False  # live tensors now hold bytes of a checkpoint that was not restored
    rounds: int = 0
    # Every damaged checkpoint was refused alike by a registered object (on every rank): the
    # user's code changed since they were saved, not the checkpoints; the newest refusal.
    refused: StateRefused | None = None


def _candidates(root: Path, ranks: Ranks, tried: set[str]) -> tuple[list[dict[str, Any]], list[tuple[int, str]]]:
    """The coordinator's candidates (untried, newest first) and its unusable step dirs.

    Only the step directories down to the newest committed one are checked here (the
    usual resume reads one manifest, however many are kept); older ones follow as
    candidates by name and are checked when their turn comes (``_read``).
    """
    doc: dict[str, Any] = {}
    if ranks.is_coordinator:
        inspected, older = catalog.newest_committed(root)
        doc["candidates"] = [{"step": i.step, "key": _key(i)} for i in inspected
                             if i.status == "committed" and _key(i) not in tried]
        # The next OLDER_WINDOW by name: a round that tries them all without success lists
        # again (``resume`` loops), so keeping thousands costs a start-up nothing.
        untried = (e for e in older if f"{e.step}:{e.inode}" not in tried)
        doc["candidates"] += [{"step": e.step, "key": f"{e.step}:{e.inode}"}
                              for e in itertools.islice(untried, OLDER_WINDOW)]
        doc["unusable"] = [[i.step, (i.problems or [i.status])[0]] for i in inspected if i.status != "committed"]
        newer = catalog.written_by_newer(inspected)
        doc["newer"] = f"{newer.path}: {newer.problems[0]}" if newer is not None else None
    doc = ranks.broadcast_json(doc)
    if doc.get("newer"):
        raise ConfigError(f"{doc['newer']}. This hpcckpt will not resume an older checkpoint instead (that "
                          "would lose the steps since): run the job with the hpcckpt that wrote it, or newer; "
                          "to go back to the older step on purpose, move that step directory out of the "
                          "checkpoint directory")
    return doc["candidates"], [(int(s), str(p)) for s, p in doc["unusable"]]


def _key(info: catalog.CheckpointInfo) -> str:
    return f"{info.step}:{info.ident[1] if info.ident else None}"


def _read(root: Path, step: int, ranks: Ranks, into: Mapping[str, Any] | None,
          stats: dict[str, Any], accept: Callable[[Flat], None] | None = None
          ) -> tuple[int, Flat | None, str, StateRefused | None]:
    """(code, state, problem, refusal) of this rank's part of candidate ``step``, as this rank sees it.

    A ConfigError (another world size; the user's code changed in a way only the user can
    fix, e.g. the optimizer's parameter groups) is the same for every checkpoint: raised.
    Anything else, the restore's refusals included, passes this checkpoint over.
    """
    info = catalog.inspect_step(root, step)
    if info is None:
        return VANISHED, None, "", None
    if info.status != "committed":  # fails a cheap check here although the coordinator's passed
        return CORRUPT, None, "; ".join(info.problems) or info.status, None
    refusal: StateRefused | None = None
    try:
        flat = load_rank(info, ranks.rank, ranks.world, into=into, stats=stats)
        check_restorable(flat, into)
        if accept is not None:
            try:
                accept(flat)
            except BaseException:
                stats["restored_into"] = True  # the registered objects may hold part of it now
                raise
        return OK, flat, "", None
    except ConfigError:
        raise  # the same answer for every checkpoint, and the user's to fix
    except Exception as exc:  # noqa: BLE001 - anything a damaged file makes a reader raise
        problem = str(exc) if isinstance(exc, HpcckptError) else f"{type(exc).__name__}: {exc}"
        refusal = exc if isinstance(exc, StateRefused) else None
    if catalog.vanished(info):
        return VANISHED, None, "", None
    return CORRUPT, None, problem, refusal


def check_restorable(flat: Flat, live: Mapping[str, Any] | None) -> None:
    """Raise CheckpointCorrupt naming what of a verified checkpoint cannot be restored into
    this job, before anything is restored: its RNG states (tried on private generators,
    no global state touched) and the shape and dtype of every tensor the live state holds."""
    try:
        rng = unflatten(flat.meta["rng"], flat.tensors)
        random.Random().setstate(python_rng(rng["python"]))
        n = rng["numpy"]
        np.random.RandomState().set_state((n[0], n[1], int(n[2]), int(n[3]), float(n[4])))
        torch.Generator().set_state(rng["torch"])
    except Exception as exc:  # noqa: BLE001 - whatever a generator refuses
        raise CheckpointCorrupt(f"its RNG state cannot be restored ({type(exc).__name__}: {exc})") from None
    for name, saved in flat.tensors.items():
        now = (live or {}).get(name)
        if isinstance(now, torch.Tensor) and isinstance(saved, torch.Tensor) and (
                tuple(now.shape) != tuple(saved.shape) or now.dtype != saved.dtype):
            problem = (f"state tensor {name!r} was saved as {tuple(saved.shape)} {saved.dtype} but is "
                       f"{tuple(now.shape)} {now.dtype} in this job")
            raise StateRefused(
                f"{problem}; it cannot be restored into the model as it is now", key=f"shape:{name}",
                advice=f"{problem}: build the model as in the run that saved it, or start fresh in another directory")


def load_newest(root: Path, ranks: Ranks, *, into: Callable[[], Mapping[str, Any] | None] | None = None,
                on_skip: Callable[[int, str], None] | None = None,
                accept: Callable[[Flat], None] | None = None, only_step: int | None = None) -> Outcome:
    """The newest committed checkpoint every rank can read and restore, or an outcome without state.

    ``into``: called once, before the first read, for the live tensors to read into
    (``TrainState.capture``); ``on_skip(step, problem)`` runs on every rank for each
    damaged checkpoint passed over, once the search is over. A checkpoint that reads back intact but cannot be
    restored here (``check_restorable``: RNG state the generators refuse, a tensor whose
    shape or dtype differs from the live one; or whatever ``accept(flat)``, e.g. the
    restore itself, raises) is passed over the same way, with that reason. When every
    damaged one was refused alike by a registered object (``StateRefused`` with one key),
    ``refused`` holds the newest refusal: the user's code changed, and its ``advice``
    says what to do (``on_skip`` is not called: nothing was damaged). ``only_step``: that
    step or nothing (a node-local level, where older steps may be incomplete on some nodes).
    Collective over ``ranks``.
    """
    out = Outcome()
    tried: set[str] = set()
    refusals: dict[int, StateRefused] = {}
    live: Mapping[str, Any] | None = None
    asked = False
    while out.rounds < MAX_ROUNDS:
        out.rounds += 1
        candidates, out.unusable = _candidates(root, ranks, tried)
        if only_step is not None:
            candidates = [c for c in candidates if int(c["step"]) == only_step]
        if not candidates:
            out.overwritten = ranks.max(int(out.overwritten)) > 0
            out.refused = _alike(out.damaged, refusals, ranks)
            if out.refused is None:  # else nothing was damaged: the job's code is refused
                _report(out.damaged, on_skip)
            return out
        for cand in candidates:
            if not asked:
                live, asked = (into() if into is not None else None), True
            stats: dict[str, Any] = {}
            code, flat, problem, refusal = _read(root, int(cand["step"]), ranks, live, stats, accept)
            agreed = ranks.max(code)
            if agreed != OK and (stats.get("in_place_bytes", 0) > 0 or stats.get("restored_into")):
                out.overwritten = True
            if agreed == OK:
                out.flat, out.step = flat, int(cand["step"])
                out.path = root / catalog.step_name(out.step)
                _report(out.damaged, on_skip)
                return out
            if agreed == VANISHED:
                log.info("hpcckpt: checkpoint step %s disappeared while being read (pruned by a writer); "
                         "looking again", cand["step"])
                time.sleep(0.01 * min(out.rounds, 10))
                break
            tried.add(str(cand["key"]))  # damaged, not gone: never tried again
            if refusal is not None:
                refusals[int(cand["step"])] = refusal
            problem = problem or "another rank could not read its part"
            out.damaged.append((int(cand["step"]), problem))
    _report(out.damaged, on_skip)
    raise CheckpointsVanishing(
        f"checkpoints under {root} disappeared while being read {MAX_ROUNDS} times in a row: another job is "
        "writing and pruning this directory. Stop it or give this job its own directory.")


def _alike(damaged: list[tuple[int, str]], refusals: Mapping[int, StateRefused], ranks: Ranks) -> StateRefused | None:
    """The newest refusal if every damaged checkpoint was refused for the same reason on every
    rank: then the user's code changed, not the checkpoints. Collective over ``ranks``."""
    keys = {refusals[s].key if s in refusals else None for s, _ in damaged}
    alike = len(keys) == 1 and None not in keys
    return refusals[damaged[0][0]] if ranks.all(alike) else None


def _report(damaged: list[tuple[int, str]], on_skip: Callable[[int, str], None] | None) -> None:
    """``on_skip`` for each checkpoint passed over, once the search knows they were damaged."""
    if on_skip is not None:
        for step, problem in damaged:
            on_skip(step, problem)
