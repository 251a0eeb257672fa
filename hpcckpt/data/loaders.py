"""How a DataLoader is iterated, as a saved pass needs to know it: the wrappers that skip the
batches already trained on (``_Skip``, ``_Skipping``), the generators and samplers a pass
draws from, the host RNGs around a resume, and whether a loader's workers persist."""
from __future__ import annotations

import inspect
import itertools
import random
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

from ..proc.workers import track_iterator
from .sampler import ResumableSampler, _is_int

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
