"""A run that takes its batches from ``iter(loader)`` kept by the script is told, at its first
step, that a resume starts that loader's pass again (``coverage.loose_loader_iterators``).

The shape (a step loop refreshing a DataLoader iterator on StopIteration, as in many
repositories) resumed in another data order without a word; ``hpcckpt check`` found it only
as a divergence. The warning names the iterator and the fix; loops that take their batches
through ``ckpt.loop``/``ckpt.batches``, or from a registered loader that saves its own place,
or from no DataLoader at all, are not named.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from hpcckpt.api import Checkpointer


class LooseCaseData(TensorDataset):
    """A data set of this module's own: iterators other tests of the worker left alive are not ours."""


LOOSE = "DataLoader iterator over LooseCaseData"


def _setup() -> tuple[torch.nn.Module, torch.optim.Optimizer, DataLoader]:
    torch.manual_seed(0)
    ds = LooseCaseData(torch.randn(64, 4), torch.randn(64, 1))
    model = torch.nn.Linear(4, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(ds, batch_size=8, shuffle=True)


def _train(opt: torch.optim.Optimizer, model: torch.nn.Module, batch: Any) -> None:
    x, y = batch
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def test_an_iterator_kept_by_the_script_is_named_at_the_first_step(tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    model, opt, loader = _setup()
    with caplog.at_level(logging.WARNING, logger="hpcckpt"), Checkpointer(tmp_path, every_steps=None) as ck:
        ck.register(model=model, opt=opt)
        it = iter(loader)
        for _ in ck.steps(12):
            try:
                batch = next(it)
            except StopIteration:
                it = iter(loader)
                batch = next(it)
            _train(opt, model, batch)
    named = [r.getMessage() for r in caplog.records if LOOSE in r.getMessage()]
    assert len(named) == 1, named  # once, at the first step
    assert "1 batch taken so far" in named[0] and "in another order" in named[0]
    assert "ckpt.loop(loader, total_steps)" in named[0]


# torchdata 0.11's StatefulDataLoader warns on every iterator (a deprecated torch call of its own)
@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
def test_batches_through_loop_a_stateful_loader_or_no_loader_are_not_named(tmp_path: Path,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    model, opt, loader = _setup()
    with caplog.at_level(logging.WARNING, logger="hpcckpt"):
        with Checkpointer(tmp_path / "loop", every_steps=None) as ck:
            ck.register(model=model, opt=opt)
            for _, batch in ck.loop(loader, 12):
                _train(opt, model, batch)
        with Checkpointer(tmp_path / "none", every_steps=None) as ck:
            ck.register(model=model, opt=opt)
            for _ in ck.steps(5):
                _train(opt, model, (torch.randn(8, 4), torch.randn(8, 1)))
        stateful = pytest.importorskip("torchdata.stateful_dataloader")
        sloader = stateful.StatefulDataLoader(loader.dataset, batch_size=8, shuffle=True)
        with Checkpointer(tmp_path / "stateful", every_steps=None) as ck:
            ck.register(model=model, opt=opt, loader=sloader)
            it = iter(sloader)
            for _ in ck.steps(5):
                _train(opt, model, next(it))
    assert not [r for r in caplog.records if LOOSE in r.getMessage()]
