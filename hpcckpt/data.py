"""A resumable data position: O(1) resume inside an epoch.

The order of epoch ``e`` is a permutation drawn from ``(seed, e)`` alone, so the
position is a few integers: the epoch, where the current partition of it starts and
how many samples of it were consumed. A resumed epoch yields exactly the remaining
samples, each once, without replaying the consumed batches. ``Checkpointer.loop``
counts consumed samples as the batches reach the training code (a DataLoader may
prefetch ahead of that).
"""
from __future__ import annotations

import inspect
import itertools
import logging
import random
import time
from typing import Any, Callable, Iterator, Mapping

import numpy as np
import torch
from torch.utils.data import Sampler

from .errors import CheckpointCorrupt, ConfigError
from .proc.workers import track_iterator

log = logging.getLogger("hpcckpt")


class ResumableSampler(Sampler[int]):
    """Shuffling (or sequential) sampler whose position survives a restart.

    With ``num_replicas > 1`` each rank takes a strided share of the permutation
    (padded like DistributedSampler, by wrapping to the beginning, so that every rank
    sees the same count).

    The position inside epoch ``e`` is ``(start, consumed)``: the current partition
    covers ``perm[start:]`` (``perm`` is the epoch's permutation of the dataset),
    strided over the ``num_replicas`` ranks and padded, and each rank has consumed
    ``consumed`` samples of its share. A new epoch starts at ``start = 0``.

    Resume on the same number of ranks is exact: every rank yields exactly the samples
    it would have yielded without the interruption, in the same order.

    Resume on another number of ranks re-partitions the *remaining* samples of the
    interrupted epoch: the consumed samples of a strided partition are exactly its
    first ``consumed * old_replicas`` positions, so the new partition starts there
    and strides ``perm[start:]`` over the new ranks. The *set* of samples seen in the
    epoch does not change: each sample is seen once (plus the few padding duplicates
    that keep every rank at the same count, when the remaining samples do not divide
    evenly over the ranks). What changes is which rank sees which of the remaining
    samples, and in what order across ranks, so batch composition (and so the
    floating-point result of a step) differs from the uninterrupted run until the
    epoch ends. Later epochs are again whole partitions of their permutation over
    the new ranks.
    """

    def __init__(self, dataset_len: int, *, seed: int = 0, shuffle: bool = True,
                 num_replicas: int = 1, rank: int = 0) -> None:
        if dataset_len <= 0:
            raise ConfigError(f"ResumableSampler needs a non-empty dataset, got length {dataset_len}")
        if num_replicas < 1:
            raise ConfigError(f"ResumableSampler needs num_replicas >= 1, got {num_replicas}")
        if not 0 <= rank < num_replicas:
            raise ConfigError(f"rank {rank} is outside 0..{num_replicas - 1}")
        self.dataset_len = dataset_len
        self.seed = seed
        self.shuffle = shuffle
        self.num_replicas = num_replicas
        self.rank = rank
        self.epoch = 0
        self.consumed = 0  # samples of this rank's share of the current partition already consumed
        self._base = 0     # the current partition of `epoch` covers perm[_base:]
        self._skip = 0     # how many samples of this rank's share the next __iter__ skips

    @property
    def start(self) -> int:
        """Where the current partition of this epoch starts in the epoch's permutation."""
        return self._base

    @property
    def per_rank(self) -> int:
        """Samples per rank in the current partition (padding included)."""
        return -(-(self.dataset_len - self._base) // self.num_replicas)

    def __len__(self) -> int:
        """The length of a whole epoch on this rank, wherever the position is (``len(loader)``
        written after ``register()`` gives the same total as in the uninterrupted run)."""
        return -(-self.dataset_len // self.num_replicas)

    @property
    def exhausted(self) -> bool:
        """Every sample of this rank's share of the current epoch was consumed."""
        return self.consumed >= self.per_rank

    def resume_next_iter(self) -> None:
        """Make the next ``__iter__`` (only that one) start at the consumed position.

        The training iterator of a resumed epoch is the only one that skips: other
        iterators (a ``next(iter(loader))`` peek, an evaluation pass) see the whole
        epoch, as they did in the uninterrupted run. ``Checkpointer.loop``/``batches``
        call this; use it yourself only when you iterate the loader without them.
        """
        self._skip = self.consumed

    def permutation(self, epoch: int) -> torch.Tensor:
        """The order of the whole dataset in ``epoch`` (unpadded, independent of ranks)."""
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed * 1_000_003 + epoch)
            return torch.randperm(self.dataset_len, generator=g)
        return torch.arange(self.dataset_len)

    def order(self, epoch: int) -> torch.Tensor:
        """This rank's share of ``epoch``: of the current partition for the current
        epoch (the remaining samples after a re-partition), of the whole epoch otherwise."""
        base = self._base if epoch == self.epoch else 0
        rest = self.permutation(epoch)[base:]
        if len(rest) == 0:
            return rest
        per_rank = -(-len(rest) // self.num_replicas)
        total = per_rank * self.num_replicas
        if total > len(rest):  # pad by wrapping to the beginning of the remainder
            reps = -(-total // len(rest))
            rest = rest.repeat(reps)[:total]
        return rest[self.rank::self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        mine = self.order(self.epoch)
        skip = self._skip
        self._skip = 0
        return iter(mine[skip:].tolist())

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` (a no-op for the current epoch, so a resumed position survives
        the ``sampler.set_epoch(epoch)`` at the top of an epoch loop)."""
        if epoch != self.epoch:
            self.epoch = epoch
            self.consumed = 0
            self._base = 0
            self._skip = 0

    def advance(self, n_samples: int) -> None:
        """Record that ``n_samples`` more samples reached the training code."""
        self.consumed += n_samples

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "consumed": self.consumed, "start": self._base, "seed": self.seed,
                "dataset_len": self.dataset_len, "num_replicas": self.num_replicas}

    @staticmethod
    def check_state(state: Any) -> None:
        """Raise CheckpointCorrupt unless ``state`` is a well-formed saved sampler state."""
        if not isinstance(state, Mapping):
            raise CheckpointCorrupt(f"sampler state is a {type(state).__name__}, not a mapping")
        missing = [k for k in ("epoch", "consumed", "seed", "dataset_len", "num_replicas") if k not in state]
        if missing:
            raise CheckpointCorrupt(f"sampler state lacks {missing}; it was not saved by "
                                    "ResumableSampler.state_dict")
        bad = [k for k in ("epoch", "consumed", "start", "seed", "dataset_len", "num_replicas")
               if k in state and not _is_int(state[k])]
        if bad:
            raise CheckpointCorrupt(f"sampler state has non-integer {bad}")

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.check_state(state)
        for key in ("seed", "dataset_len"):
            if state[key] != getattr(self, key):
                raise ConfigError(
                    f"sampler {key} was {state[key]} when the checkpoint was saved and is "
                    f"{getattr(self, key)} now; resume with the same {key} (the position in the "
                    f"epoch only means something for the same data order)")
        epoch, consumed = int(state["epoch"]), int(state["consumed"])
        start = int(state.get("start", 0))  # states saved before re-partitioning existed start at 0
        replicas = int(state["num_replicas"])
        if epoch < 0 or consumed < 0 or replicas < 1 or not 0 <= start <= self.dataset_len:
            raise CheckpointCorrupt(
                f"sampler state is inconsistent (epoch={epoch}, consumed={consumed}, start={start}, "
                f"num_replicas={replicas}, dataset_len={self.dataset_len}): the checkpoint's sampler "
                "state is damaged")
        self.epoch = epoch
        if replicas == self.num_replicas:
            # Same world size: the exact position, so every rank yields what it would have.
            self._base = start
            self.consumed = consumed
        else:
            # Another world size: the consumed samples of a strided partition are its first
            # consumed * replicas positions (past the remainder's length they are padding
            # duplicates); the rest of the epoch is partitioned over the new ranks.
            self._base = min(self.dataset_len, start + consumed * replicas)
            self.consumed = 0
            self._skip = 0


# --- any DataLoader: the position of its training pass, replayed exactly ----------------------

SKIP_MODES = ("auto", "indices", "fetch")
OVER = ("left", "end")  # how a saved pass was over (LoaderPosition.over)
_END = object()


class _Skip:
    """Stands in for a loader's index sampler while one iterator is created: drops its first ``k`` items.

    Every ``__iter__`` during the creation is the inner sampler's own ``iter()`` (the same draws,
    at the same moments: torch's multi-process iterator calls it twice, once in its base class
    and once in its first ``_reset``, and uses the second), with the skip laid over it, lazily
    like the sampler it wraps (torch's iterator draws its worker seed before the sampler draws
    its permutation, and the order of those draws must not change). ``prime()`` then forces the
    skip and the first draw of the iterator in use, so that both happen while the RNGs hold the
    epoch's starting state, and ends the stand-in: later iterators (persistent workers keep the
    wrapper as their index sampler) are the inner sampler's own.
    """

    def __init__(self, inner: Any, k: int) -> None:
        self.inner, self.k = inner, k
        self._active = True
        self._latest: _Skipping | None = None

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str) -> Any:
        """Everything else is the inner sampler's: an adapter's ``__iter__`` (Accelerate's) calls
        ``set_epoch`` on the batch sampler and on its ``sampler`` while this one stands in."""
        inner = self.__dict__.get("inner")
        if inner is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(inner, name)

    def __iter__(self) -> Iterator[Any]:
        if not self._active:
            return iter(self.inner)
        self._latest = _Skipping(iter(self.inner), self.k)
        return self._latest

    def prime(self) -> None:
        self._active = False
        if self._latest is not None:
            self._latest.prime()


class _Skipping:
    """One iterator of the inner sampler, less its first ``k`` items (``_Skip``)."""

    def __init__(self, pending: Iterator[Any], k: int) -> None:
        self._pending, self.k = pending, k
        self._buffer: list[Any] | None = None  # None: not primed yet

    def __iter__(self) -> Iterator[Any]:
        return self

    def prime(self) -> None:
        if self._buffer is not None:
            return
        for _ in range(self.k):
            if next(self._pending, _END) is _END:
                self._buffer = [_END]
                return
        self._buffer = [next(self._pending, _END)]

    def __next__(self) -> Any:
        self.prime()
        assert self._buffer is not None
        if self._buffer:
            item = self._buffer.pop()
            if item is _END:
                self._buffer = [_END]  # stays exhausted
                raise StopIteration
            return item
        return next(self._pending)


def _generators(loader: Any) -> dict[str, torch.Generator]:
    """The torch generators a loader's iteration draws from, by role (the same object once)."""
    found: dict[str, torch.Generator] = {}
    seen: set[int] = set()
    batch_sampler = getattr(loader, "batch_sampler", None)
    for role, owner in (("loader", loader), ("sampler", getattr(loader, "sampler", None)),
                        ("batch_sampler.sampler", getattr(batch_sampler, "sampler", None))):
        g = getattr(owner, "generator", None)
        if isinstance(g, torch.Generator) and id(g) not in seen:
            seen.add(id(g))
            found[role] = g
    return found


def _draws_global(loader: Any, gens: Mapping[str, torch.Generator]) -> bool:
    """Whether a pass's order or its workers' seeds come from the global torch RNG.

    A worker process is seeded from a draw of the global RNG (or the loader's generator)
    at ``iter()``; a sampler without a generator of its own (``RandomSampler``, or one
    hpcckpt does not know) draws its order from it. Samplers known to draw nothing from
    it need no snapshot of it (5 KB per rank and loader).
    """
    if getattr(loader, "num_workers", 0) > 0 and "loader" not in gens:
        return True
    return _sampler_draws_global(loader)


def _sampler_draws_global(loader: Any) -> bool:
    """Whether a pass's order comes from the global torch RNG (a sampler without a generator of its own)."""
    from torch.utils.data import DistributedSampler, SequentialSampler
    inner = getattr(getattr(loader, "batch_sampler", None), "sampler", None) or getattr(loader, "sampler", None)
    quiet = (SequentialSampler, DistributedSampler, ResumableSampler)
    return not isinstance(inner, quiet) and not isinstance(getattr(inner, "generator", None), torch.Generator)


def _sampler_unknown(loader: Any) -> bool:
    """Whether a sampler of the loader is not one of torch's (or hpcckpt's): its own ``__iter__``
    may draw its order from Python's ``random`` or NumPy's global RNG (the bucketing batch
    samplers of many scripts shuffle with ``random.shuffle``), which a pass's start then records
    besides the torch RNG."""
    from torch.utils.data import sampler as samplers
    holder = iterating_loader(loader)
    known = (samplers.SequentialSampler, samplers.RandomSampler, samplers.SubsetRandomSampler,
             samplers.WeightedRandomSampler, samplers.BatchSampler, torch.utils.data.DistributedSampler,
             ResumableSampler, _Skip)
    found = [getattr(holder, "sampler", None), getattr(holder, "batch_sampler", None),
             getattr(getattr(holder, "batch_sampler", None), "sampler", None)]
    if all(s is None for s in found):
        # No sampler at all: a generator or an iterable of the script's own, which may draw its
        # order as its pass begins (`np.random.permutation`, `random.shuffle`: batch generators
        # of many scripts); a resumed pass that draws it from the resume point's RNGs takes
        # another order. Containers draw nothing.
        return not isinstance(holder, (range, list, tuple, str, bytes, torch.Tensor, np.ndarray))
    return any(s is not None and not isinstance(s, known) for s in found)


# The host RNGs besides torch's that a pass's start may record, as uint8 tensors like torch's state.
def _python_state() -> torch.Tensor:
    version, words, gauss = random.getstate()
    head = np.array([version, gauss is not None], dtype=np.uint32).view(np.uint8)
    return torch.from_numpy(np.concatenate([head, np.asarray(words, dtype=np.uint32).view(np.uint8),
                                            np.array([gauss or 0.0], dtype=np.float64).view(np.uint8)]))


def _set_python_state(state: torch.Tensor) -> None:
    raw = state.numpy()
    version, has_gauss = raw[:8].view(np.uint32).tolist()
    words = raw[8:-8].view(np.uint32).tolist()
    gauss = float(raw[-8:].view(np.float64)[0]) if has_gauss else None
    random.setstate((version, tuple(words), gauss))


def _numpy_state() -> torch.Tensor:
    _, keys, pos, has_gauss, cached = np.random.get_state()
    return torch.from_numpy(np.concatenate([np.asarray(keys, dtype=np.uint32).view(np.uint8),
                                            np.array([pos, has_gauss], dtype=np.int64).view(np.uint8),
                                            np.array([cached], dtype=np.float64).view(np.uint8)]))


def _set_numpy_state(state: torch.Tensor) -> None:
    raw = state.numpy()
    pos, has_gauss = raw[-24:-8].view(np.int64).tolist()
    np.random.set_state(("MT19937", raw[:-24].view(np.uint32).copy(), pos, has_gauss,
                         float(raw[-8:].view(np.float64)[0])))


_HOST_RNG_BYTES = {"python": 8 + 625 * 4 + 8, "numpy": 624 * 4 + 16 + 8}
_HOST_RNG = {"torch": (torch.get_rng_state, torch.set_rng_state), "python": (_python_state, _set_python_state),
             "numpy": (_numpy_state, _set_numpy_state)}


def _host_boundary() -> dict[str, torch.Tensor]:
    """The host RNGs as they are (put back with ``_set_host``)."""
    return {role: get() for role, (get, _) in _HOST_RNG.items()}


def _set_host(rng: Mapping[str, torch.Tensor]) -> None:
    """Set the host RNGs ``rng`` holds (torch, python, numpy), each to its saved state."""
    for role, (_, put) in _HOST_RNG.items():
        if role in rng:
            put(rng[role])


def _persistent(loader: Any) -> bool:
    """The loader keeps its worker processes, and so their random streams, from one pass to the next."""
    return bool(getattr(loader, "persistent_workers", False)) and getattr(loader, "num_workers", 0) > 0


def _epoch_samplers(loader: Any) -> dict[str, Any]:
    """The loader's samplers whose order depends on an epoch they are told (``set_epoch``), by role."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    found: dict[str, Any] = {}
    for role, owner in (("sampler", getattr(loader, "sampler", None)), ("batch_sampler", batch_sampler),
                        ("batch_sampler.sampler", getattr(batch_sampler, "sampler", None))):
        if (callable(getattr(owner, "set_epoch", None)) and _is_int(getattr(owner, "epoch", None))
                and all(owner is not o for o in found.values())):
            found[role] = owner
    return found


def _drop_unused_iterator(loader: Any) -> None:
    """Forget the iterator a StatefulDataLoader makes when its ``state_dict()`` is asked for before any
    ``iter()`` (a save's capture, an engine planning its layout at ``register()``): it drew its worker
    seed and order then, not where the pass begins, and ``iter()`` would hand it out as the pass's."""
    if getattr(loader, "_initial_iter_for_state_dict", False) and callable(getattr(loader, "load_state_dict", None)):
        loader.load_state_dict({})  # torchdata: drops that iterator, keeps a restored position (next_iter_state)


def iterating_loader(loader: Any) -> Any:
    """The DataLoader whose samplers a pass draws from: ``loader`` itself, or the one an adapter
    wraps and iterates inside its own ``__iter__`` (Hugging Face Accelerate's ``DataLoaderShard``
    and ``DataLoaderDispatcher`` keep it as ``base_dataloader`` and pass every other attribute
    through to it). A sampler is swapped on the object that holds it."""
    base = getattr(loader, "__dict__", {}).get("base_dataloader")
    return base if isinstance(base, torch.utils.data.DataLoader) else loader


def _epoch_counter(loader: Any) -> int | None:
    """An adapter's own count of the passes it began (Accelerate's ``iteration``, which its
    ``__iter__`` hands to the samplers' ``set_epoch``); None for a plain loader."""
    if iterating_loader(loader) is loader:
        return None
    value = getattr(loader, "__dict__", {}).get("iteration")
    return value if _is_int(value) else None


def _begun(loader: Any) -> tuple[Iterator[Any], bool]:
    """``iter(loader)``, and whether the pass yields nothing. A wrapper whose ``__iter__`` is a
    generator (Accelerate's adapter, a loop's own ``for batch in self.loader: yield ...``) makes
    the inner loader's iterator, which draws the pass's order and worker seed, only at its first
    ``next()``: that ``next()`` is taken here, so the draws happen now, while the caller holds the
    RNGs where the pass begins, and its batch is handed out first."""
    it = iter(loader)
    if not inspect.isgenerator(it):
        track_iterator(it)  # quieted workers of a pass still open at the exit end with it
        return it, False
    first = next(it, _END)
    if first is _END:
        return iter(()), True
    return itertools.chain((first,), it), False


def find_resumable(loader: Any) -> ResumableSampler | None:
    """The ResumableSampler that drives ``loader`` (its sampler, or its batch sampler's)."""
    for candidate in (getattr(loader, "sampler", None),
                      getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        if isinstance(candidate, ResumableSampler):
            return candidate
    return None


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


# --- loaders iterated outside ckpt.batches: the seed persistent workers drew -------------------

_SEED_ATTR = "_hpcckpt_given_seed"


def _signature(loader: Any) -> str:
    """A loader's name from what it is (its dataset's class and length, batch size, workers): the
    same in every run of the script; its order among the loaders of that name tells them apart."""
    dataset = getattr(loader, "dataset", None)
    try:
        size = str(len(dataset))  # type: ignore[arg-type]  # an iterable dataset may have none: TypeError
    except Exception:  # noqa: BLE001 - no len(): named without it
        size = "?"
    return (f"{type(dataset).__qualname__}[{size}] batch_size={getattr(loader, 'batch_size', None)} "
            f"num_workers={getattr(loader, 'num_workers', 0)}")


_seeded_class: Any = None


def _seeded_iterator(loader: Any, seed: int) -> Any:
    """``loader._get_iterator()`` of a loader with worker processes, whose workers' base seed is
    ``seed`` instead of a draw from the global torch RNG (or the loader's generator): torch's
    multi-process iterator, with a class between it and its base that puts the RNGs back after
    the base class's draw and sets the seed, before the workers start."""
    global _seeded_class
    from torch.utils.data import dataloader as tdl
    if _seeded_class is None:
        class _GivenSeed(tdl._BaseDataLoaderIter):
            def __init__(self, loader: Any) -> None:
                host = torch.get_rng_state()
                gen = loader.generator.get_state() if isinstance(loader.generator, torch.Generator) else None
                super().__init__(loader)
                torch.set_rng_state(host)
                if gen is not None:
                    loader.generator.set_state(gen)
                self._base_seed = int(loader.__dict__[_SEED_ATTR])

        _seeded_class = type("_MultiProcessingDataLoaderIter", (tdl._MultiProcessingDataLoaderIter, _GivenSeed), {})
    loader.check_worker_number_rationality()
    loader.__dict__[_SEED_ATTR] = seed
    try:
        return _seeded_class(loader)
    finally:
        loader.__dict__.pop(_SEED_ATTR, None)


class WorkerSeeds:
    """The base seed each DataLoader with persistent workers drew as its workers started (its
    first pass: torch draws it from the global torch RNG, or the loader's generator, once per
    loader object, not at each pass), for the loaders the script iterates outside
    ``ckpt.batches``/``loop`` (an evaluation loader; the training loaders' passes are replayed
    by ``LoaderPosition``). Saved with the checkpoint; after a resume the same loader's first
    pass takes its recorded seed back instead of drawing: the uninterrupted run drew it after
    its first evaluation (epoch 0), a resumed run would draw it at its first evaluation, a draw
    more in the stream the next epoch's shuffle comes from, and the training order would differ
    from there on. Loaders are named by ``_signature`` and their order of start in the process.

    While a Checkpointer is open, ``DataLoader._get_iterator`` (torch's, which only a loader's
    first pass calls when its workers persist) goes through ``_hooked_get_iterator``; loaders of
    a class with an ``_get_iterator`` of its own are not seen. A loader whose seed is given back
    starts its workers anew: random augmentation in them starts from their first epoch's
    streams (an evaluation without it is exact). Where a name's loaders were not all alive at
    the save (a loader made anew each epoch draws anew in every run alike), nothing is given
    back for it; where such a name also had a live loader, its first pass after the resume is
    named with the fix (``unsure``)."""

    def __init__(self) -> None:
        self._started: list[tuple[Any, str, str, int]] = []  # (weak loader, signature, name, seed), in order
        self._counts: dict[str, int] = {}
        self._pending: dict[str, int] = {}  # restored: name -> the seed to give back
        self._unsure: set[str] = set()  # restored: signatures whose loaders cannot be told apart
        self.training: Callable[[], set[int]] = set  # ids of the loaders trained through positions
        self.on_unsure: Callable[[str], None] | None = None  # told the signature named (hpcckpt check's trace)

    def start(self, loader: Any, real: Callable[[Any], Any]) -> Any:
        """The first pass of ``loader`` (persistent workers): its iterator, seeded as recorded if it is."""
        import weakref
        sig = _signature(loader)
        n = self._counts.get(sig, 0)
        self._counts[sig] = n + 1
        name = f"{sig}#{n}"
        seed = self._pending.pop(name, None)
        if seed is not None and id(loader) not in self.training():
            it = _seeded_iterator(loader, seed)
            log.info("hpcckpt: the DataLoader over %s starts its persistent workers with the seed it took in the "
                     "uninterrupted run (not a draw from the global torch RNG, which the training order comes from)",
                     sig)
        else:
            if sig in self._unsure and id(loader) not in self.training():
                self._unsure.discard(sig)
                log.warning(
                    "hpcckpt: the DataLoader over %s keeps its worker processes across epochs (persistent_workers="
                    "True) and is iterated outside ckpt.batches (an evaluation): its first pass in this run draws "
                    "its workers' seed from the global torch RNG, and hpcckpt cannot tell which of the loaders of the "
                    "uninterrupted run it is (some were made anew), so that draw may come at another point than "
                    "there and shift the random stream the training order comes from. Make it once, before the "
                    "training loop, or give it a generator of its own (DataLoader(..., generator=torch.Generator())"
                    "), or use persistent_workers=False for it (nothing is lost where the script makes such a loader "
                    "anew each epoch: every run draws then alike)", sig)
                if self.on_unsure is not None:
                    self.on_unsure(sig)
            it = real(loader)
        base = getattr(it, "_base_seed", None)
        if isinstance(base, int):
            self._started.append((weakref.ref(loader), sig, name, base))
        return it

    def state_dict(self) -> dict[str, Any]:
        """``{"seeds": {name: seed}, "unsure": [signature]}`` of the loaders iterated outside the
        training passes (pending ones of a resume carried on); empty when there are none."""
        training = self.training()
        dead = {sig for ref, sig, _, _ in self._started if ref() is None}
        seeds = {name: seed for name, seed in self._pending.items() if name.rpartition("#")[0] not in dead}
        unsure = set(self._unsure)
        for ref, sig, name, seed in self._started:
            loader = ref()
            if loader is None or id(loader) in training:
                continue
            if sig in dead:
                unsure.add(sig)
            else:
                seeds[name] = seed
        out: dict[str, Any] = {}
        if seeds:
            out["seeds"] = seeds
        if unsure:
            out["unsure"] = sorted(unsure)
        return out

    @staticmethod
    def check_state(state: Any) -> None:
        if not isinstance(state, Mapping):
            raise CheckpointCorrupt("the record of persistent workers' seeds is damaged")
        seeds, unsure = state.get("seeds", {}), state.get("unsure", [])
        if not (isinstance(seeds, Mapping) and all(isinstance(k, str) and _is_int(v) for k, v in seeds.items())
                and isinstance(unsure, list) and all(isinstance(u, str) for u in unsure)):
            raise CheckpointCorrupt("the record of persistent workers' seeds is damaged")

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.check_state(state)
        self._pending = {str(k): int(v) for k, v in (state.get("seeds") or {}).items()}
        self._unsure = set(state.get("unsure") or [])

    def install(self) -> None:
        """Follow the first passes of loaders with persistent workers (until ``uninstall``)."""
        import weakref
        from torch.utils.data import DataLoader
        global _real_get_iterator
        _active.append(weakref.ref(self))
        if DataLoader.__dict__.get("_get_iterator") is not _hooked_get_iterator:
            _real_get_iterator = DataLoader.__dict__["_get_iterator"]
            DataLoader._get_iterator = _hooked_get_iterator  # type: ignore[method-assign]

    def uninstall(self) -> None:
        from torch.utils.data import DataLoader
        _active[:] = [r for r in _active if r() is not None and r() is not self]
        if not _active and DataLoader.__dict__.get("_get_iterator") is _hooked_get_iterator:
            DataLoader._get_iterator = _real_get_iterator  # type: ignore[method-assign]


_active: list[Any] = []  # weak references to the WorkerSeeds of the open Checkpointers, the newest last
_real_get_iterator: Any = None


def _hooked_get_iterator(self: Any) -> Any:
    """``DataLoader._get_iterator`` while a Checkpointer is open: a loader's first pass with
    persistent workers goes through the newest open Checkpointer's ``WorkerSeeds``."""
    seeds = next((s for s in (r() for r in reversed(_active)) if s is not None), None)
    if seeds is None or not (getattr(self, "persistent_workers", False) and getattr(self, "num_workers", 0) > 0):
        return _real_get_iterator(self)
    return seeds.start(self, _real_get_iterator)


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


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
