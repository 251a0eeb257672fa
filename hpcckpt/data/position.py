"""Where the training pass over one DataLoader is (``LoaderPosition``), saved with every
checkpoint and resumed exactly: the same pass, its trained batches skipped."""
from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ..errors import CheckpointCorrupt, ConfigError
from .loaders import (
    _END,
    _HOST_RNG_BYTES,
    OVER,
    SKIP_MODES,
    _begun,
    _draws_global,
    _drop_unused_iterator,
    _epoch_counter,
    _epoch_samplers,
    _generators,
    _host_boundary,
    _numpy_state,
    _persistent,
    _python_state,
    _sampler_draws_global,
    _sampler_unknown,
    _set_host,
    _Skip,
    iterating_loader,
)
from .sampler import ResumableSampler, _is_int, find_resumable

log = logging.getLogger("hpcckpt")


class LoaderPosition:
    """Where the training pass over one DataLoader is: which pass (epoch) and how many
    of its batches reached the training code, plus the RNG states its iterator started
    from. Saved with the checkpoint (``Checkpointer.batches``/``loop`` keep it).

    A resumed pass is the same pass: the RNGs the iterator draws from (the global torch
    RNG for its worker seed and a ``RandomSampler`` without a generator, the loader's
    or sampler's own generator) are set to their state at the pass's start, the
    iterator is created as then, and the batches already trained on are skipped:
    ``indices`` drops their indices without loading them; ``fetch`` loads and drops
    them, so that random augmentation in worker processes (seeded per pass) resumes
    exactly, at the cost of loading them. ``auto``: ``fetch`` for loaders with worker
    processes or an iterable dataset, ``indices`` otherwise. Samplers whose order
    depends on their own attributes (``DistributedSampler``'s seed and epoch) need
    nothing more. A ``ResumableSampler`` keeps its own position (O(1), any world size).

    Persistent workers (``persistent_workers=True``) are seeded once, when the loader's first
    pass starts them, and their random streams run on from pass to pass. For them each pass
    since that one is recorded (the RNG states its order was drawn from, where they are not
    those the previous pass left; the epoch its samplers were told), and a resumed pass first
    replays those earlier passes through new workers seeded as the first ones were, loading
    and dropping every batch, then the batches of the interrupted pass: the data loading
    (not the training) of every batch the workers produced before the interruption.
    """

    def __init__(self, loader: Any, *, skip: str = "auto", set_epochs: bool = False) -> None:
        if skip not in SKIP_MODES:
            raise ConfigError(f"skip={skip!r}; use one of {', '.join(SKIP_MODES)}")
        self.loader = loader
        self.skip = skip
        self.set_epochs = set_epochs  # Checkpointer.loop: no epoch loop of the user's calls set_epoch
        self.saves_sampler = True  # its ResumableSampler's state travels here unless registered itself
        self.passes = 0  # passes begun (epochs over this loader)
        self.taken = 0   # batches of the current pass that reached the training code
        self._rng: dict[str, torch.Tensor] = {}
        self._rng_iter: dict[str, torch.Tensor] = {}  # a StatefulDataLoader's generators just after its iter()
        self._rng_end: dict[str, torch.Tensor] = {}  # persistent workers: the generators as the last pass ended
        self._ended: int | None = None  # persistent workers: the batches their iterator had yielded as it ended
        # persistent workers: the pass that started them (0: not started by a training pass) and a
        # record of each pass since (that pass included, the current one last)
        self._workers_from = 0
        self._worker_passes: list[dict[str, Any]] = []
        self._restored: Mapping[str, Any] | None = None
        self._epoch_counter: int | None = None  # an adapter's pass count as the current pass began
        self.in_epoch: int | None = None  # the epoch of Checkpointer.epochs() the current pass began in
        # The current pass is over: "left" (the loop left it, a break at max_steps) or "end" (it ended,
        # saved as such for loaders without persistent workers); a resume of it yields nothing.
        self.over: str | None = None

    @property
    def resumable(self) -> ResumableSampler | None:
        return find_resumable(self.loader)

    @property
    def pending(self) -> bool:
        """A restored pass waits to be resumed by the next ``open()``."""
        return self._restored is not None

    def _mode(self) -> str:
        if self.resumable is not None:
            return "indices"  # it skips by itself, in O(1), on any world size
        if self.skip != "auto":
            return self.skip
        holder = iterating_loader(self.loader)
        if getattr(holder, "batch_sampler", None) is None and getattr(holder, "sampler", None) is None:
            return "fetch"  # no index sampler to skip on (a wrapper of a loader): load and drop
        iterable = isinstance(getattr(self.loader, "dataset", None), torch.utils.data.IterableDataset)
        return "fetch" if iterable or getattr(self.loader, "num_workers", 0) > 0 else "indices"

    @property
    def stateful(self) -> bool:
        """The loader saves its own position (torchdata's ``StatefulDataLoader``): it is used,
        except with worker processes, whose random streams it does not bring back (the
        interrupted pass is then replayed through them, as for any loader)."""
        base = iterating_loader(self.loader)  # an adapter is stateful when what it iterates is
        return all(callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))
                   for obj in {id(self.loader): self.loader, id(base): base}.values()) and getattr(
                       self.loader, "num_workers", 0) == 0

    def open(self) -> Iterator[Any]:
        """The iterator of the training pass: the restored one resumed, else a new pass."""
        if self._restored is not None:
            state, self._restored = self._restored, None
            return self._resume(state)
        return self._begin()

    def _resume_stateful(self, state: Mapping[str, Any]) -> Iterator[Any]:
        """The loader's own state (sampler, workers, iterable dataset) resumes the pass."""
        saved = state.get("loader")
        # The loader had seen its pass end before the save (an adapter reads a batch ahead: Accelerate's
        # state then says so): nothing of the pass is left, and the next pass begins as on a loader
        # whose pass ended (loading that state would fast-forward a sampler through the pass again,
        # drawing its seed from the global RNG).
        ended = isinstance(saved, Mapping) and saved.get("_iterator_finished") is True and self.taken > 0
        if ended:
            _drop_unused_iterator(self.loader)
        elif "loader" in state:
            self.loader.load_state_dict(state["loader"])
        boundary = _host_boundary()  # its iterator draws a worker seed: not from the resumed stream
        try:
            if ended:
                self._counted()
                return iter(())
            # As the pass began: a sampler the loader cannot save (one given to it, as Accelerate's
            # adapter does) is fast-forwarded by drawing its order again, from these states.
            self._set_rngs(self._rng)
            it, empty = _begun(self.loader)
            if empty and self.taken:
                self._counted()
            return it
        except StopIteration:
            # torchdata 0.11 fast-forwards an iterable dataset without state to where the pass was,
            # and fails when that was its end: the pass is over, the next open() begins a new one.
            if hasattr(self.loader, "next_iter_state"):
                self.loader.next_iter_state = None  # else its next iter() fails the same way
            return iter(())
        finally:
            _set_host(boundary)
            # torchdata puts a sampler's generator back to the pass's start and draws the order again,
            # but not the worker seed the pass's iter() drew from the loader's generator after it: the
            # generators are set to their state after that iter(), as in the uninterrupted run.
            self._set_rngs(self._rng_iter)

    def _set_rngs(self, rng: Mapping[str, torch.Tensor]) -> None:
        """Set each RNG ``rng`` holds a state for: the host's (torch, python, numpy) and the
        loader's generators, by role."""
        _set_host(rng)
        for role, g in _generators(self.loader).items():
            if role in rng:
                g.set_state(rng[role])

    def _begin(self) -> Iterator[Any]:
        if not self.stateful:
            # With worker processes a resume replays this pass from the RNG states recorded here, so the
            # pass's iterator must draw from them. (Without, the loader's own state resumes it, and an
            # iterator its state_dict() made is the one a script without hpcckpt would have made here.)
            _drop_unused_iterator(self.loader)
        sampler = self.resumable
        inner = getattr(self.loader, "sampler", None)
        if sampler is not None and sampler.exhausted:
            sampler.set_epoch(sampler.epoch + 1)  # a loop that never calls set_epoch itself
        elif sampler is None and self.set_epochs and inner is not None and hasattr(inner, "set_epoch"):
            inner.set_epoch(self.passes)  # DistributedSampler under Checkpointer.loop
        gens = _generators(self.loader)
        self._rng = {k: g.get_state() for k, g in gens.items()}
        if _draws_global(self.loader, gens):
            self._rng["torch"] = torch.get_rng_state()
        if _sampler_unknown(self.loader):
            self._rng["python"], self._rng["numpy"] = _python_state(), _numpy_state()
        if not _persistent(self.loader):
            self._workers_from, self._worker_passes = 0, []
        elif getattr(self.loader, "_iterator", None) is None:  # this pass starts the persistent workers
            self._workers_from, self._worker_passes = self.passes + 1, [self._pass_record(starts=True)]
        elif self._workers_from and self._ended == getattr(self.loader._iterator, "_num_yielded", -1):
            self._worker_passes.append(self._pass_record(starts=False))
        else:  # the last pass was left early, or the workers served an iter() of another loop since
            self._workers_from, self._worker_passes = 0, []
        self._epoch_counter = _epoch_counter(self.loader)
        self.passes += 1
        self.taken = 0
        self.over = None
        it, _ = _begun(self.loader)
        self._rng_iter = {k: g.get_state() for k, g in gens.items()} if self.stateful else {}
        return self._watch_end(it)

    def _watch_end(self, it: Iterator[Any]) -> Iterator[Any]:
        """The pass's iterator; with persistent workers, the generators' states are noted as it ends
        (a sampler may draw at its end: torch's RandomSampler does)."""
        self._rng_end, self._ended = {}, None
        if not (_persistent(self.loader) and self._workers_from):
            return it
        return self._until_end(it)

    def _until_end(self, it: Iterator[Any]) -> Iterator[Any]:
        yield from it
        self._rng_end = {k: g.get_state() for k, g in _generators(self.loader).items()}
        self._ended = getattr(it, "_num_yielded", None)

    def _pass_record(self, *, starts: bool) -> dict[str, Any]:
        """What replaying this pass through persistent workers needs, taken as it begins: the RNG
        states its order (and, for the pass that starts the workers, their seed) is drawn from,
        less those the previous pass left as they are (a generator only the loader draws from),
        and the epoch each sampler with ``set_epoch`` was told."""
        rng: dict[str, torch.Tensor] = {}
        for role, state in self._rng.items():
            if role == "torch":
                if starts or _sampler_draws_global(self.loader):
                    rng[role] = state
            elif starts or role not in self._rng_end or not torch.equal(state, self._rng_end[role]):
                rng[role] = state
        return {"rng": rng, "epochs": {role: int(s.epoch) for role, s in _epoch_samplers(self.loader).items()}}

    def _resume(self, state: Mapping[str, Any]) -> Iterator[Any]:
        """Replay the saved pass's start, skip what was trained on; the global RNG is left as found.
        A pass saved as over (``over``) yields nothing: its iterator is made again as it began (the
        order and worker seed it drew from the loader's generators are drawn as then, so the next
        pass draws what it drew in the uninterrupted run) and dropped."""
        self._take(state)
        if "iteration" in state and _epoch_counter(self.loader) is not None:
            # The adapter tells its samplers this pass's epoch (set_epoch) as it begins it.
            self.loader.iteration = self._epoch_counter = int(state["iteration"])
        if self.stateful:
            return self._dropped(self._resume_stateful(state)) if self.over else self._resume_stateful(state)
        sampler = self.resumable
        if sampler is not None:
            if self.saves_sampler and "sampler" in state:
                sampler.load_state_dict(state["sampler"])
            if not self.over:
                sampler.resume_next_iter()
        if self.set_epochs and sampler is None and hasattr(getattr(self.loader, "sampler", None), "set_epoch"):
            self.loader.sampler.set_epoch(self.passes - 1)
        _drop_unused_iterator(self.loader)
        if getattr(self.loader, "next_iter_state", None) is not None:
            self.loader.next_iter_state = None  # a StatefulDataLoader's own position: replayed here instead
        earlier = self._earlier_passes(state)
        boundary = _host_boundary()  # the resume point's RNGs: put back once the pass is replayed
        try:
            if earlier:
                self._replay_passes(earlier)
            self._set_rngs(self._rng)
            mode = self._mode()
            skipped = 0 if sampler is not None else self.taken
            if self.over:
                mode = "indices"  # nothing of the pass is loaded: what it drew as it began is drawn again
            it, wrapper = self._patched_iter(skipped if mode == "indices" else 0)
            for _ in range(skipped if mode == "fetch" else 0):
                if next(it, _END) is _END:
                    break
            wrapper.prime()
        finally:
            _set_host(boundary)
        return self._dropped(it) if self.over else self._watch_end(it)

    def _dropped(self, it: Iterator[Any]) -> Iterator[Any]:
        """The iterator of a resumed pass that was over at the save, dropped: no batch of it is left."""
        del it
        if self.over == "end":
            self._counted()  # an adapter (Accelerate's) counted the uninterrupted pass at its end
        elif _persistent(self.loader):
            log.warning("hpcckpt: this DataLoader keeps its worker processes across epochs (persistent_workers=True) "
                        "and the loop left its pass %d before its end (a break): its workers' random streams after "
                        "that cannot be brought back, so random augmentation in them differs from the uninterrupted "
                        "run from here on. For an exact resume use persistent_workers=False for it, or seed "
                        "augmentation from the sample index and epoch", self.passes)
        return iter(())

    def leave(self, how: str) -> None:
        """The current pass is over (``OVER``): a resume of it yields nothing. A pass that ended is
        saved as over only without persistent workers: their streams are brought back by replaying it."""
        if self.over is None and (how == "left" or not _persistent(self.loader)):
            self.over = how

    def _earlier_passes(self, state: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The records of the passes persistent workers ran before the resumed one (to replay);
        a warning, saying which case and what to do, where they cannot be replayed."""
        if not _persistent(self.loader) or self._mode() != "fetch":
            return []
        if self._workers_from and len(self._worker_passes) == self.passes - self._workers_from + 1:
            return self._worker_passes[:-1]
        if self.passes == 0 or "workers" not in state and self.passes == 1:
            return []  # no pass yet; or saved before passes were recorded: the first pass's workers start as then
        why = ("were not all spent in training epochs: an iter() of this loader outside ckpt.batches()/loop() "
               "(a peek, a sanity check, another loop over it) or an epoch left before its end" if "workers" in state
               else "were not recorded by the hpcckpt that saved this checkpoint")
        log.warning("hpcckpt: this DataLoader keeps its worker processes across epochs (persistent_workers=True) "
                    "and their random streams before this resume (epoch %d) %s: random augmentation in the workers "
                    "differs from the uninterrupted run from here on. For an exact resume iterate this loader "
                    "only in whole training epochs, or use persistent_workers=False, or seed augmentation from "
                    "the sample index and epoch", self.passes, why)
        return []

    def _replay_passes(self, records: list[dict[str, Any]]) -> None:
        """Replay the persistent workers' earlier passes: new workers, seeded as the first ones were,
        load every batch of each pass (dropped), so that their random streams are where they were."""
        t0 = time.monotonic()
        samplers = _epoch_samplers(self.loader)
        epochs_now = {role: int(s.epoch) for role, s in samplers.items()}
        batches = 0
        try:
            for record in records:
                rng = record.get("rng") or {}
                self._set_rngs(rng)
                for role, epoch in (record.get("epochs") or {}).items():
                    if role in samplers:
                        samplers[role].set_epoch(epoch)
                for _ in iter(self.loader):
                    batches += 1
        finally:
            for role, epoch in epochs_now.items():
                samplers[role].set_epoch(epoch)
        log.info("hpcckpt: replayed %d batches of %d earlier epochs through this DataLoader's persistent workers "
                 "(%.1f s of data loading), so that their random streams resume where they were",
                 batches, len(records), time.monotonic() - t0)

    def _patched_iter(self, k: int) -> tuple[Iterator[Any], _Skip]:
        """``iter(loader)`` with its index sampler wrapped in ``_Skip(k)`` for this iterator."""
        loader = self.loader
        holder = iterating_loader(loader)
        attr = "batch_sampler" if getattr(holder, "batch_sampler", None) is not None else "sampler"
        inner = getattr(holder, attr, None)
        wrapper = _Skip(inner, k)
        if inner is None:  # nothing to stand in for ("fetch": the caller drops the trained batches)
            it, _ = _begun(loader)
            return it, wrapper
        object.__setattr__(holder, attr, wrapper)  # DataLoader refuses a plain set after __init__
        try:
            it, empty = _begun(loader)  # an adapter's inner iterator is made while the skip stands in
        finally:
            object.__setattr__(holder, attr, inner)
        if empty and k:
            self._counted()
        return it, wrapper

    def _counted(self) -> None:
        """A resumed pass with every batch already trained on: Accelerate's adapter returns
        without counting a pass that yields nothing, where the uninterrupted pass was counted."""
        if self._epoch_counter is not None:
            self.loader.iteration = self._epoch_counter + 1

    def took(self) -> None:
        """One more batch of the current pass reached the training code."""
        self.taken += 1
        sampler = self.resumable
        if sampler is not None:
            size = getattr(self.loader, "batch_size", None) or 1
            sampler.advance(min(size, sampler.per_rank - sampler.consumed))

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"passes": self.passes, "taken": self.taken, "rng": dict(self._rng)}
        if self._rng_iter:
            state["rng_iter"] = dict(self._rng_iter)
        if self._worker_passes or self._workers_from or _persistent(self.loader):
            state["workers"] = {"from": self._workers_from, "passes": [
                {"rng": dict(r.get("rng") or {}), "epochs": dict(r.get("epochs") or {})} for r in self._worker_passes]}
        sampler = self.resumable
        if sampler is not None and self.saves_sampler:
            state["sampler"] = sampler.state_dict()
        if self.stateful:
            state["loader"] = self.loader.state_dict()
        if self._epoch_counter is not None:
            state["iteration"] = self._epoch_counter
        if self.in_epoch is not None:
            state["in_epoch"] = self.in_epoch
        if self.over is not None:
            state["over"] = self.over
        return state

    @staticmethod
    def check_state(state: Any) -> None:
        """Raise CheckpointCorrupt unless ``state`` is a well-formed saved loader position."""
        check_position(state)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.check_state(state)
        self._restored = state
        self._take(state)
        self._epoch_counter = int(state["iteration"]) if "iteration" in state else None
        self.in_epoch = int(state["in_epoch"]) if state.get("in_epoch") is not None else None

    def _take(self, state: Mapping[str, Any]) -> None:
        """What a restore (``load_state_dict``) and the resume of its pass (``_resume``) both take
        from a saved position: its counts, whether its pass was over, the RNG states the pass drew
        from, and the passes of persistent workers."""
        self.passes, self.taken = int(state["passes"]), int(state["taken"])
        over = state.get("over")
        self.over = over if over in OVER else None
        self._rng = dict(state.get("rng") or {})
        self._rng_iter = dict(state.get("rng_iter") or {})
        workers = state.get("workers") or {}
        self._workers_from = int(workers.get("from", 0))
        self._worker_passes = [dict(r) for r in workers.get("passes", [])]

    def settle(self) -> None:
        """The restored pass began in an earlier epoch than the one resuming (a second loader
        of the epoch, whose pass of this epoch had not begun at the save): it is over, and
        the next ``open()`` begins this epoch's pass instead of resuming it (which would
        skip it whole)."""
        self._restored = None
        if _persistent(self.loader):
            log.warning("hpcckpt: this DataLoader keeps its worker processes across epochs (persistent_workers="
                        "True) and had not begun this epoch's pass when the checkpoint was taken: its workers start "
                        "anew, so random augmentation in them differs from the uninterrupted run from here on. For an "
                        "exact resume use persistent_workers=False for it, or seed augmentation from the sample "
                        "index and epoch")


def check_position(state: Any) -> None:
    """Raise CheckpointCorrupt unless ``state`` is a well-formed saved loader position (its
    counts, how its pass was over, its RNG states, its persistent workers' passes, its sampler's)."""
    if not isinstance(state, Mapping):
        raise CheckpointCorrupt(f"loader position is a {type(state).__name__}, not a mapping")
    missing = [k for k in ("passes", "taken") if k not in state]
    if missing:
        raise CheckpointCorrupt(f"loader position lacks {missing}; the checkpoint's data position is damaged")
    if not all(_is_int(state[k]) and state[k] >= 0 for k in ("passes", "taken")):
        raise CheckpointCorrupt(f"loader position has passes={state['passes']!r}, taken={state['taken']!r}")
    if state.get("in_epoch") is not None and not (_is_int(state["in_epoch"]) and state["in_epoch"] >= 0):
        raise CheckpointCorrupt(f"loader position has in_epoch={state['in_epoch']!r}")
    if state.get("over") is not None and state["over"] not in OVER:
        raise CheckpointCorrupt(f"loader position has over={state['over']!r}, not one of {', '.join(OVER)}")
    workers = state.get("workers")
    records: list[Any] = []
    if workers is not None:
        if not (isinstance(workers, Mapping) and _is_int(workers.get("from", 0)) and workers.get("from", 0) >= 0
                and isinstance(workers.get("passes", []), list)):
            raise CheckpointCorrupt("loader position's record of persistent workers is damaged")
        records = list(workers.get("passes", []))
        if not all(isinstance(r, Mapping) and isinstance(r.get("epochs", {}), Mapping)
                   and all(_is_int(e) for e in r.get("epochs", {}).values()) for r in records):
            raise CheckpointCorrupt("loader position's record of persistent workers' passes is damaged")
    for rng in [state.get("rng"), state.get("rng_iter"), *(r.get("rng") for r in records)]:
        if rng is not None and not (isinstance(rng, Mapping) and all(
                isinstance(v, torch.Tensor) and v.dtype == torch.uint8 and v.dim() == 1 for v in rng.values())):
            raise CheckpointCorrupt("loader position's RNG states are not generator states")
        for role, size in _HOST_RNG_BYTES.items():
            if rng is not None and role in rng and rng[role].numel() != size:
                raise CheckpointCorrupt(f"loader position's {role} RNG state has {rng[role].numel()} bytes, "
                                        f"not {size}")
    if "iteration" in state and not (_is_int(state["iteration"]) and state["iteration"] >= 0):
        raise CheckpointCorrupt(f"loader position has iteration={state['iteration']!r}, not a pass count")
    if "sampler" in state:
        ResumableSampler.check_state(state["sampler"])
