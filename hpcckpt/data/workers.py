"""The seeds of persistent workers of the loaders a script iterates outside ``ckpt.batches``
(an evaluation loader): recorded as they start, given back after a resume (``WorkerSeeds``)."""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..errors import CheckpointCorrupt
from .sampler import _is_int

log = logging.getLogger("hpcckpt")

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
