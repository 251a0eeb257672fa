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
               stop_at: int | None = None, peek: bool = False) -> None:
    """The same script with hpcckpt (epochs + batches); SIGUSR2 during step ``stop_at``."""
    torch.manual_seed(0)
    loader, sampler = make()
    model = torch.nn.Linear(1, 1)
    ck = Checkpointer(ckdir, every_steps=None)
    ck.register(model=model)
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


def with_stops(ckdir: Path, make: Callable[[], tuple[DataLoader[Any], Any]], stops: list[int], **kw: Any) -> list[Any]:
    out: list[Any] = []
    for stop in stops:
        with pytest.raises(RequeueExit) as exc:
            integrated(ckdir, make, out, stop_at=stop, **kw)
        assert exc.value.step == stop
    integrated(ckdir, make, out, **kw)
    return out


@pytest.mark.parametrize("case", list(LOADERS))
def test_integrated_run_keeps_the_data_order_and_resumes_it(case: str, tmp_path: Path) -> None:
    make = LOADERS[case]
    ref = plain(make)
    per_epoch = sum(1 for _ in make()[0])  # len() is unknown for an iterable dataset
    uninterrupted: list[Any] = []
    integrated(tmp_path / "a", make, uninterrupted)
    assert uninterrupted == ref  # adding hpcckpt changes nothing
    # mid-epoch, then exactly at an epoch's end (its per-epoch code not yet run)
    assert with_stops(tmp_path / "b", make, [per_epoch + 1, 2 * per_epoch]) == ref


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
