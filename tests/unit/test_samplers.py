"""Adding hpcckpt changes no run's data: torch's own samplers, index for index, resumed or not.

Each case is a script over a DataLoader as users write it (``shuffle=True`` with or without
a generator, an explicit ``RandomSampler``, ``DistributedSampler`` with 2 ranks, padding and
drop_last, worker processes with random augmentation). It runs once plain (no hpcckpt),
once integrated and uninterrupted, and integrated with real stops (SIGUSR2 through the
real handler) mid-epoch and at an epoch boundary, each part in a fresh set of objects
as a restarted process would have. Every batch's indices, every augmentation draw and
the global RNG stream of the training code must be the same.
"""
from __future__ import annotations

import logging
import os
import random
import signal
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, RandomSampler, TensorDataset

from hpcckpt.api import Checkpointer, RequeueExit
from hpcckpt.data import LoaderPosition, ResumableSampler

pytestmark = [pytest.mark.native,
              # torchdata 0.11's StatefulDataLoader warns on every iterator (a deprecated torch call of its own)
              pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")]

N = 22  # not a multiple of the batch size nor of 2 ranks: short last batches and padding
EPOCHS = 3


class Augmenting(Dataset[tuple[int, float]]):
    """Random augmentation drawn in the worker processes from torch, random and numpy (each worker
    seeds all three; their streams must resume)."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> tuple[int, float]:
        return i, float(torch.rand(()).item()) + random.random() + float(np.random.rand())


def indices() -> TensorDataset:
    return TensorDataset(torch.arange(N))


LOADERS: dict[str, Callable[[], tuple[DataLoader[Any], Any]]] = {
    "shuffle": lambda: (DataLoader(indices(), batch_size=4, shuffle=True), None),
    "shuffle+generator": lambda: (DataLoader(indices(), batch_size=4, shuffle=True,
                                             generator=torch.Generator().manual_seed(11)), None),
    "RandomSampler(generator)": lambda: (DataLoader(indices(), batch_size=3, sampler=RandomSampler(
        indices(), generator=torch.Generator().manual_seed(5))), None),
    "sequential, drop_last": lambda: (DataLoader(indices(), batch_size=4, drop_last=True), None),
    "ResumableSampler": lambda: _with_sampler(ResumableSampler(N, seed=3), batch_size=4),
    **{f"DistributedSampler rank {r}{' drop_last' if d else ''}": (
        lambda r=r, d=d: _with_sampler(DistributedSampler(indices(), num_replicas=2, rank=r, seed=9, drop_last=d),
                                       batch_size=3))
       for r in (0, 1) for d in (False, True)},
    "workers augmenting": lambda: (DataLoader(Augmenting(), batch_size=4, shuffle=True, num_workers=2), None),
    "workers augmenting, generator": lambda: (DataLoader(Augmenting(), batch_size=4, shuffle=True, num_workers=2,
                                                         generator=torch.Generator().manual_seed(11)), None),
}
# Persistent workers: seeded once, at the first epoch; their streams run on across epochs.
PERSISTENT = dict(num_workers=2, persistent_workers=True)
LOADERS |= {
    "persistent workers augmenting": lambda: (DataLoader(Augmenting(), batch_size=4, shuffle=True, **PERSISTENT),
                                              None),
    "persistent workers, generator": lambda: (DataLoader(Augmenting(), batch_size=4, shuffle=True, **PERSISTENT,
                                                         generator=torch.Generator().manual_seed(11)), None),
    "persistent workers, DistributedSampler": lambda: _with_sampler(
        DistributedSampler(indices(), num_replicas=2, rank=1, seed=9), batch_size=3, dataset=Augmenting(),
        **PERSISTENT),
}


class Stream(torch.utils.data.IterableDataset[tuple[int, float]]):
    """An iterable dataset with random augmentation (no state_dict: torchdata fast-forwards it)."""

    def __iter__(self):  # type: ignore[no-untyped-def]
        g = torch.Generator().manual_seed(21)
        for i in range(N):
            yield i, float(torch.rand((), generator=g).item())


LOADERS["IterableDataset"] = lambda: (DataLoader(Stream(), batch_size=4), None)
LOADERS["IterableDataset, workers"] = lambda: (DataLoader(Stream(), batch_size=4, num_workers=1), None)


class AugmentedStream(torch.utils.data.IterableDataset[tuple[int, float]]):
    """Each worker streams the items with random augmentation from its own (seeded) RNG."""

    def __iter__(self):  # type: ignore[no-untyped-def]
        for i in range(N):
            yield i, float(torch.rand(()).item())


LOADERS["persistent workers, IterableDataset"] = lambda: (DataLoader(AugmentedStream(), batch_size=4, **PERSISTENT),
                                                          None)


class Wrapped:
    """A script's own wrapper of its loader (a device move per batch): no sampler hpcckpt could
    skip on, a generator as its ``__iter__``; the trained batches are loaded again and dropped."""

    def __init__(self, loader: DataLoader[Any]) -> None:
        self.loader = loader

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):  # type: ignore[no-untyped-def]
        for batch in self.loader:
            yield [t.to("cpu") for t in batch]


class BucketBatches(torch.utils.data.Sampler[list[int]]):
    """A script's own batch sampler: batches of neighbouring items (similar lengths), shuffled
    with Python's ``random`` or NumPy's global RNG as its ``__iter__`` begins."""

    def __init__(self, rng: str) -> None:
        self.rng = rng

    def __len__(self) -> int:
        return -(-N // 4)

    def __iter__(self):  # type: ignore[no-untyped-def]
        batches = [list(range(i, min(i + 4, N))) for i in range(0, N, 4)]
        if self.rng == "python":
            random.shuffle(batches)
        else:
            batches = [batches[i] for i in np.random.permutation(len(batches))]
        yield from batches


LOADERS |= {f"own batch sampler, {rng}": (lambda rng=rng: (DataLoader(indices(), batch_sampler=BucketBatches(rng)),
                                                            None)) for rng in ("python", "numpy")}
LOADERS["wrapper of shuffle"] = lambda: (Wrapped(DataLoader(indices(), batch_size=4, shuffle=True)), None)
LOADERS["wrapper of workers augmenting"] = lambda: (Wrapped(DataLoader(Augmenting(), batch_size=4, shuffle=True,
                                                                       num_workers=2)), None)

try:
    from torchdata.stateful_dataloader import StatefulDataLoader
except ImportError:  # torchdata is optional: these cases run where it is installed
    StatefulDataLoader = None
if StatefulDataLoader is not None:
    LOADERS["StatefulDataLoader shuffle"] = lambda: (StatefulDataLoader(indices(), batch_size=4, shuffle=True), None)
    LOADERS["StatefulDataLoader shuffle+generator"] = lambda: (StatefulDataLoader(
        indices(), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(11)), None)
    LOADERS["StatefulDataLoader IterableDataset"] = lambda: (StatefulDataLoader(Stream(), batch_size=4), None)
    LOADERS["StatefulDataLoader workers"] = lambda: (StatefulDataLoader(Augmenting(), batch_size=4, shuffle=True,
                                                                        num_workers=2), None)
    LOADERS["StatefulDataLoader persistent workers"] = lambda: (StatefulDataLoader(
        Augmenting(), batch_size=4, shuffle=True, **PERSISTENT), None)


def _with_sampler(sampler: Any, *, batch_size: int, dataset: Any = None, **kw: Any) -> tuple[DataLoader[Any], Any]:
    return DataLoader(indices() if dataset is None else dataset, batch_size=batch_size, sampler=sampler, **kw), sampler


def record(out: list[Any], epoch: int, batch: Any) -> None:
    """The batch as seen, plus one draw of the training code's global RNGs (dropout's, a script's
    own ``random`` and NumPy draws)."""
    first = batch[0]
    out.append((epoch, first.tolist(), [float.hex(x) for x in batch[1].tolist()] if len(batch) > 1 else None,
                float.hex(torch.rand(()).item()), float.hex(random.random()), float.hex(float(np.random.rand()))))


def _seed() -> None:
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)


def plain(make: Callable[[], tuple[DataLoader[Any], Any]], *, peek: bool = False) -> list[Any]:
    """The script without hpcckpt."""
    _seed()
    loader, sampler = make()
    torch.nn.Linear(1, 1)  # the model the integrated script registers (its init draws too)
    out: list[Any] = []
    for epoch in range(EPOCHS):
        if peek:
            next(iter(loader))
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        for batch in loader:
            record(out, epoch, batch)
        out.append(("end", epoch, float.hex(torch.rand(()).item())))  # per-epoch code (evaluation...)
    return out


def integrated(ckdir: Path, make: Callable[[], tuple[DataLoader[Any], Any]], out: list[Any], *,
               stop_at: int | None = None, peek: bool = False, engine: str = "sync",
               register_loader: bool = False, skip: str = "auto") -> None:
    """The same script with hpcckpt (epochs + batches); SIGUSR2 during step ``stop_at``.
    ``register_loader``: the loader is registered too, as any stateful object (a StatefulDataLoader)."""
    _seed()
    loader, sampler = make()
    model = torch.nn.Linear(1, 1)
    ck = Checkpointer(ckdir, every_steps=None, engine=engine)
    ck.register(model=model, **({"loader": loader} if register_loader else {}))
    try:
        for epoch in ck.epochs(EPOCHS):
            if peek:
                next(iter(loader))
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(epoch)
            for batch in ck.batches(loader, skip=skip):
                record(out, epoch, batch)
                if stop_at is not None and ck.step + 1 == stop_at:
                    os.kill(os.getpid(), signal.SIGUSR2)
            out.append(("end", epoch, float.hex(torch.rand(()).item())))
    finally:
        stop_workers(loader)


def stop_workers(loader: Any) -> None:
    """End the worker processes a loader keeps (persistent ones, a StatefulDataLoader's) now, as the end
    of a restarted process would: left to the garbage collector (the stopped run's traceback holds them
    in a cycle), their queues may be finalized first, and each worker then takes torch's 5 s join
    timeout to be killed."""
    it = getattr(loader, "_iterator", None)
    if it is not None and hasattr(it, "_shutdown_workers"):
        it._shutdown_workers()


def with_stops(ckdir: Path, make: Callable[[], tuple[DataLoader[Any], Any]], stops: list[int],
               **kw: Any) -> list[Any]:
    out: list[Any] = []
    for stop in stops:
        with pytest.raises(RequeueExit) as exc:
            integrated(ckdir, make, out, stop_at=stop, **kw)
        assert exc.value.step == stop
        traceback.clear_frames(exc.tb)  # the stopped run's loader iterators end now (see stop_workers)
    integrated(ckdir, make, out, **kw)
    return out


# Both engines for the loaders users have most (a generator, an iterable dataset, worker processes,
# persistent ones, torchdata's); the sync engine for the rest, to keep the suite fast. (Persistent
# workers are stopped at more places, on both engines, in test_persistent_workers_resume_exactly.)
BOTH_ENGINES = {"shuffle", "shuffle+generator", "IterableDataset", "IterableDataset, workers", "workers augmenting",
                "workers augmenting, generator", "persistent workers augmenting", "wrapper of shuffle",
                "StatefulDataLoader shuffle", "StatefulDataLoader shuffle+generator",
                "StatefulDataLoader IterableDataset", "StatefulDataLoader workers"}
assert {c for c in BOTH_ENGINES if not c.startswith("StatefulDataLoader")} <= set(LOADERS)  # names, not typos


def _engine_cases() -> list[Any]:
    return [pytest.param(case, engine, id=f"{case}-{engine}") for case in LOADERS
            for engine in (("sync", "concurrent") if case in BOTH_ENGINES else ("sync",))]


@pytest.mark.parametrize("case, engine", _engine_cases())
def test_integrated_run_keeps_the_data_order_and_resumes_it(case: str, engine: str, tmp_path: Path) -> None:
    make = LOADERS[case]
    ref = plain(make)
    per_epoch = sum(1 for _ in make()[0])  # len() is unknown for an iterable dataset
    uninterrupted: list[Any] = []
    integrated(tmp_path / "a", make, uninterrupted, engine=engine)
    assert uninterrupted == ref  # adding hpcckpt changes nothing
    # mid-epoch, then exactly at an epoch's end (its per-epoch code not yet run)
    assert with_stops(tmp_path / "b", make, [per_epoch + 1, 2 * per_epoch], engine=engine) == ref


@pytest.mark.skipif(StatefulDataLoader is None, reason="needs torchdata (pip install 'torchdata==0.11.*')")
@pytest.mark.parametrize("case", ["shuffle", "shuffle+generator", "IterableDataset", "workers"])
@pytest.mark.parametrize("engine", ["sync", "concurrent"])
def test_a_registered_stateful_dataloader_resumes_exactly(case: str, engine: str, tmp_path: Path) -> None:
    """``ckpt.register(loader=loader)``, as any stateful object, and trained through ``ckpt.batches``."""
    make = LOADERS[f"StatefulDataLoader {case}"]
    ref = plain(make)
    per_epoch = sum(1 for _ in make()[0])
    uninterrupted: list[Any] = []
    integrated(tmp_path / "a", make, uninterrupted, engine=engine, register_loader=True)
    if case == "workers" and engine == "concurrent":
        # The concurrent engine asks the registered objects for their state at register() (to lay out
        # its staging): the loader's state_dict() then starts its first epoch's workers and draws their
        # seed and order there; hpcckpt drops that iterator, so the first epoch differs from the script
        # without hpcckpt (README). Resumes are still exact. (Should this start to fail, the engine no
        # longer asks at register(): compare with ref here too and drop the README's caveat.)
        assert uninterrupted != ref
    else:
        assert uninterrupted == ref
    stops = [2, per_epoch, 2 * per_epoch - 1]  # mid-epoch, an epoch's end, the last batch of an epoch
    assert with_stops(tmp_path / "b", make, stops, engine=engine, register_loader=True) == uninterrupted


@pytest.mark.skipif(StatefulDataLoader is None, reason="needs torchdata (pip install 'torchdata==0.11.*')")
@pytest.mark.parametrize("engine", ["sync", "concurrent"])
def test_loop_accepts_a_registered_stateful_dataloader(engine: str, tmp_path: Path) -> None:
    def run(ckdir: Path, out: list[Any], stop_at: int | None = None) -> None:
        torch.manual_seed(0)
        loader = StatefulDataLoader(Stream(), batch_size=4)
        model = torch.nn.Linear(1, 1)
        ck = Checkpointer(ckdir, every_steps=None, engine=engine)
        ck.register(model=model, loader=loader)
        for step, batch in ck.loop(loader, 14):  # 6 batches a pass: 2 passes and 2 batches
            out.append((step, batch[0].tolist(), batch[1].tolist(), float.hex(torch.rand(()).item())))
            if stop_at is not None and step + 1 == stop_at:
                os.kill(os.getpid(), signal.SIGUSR2)

    ref: list[Any] = []
    run(tmp_path / "a", ref)
    assert [s for s, *_ in ref] == list(range(14)) and ref[0][1:3] == ref[6][1:3]  # a new pass: the same stream
    out: list[Any] = []
    for stop in (3, 6, 11):
        with pytest.raises(RequeueExit):
            run(tmp_path / "b", out, stop)
    run(tmp_path / "b", out)
    assert out == ref


@pytest.mark.parametrize("case, engine", [("shuffle", "sync"), ("shuffle+generator", "sync"),
                                          ("shuffle+generator", "concurrent"), ("DistributedSampler rank 1", "sync")])
def test_a_peek_at_each_epoch_start_changes_nothing(case: str, engine: str, tmp_path: Path) -> None:
    make = LOADERS[case]
    ref = plain(make, peek=True)
    assert with_stops(tmp_path, make, [3], peek=True, engine=engine) == ref


def test_random_sampler_skip_by_indices_loads_nothing_it_skips(tmp_path: Path) -> None:
    loaded: list[int] = []

    class Counting(Dataset[int]):
        def __len__(self) -> int:
            return N

        def __getitem__(self, i: int) -> int:
            loaded.append(i)
            return i

    def make() -> tuple[DataLoader[Any], Any]:
        return DataLoader(Counting(), batch_size=4, shuffle=True), None

    out: list[Any] = []
    with pytest.raises(RequeueExit):
        _run_counting(tmp_path, make, out, stop_at=3)
    loaded.clear()
    _run_counting(tmp_path, make, out)
    assert len(loaded) == EPOCHS * N - 3 * 4  # the 3 trained batches were skipped, not loaded


def _run_counting(ckdir: Path, make: Callable[[], tuple[DataLoader[Any], Any]], out: list[Any],
                  stop_at: int | None = None) -> None:
    torch.manual_seed(0)
    loader, _ = make()
    ck = Checkpointer(ckdir, every_steps=None)
    ck.register(model=torch.nn.Linear(1, 1))
    for _epoch in ck.epochs(EPOCHS):
        for batch in ck.batches(loader):
            out.append(batch.tolist())
            if stop_at is not None and ck.step + 1 == stop_at:
                os.kill(os.getpid(), signal.SIGUSR2)


# --- persistent workers: their random streams resume -----------------------------------------

PERSISTENT_CASES = [case for case in LOADERS if "persistent" in case]


@pytest.mark.parametrize("case", PERSISTENT_CASES)
@pytest.mark.parametrize("engine", ["sync", "concurrent"])
def test_persistent_workers_resume_exactly(case: str, engine: str, tmp_path: Path,
                                           caplog: pytest.LogCaptureFixture) -> None:
    make = LOADERS[case]
    ref = plain(make)
    per_epoch = sum(1 for _ in make()[0])
    caplog.set_level(logging.INFO, logger="hpcckpt")
    # at the first epoch's end, then in the third epoch (its workers ran two epochs before)
    assert with_stops(tmp_path, make, [per_epoch, 2 * per_epoch + 1], engine=engine) == ref
    replays = [r.getMessage() for r in caplog.records if "persistent workers" in r.getMessage()]
    assert len(replays) == 1 and f"replayed {2 * per_epoch} batches of 2 earlier epochs" in replays[0]
    assert not [r for r in caplog.records if "persistent_workers=True" in r.getMessage()]  # nothing to warn of


def _passes(loader: Any, n: int) -> LoaderPosition:
    pos = LoaderPosition(loader)
    for _ in range(n):
        for _batch in pos.open():
            pos.took()
        torch.rand(())  # the training code draws between epochs
    return pos


def test_persistent_workers_record_only_the_rng_states_a_replay_needs() -> None:
    """A generator only the loader draws from is recorded once, at the pass that starts the workers;
    the global RNG, which the training code draws from between epochs, at each pass whose order comes
    from it; nothing for a loader without persistent workers."""
    torch.manual_seed(0)
    with_generator = _passes(LOADERS["persistent workers, generator"]()[0], 3).state_dict()["workers"]
    assert with_generator["from"] == 1
    assert [sorted(r["rng"]) for r in with_generator["passes"]] == [["loader"], [], []]
    shuffled = _passes(LOADERS["persistent workers augmenting"]()[0], 3).state_dict()["workers"]
    assert [sorted(r["rng"]) for r in shuffled["passes"]] == [["torch"], ["torch"], ["torch"]]
    distributed = _passes(LOADERS["persistent workers, DistributedSampler"]()[0], 2).state_dict()["workers"]
    assert [(sorted(r["rng"]), r["epochs"]) for r in distributed["passes"]] == [(["torch"], {"sampler": 0}),
                                                                               ([], {"sampler": 0})]
    assert "workers" not in _passes(LOADERS["workers augmenting"]()[0], 2).state_dict()


@pytest.mark.parametrize("where", ["before training", "between epochs"])
def test_persistent_workers_used_outside_the_training_epochs_are_named(where: str, tmp_path: Path,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    """A peek or a sanity check makes the workers load batches a replay does not know of."""
    def run(stop_at: int | None = None) -> None:
        torch.manual_seed(0)
        loader, _ = LOADERS["persistent workers augmenting"]()
        ck = Checkpointer(tmp_path, every_steps=None)
        ck.register(model=torch.nn.Linear(1, 1))
        if where == "before training":
            next(iter(loader))  # a sanity check: it starts the persistent workers
        try:
            for epoch in ck.epochs(2):
                if where == "between epochs" and epoch == 1:
                    next(iter(loader))  # a peek at the second epoch's start
                for _batch in ck.batches(loader):
                    if stop_at is not None and ck.step + 1 == stop_at:
                        os.kill(os.getpid(), signal.SIGUSR2)
        finally:
            stop_workers(loader)

    with pytest.raises(RequeueExit):
        run(8)
    caplog.clear()
    run()
    warned = [r.getMessage() for r in caplog.records
              if r.levelno == logging.WARNING and "persistent_workers=True" in r.getMessage()]
    assert len(warned) == 1 and "outside ckpt.batches()/loop()" in warned[0] and "(epoch 2)" in warned[0]
    assert "persistent_workers=False" in warned[0]


def test_persistent_workers_of_a_checkpoint_without_their_record_are_named(caplog: pytest.LogCaptureFixture) -> None:
    loader, _ = LOADERS["persistent workers augmenting"]()
    pos = LoaderPosition(loader)
    pos.load_state_dict({"passes": 2, "taken": 1})  # saved before passes of persistent workers were recorded
    next(pos.open())
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "were not recorded" in warned[0] and "epoch 2" in warned[0]
    first = LoaderPosition(LOADERS["persistent workers augmenting"]()[0])
    first.load_state_dict({"passes": 1, "taken": 1})  # the first epoch's workers are seeded as then: nothing to say
    caplog.clear()
    next(first.open())
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


def test_skip_by_indices_with_workers_resumes_the_order(tmp_path: Path) -> None:
    """skip="indices" skips without loading (augmentation in the workers then differs), but the
    order resumes exactly; torch's multi-process iterator asks for its sampler's iterator twice."""
    make = LOADERS["workers augmenting"]
    ref = [(e[0], e[1]) for e in plain(make) if e[0] != "end"]
    out = with_stops(tmp_path, make, [3, 6], skip="indices")
    assert [(e[0], e[1]) for e in out if e[0] != "end"] == ref


@pytest.mark.parametrize("workers", [
    {"from": -1, "passes": []},
    {"from": 1, "passes": "x"},
    {"from": 1, "passes": [{"rng": {"torch": torch.zeros(3)}, "epochs": {}}]},  # not a generator state
    {"from": 1, "passes": [{"rng": {}, "epochs": {"sampler": "0"}}]},
])
def test_a_damaged_record_of_persistent_workers_is_refused(workers: dict[str, Any]) -> None:
    from hpcckpt.errors import CheckpointCorrupt
    with pytest.raises(CheckpointCorrupt, match="persistent workers|generator states"):
        LoaderPosition.check_state({"passes": 1, "taken": 0, "workers": workers})
