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

import os
import signal
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, RandomSampler, TensorDataset

from hpcckpt.api import Checkpointer, RequeueExit
from hpcckpt.data import ResumableSampler

pytestmark = [pytest.mark.native,
              # torchdata 0.11's StatefulDataLoader warns on every iterator (a deprecated torch call of its own)
              pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")]

N = 22  # not a multiple of the batch size nor of 2 ranks: short last batches and padding
EPOCHS = 3


class Augmenting(Dataset[tuple[int, float]]):
    """Random augmentation drawn in the worker processes (their RNG streams must resume)."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> tuple[int, float]:
        return i, float(torch.rand(()).item())


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
}


class Stream(torch.utils.data.IterableDataset[tuple[int, float]]):
    """An iterable dataset with random augmentation (no state_dict: torchdata fast-forwards it)."""

    def __iter__(self):  # type: ignore[no-untyped-def]
        g = torch.Generator().manual_seed(21)
        for i in range(N):
            yield i, float(torch.rand((), generator=g).item())


LOADERS["IterableDataset"] = lambda: (DataLoader(Stream(), batch_size=4), None)
LOADERS["IterableDataset, workers"] = lambda: (DataLoader(Stream(), batch_size=4, num_workers=1), None)

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


def _with_sampler(sampler: Any, *, batch_size: int) -> tuple[DataLoader[Any], Any]:
    return DataLoader(indices(), batch_size=batch_size, sampler=sampler), sampler


def record(out: list[Any], epoch: int, batch: Any) -> None:
    """The batch as seen, plus one draw of the training code's global RNG (dropout's)."""
    first = batch[0]
    out.append((epoch, first.tolist(), batch[1].tolist() if len(batch) > 1 else None,
                float.hex(torch.rand(()).item())))


def plain(make: Callable[[], tuple[DataLoader[Any], Any]], *, peek: bool = False) -> list[Any]:
    """The script without hpcckpt."""
    torch.manual_seed(0)
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
               register_loader: bool = False) -> None:
    """The same script with hpcckpt (epochs + batches); SIGUSR2 during step ``stop_at``.
    ``register_loader``: the loader is registered too, as any stateful object (a StatefulDataLoader)."""
    torch.manual_seed(0)
    loader, sampler = make()
    model = torch.nn.Linear(1, 1)
    ck = Checkpointer(ckdir, every_steps=None, engine=engine)
    ck.register(model=model, **({"loader": loader} if register_loader else {}))
    for epoch in ck.epochs(EPOCHS):
        if peek:
            next(iter(loader))
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        for batch in ck.batches(loader):
            record(out, epoch, batch)
            if stop_at is not None and ck.step + 1 == stop_at:
                os.kill(os.getpid(), signal.SIGUSR2)
        out.append(("end", epoch, float.hex(torch.rand(()).item())))


def with_stops(ckdir: Path, make: Callable[[], tuple[DataLoader[Any], Any]], stops: list[int],
               **kw: Any) -> list[Any]:
    out: list[Any] = []
    for stop in stops:
        with pytest.raises(RequeueExit) as exc:
            integrated(ckdir, make, out, stop_at=stop, **kw)
        assert exc.value.step == stop
    integrated(ckdir, make, out, **kw)
    return out


# Both engines where the engine could matter to a loader (the save runs where the loader's own
# state is taken); the sync engine for the rest, to keep the suite fast.
BOTH_ENGINES = {"StatefulDataLoader shuffle", "StatefulDataLoader shuffle+generator",
                "StatefulDataLoader IterableDataset", "StatefulDataLoader workers"}


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


@pytest.mark.parametrize("case", ["shuffle", "shuffle+generator", "DistributedSampler rank 1"])
def test_a_peek_at_each_epoch_start_changes_nothing(case: str, tmp_path: Path) -> None:
    make = LOADERS[case]
    ref = plain(make, peek=True)
    assert with_stops(tmp_path, make, [3], peek=True) == ref


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
