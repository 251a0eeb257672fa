"""Gradient accumulation in a plain loop: a stop (or a save) between two optimizer steps.

The loop steps its optimizer every ``ACCUM`` batches and each batch is a step of
``ckpt.batches``, so a boundary can fall inside an accumulation, where the parameters'
gradients hold the partial sum the next batches add to. Before, a resume from there lost it
(``hpcckpt check`` on such a loop: NOT identical from the first optimizer step after the stop).
"""
from __future__ import annotations

import os
import signal
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from hpcckpt.api import Checkpointer, RequeueExit
from hpcckpt.ranks import Ranks
from hpcckpt.resume import load_newest

pytestmark = pytest.mark.native

ACCUM = 3
EPOCHS = 2


def _run(ckdir: Path, out: list[Any], *, engine: str, stop_at: int | None = None,
         every: int | None = None) -> list[torch.Tensor]:
    torch.manual_seed(0)
    loader = DataLoader(TensorDataset(torch.randn(40, 3), torch.randn(40, 1)), batch_size=4, shuffle=True)
    model = torch.nn.Sequential(torch.nn.Linear(3, 6), torch.nn.Dropout(0.2), torch.nn.Linear(6, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.02)
    ck = Checkpointer(ckdir, every_steps=every, engine=engine)
    ck.register(model=model, optimizer=opt)
    for _ in ck.epochs(EPOCHS):
        for i, (x, y) in ck.batches(loader).enumerate():
            loss = torch.nn.functional.mse_loss(model(x), y) / ACCUM
            loss.backward()
            if (i + 1) % ACCUM == 0:
                opt.step()
                opt.zero_grad()
            out.append((ck.step, float.hex(loss.item())))
            if stop_at is not None and ck.step + 1 == stop_at:
                os.kill(os.getpid(), signal.SIGUSR2)
    ck.close()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("engine", ["sync", "concurrent"])
def test_a_stop_inside_an_accumulation_resumes_with_its_gradients(engine: str, tmp_path: Path) -> None:
    ref: list[Any] = []
    final = _run(tmp_path / "a", ref, engine=engine)
    got: list[Any] = []
    for stop in (4, 8, 12, 14):  # inside accumulations, one at an optimizer step (12), an epoch's end (10 a pass)
        with pytest.raises(RequeueExit) as exc:
            _run(tmp_path / "b", got, engine=engine, stop_at=stop, every=2)
        traceback.clear_frames(exc.tb)
    resumed = _run(tmp_path / "b", got, engine=engine, every=2)
    assert got == ref
    assert all(torch.equal(a, b) for a, b in zip(resumed, final))


@pytest.mark.parametrize("engine", ["sync", "concurrent"])
def test_gradients_are_saved_only_inside_an_accumulation(engine: str, tmp_path: Path) -> None:
    def grads_saved(stop: int) -> bool:
        with pytest.raises(RequeueExit) as exc:
            _run(tmp_path / str(stop), [], engine=engine, stop_at=stop)
        traceback.clear_frames(exc.tb)
        flat = load_newest(tmp_path / str(stop), Ranks()).flat
        assert flat is not None and flat.meta["step"] == stop
        return any("/grads/" in name for name in flat.tensors)

    assert grads_saved(4)  # batch 4 of a pass: one batch into the second accumulation
    assert not grads_saved(6)  # right after an optimizer step
