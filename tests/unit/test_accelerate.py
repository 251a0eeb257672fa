"""A Hugging Face Accelerate loop: what ``accelerator.prepare`` returns is registered and trained as is.

Accelerate wraps the optimizer (``AcceleratedOptimizer``: a ``torch.optim.Optimizer`` subclass
that never runs its ``__init__``, so torch's step hooks cannot be registered on it) and the
DataLoader (``DataLoaderShard``: its own ``__iter__``, a generator over the DataLoader it keeps
as ``base_dataloader``, one batch ahead; a ``state_dict`` that works only with torchdata's
loader under it; its own pass count, ``iteration``, handed to the samplers' ``set_epoch``).
Before, ``register()`` under the concurrent engine raised AttributeError from torch, and a
resumed epoch of a prepared loader started again from its first batch.
"""
from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from hpcckpt.api import Checkpointer, RequeueExit
from hpcckpt.errors import ConfigError
from hpcckpt.state import stepping_optimizer

from .test_samplers import StatefulDataLoader, indices, integrated, plain, with_stops

accelerate = pytest.importorskip("accelerate")
pytestmark = [pytest.mark.native, pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")]


def _prepared(loader: DataLoader[Any], **config: Any) -> tuple[Any, None]:
    from accelerate.utils import DataLoaderConfiguration
    acc = accelerate.Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(**config))
    return acc.prepare(loader), None


LOADERS: dict[str, Callable[[], tuple[Any, Any]]] = {
    "shuffle": lambda: _prepared(DataLoader(indices(), batch_size=4, shuffle=True)),
    "shuffle, seedable sampler": lambda: _prepared(DataLoader(indices(), batch_size=4, shuffle=True),
                                                   use_seedable_sampler=True),
    "sequential, drop_last": lambda: _prepared(DataLoader(indices(), batch_size=4, drop_last=True)),
}
if StatefulDataLoader is not None:
    LOADERS["shuffle, stateful"] = lambda: _prepared(DataLoader(indices(), batch_size=4, shuffle=True),
                                                     use_stateful_dataloader=True)


@pytest.mark.parametrize("engine", ["sync", "concurrent"])
@pytest.mark.parametrize("case", list(LOADERS))
def test_a_prepared_loader_keeps_the_data_order_and_resumes_it(case: str, engine: str, tmp_path: Path) -> None:
    make = LOADERS[case]
    assert type(make()[0]).__name__ == "DataLoaderShard"
    ref = plain(make)
    per_epoch = sum(1 for _ in make()[0])
    uninterrupted: list[Any] = []
    integrated(tmp_path / "a", make, uninterrupted, engine=engine)
    assert uninterrupted == ref  # adding hpcckpt changes nothing
    # mid-epoch (second epoch: the seedable sampler's order depends on the pass count), an
    # epoch's end, the last batch of the third epoch
    assert with_stops(tmp_path / "b", make, [per_epoch + 2, 2 * per_epoch, 3 * per_epoch - 1], engine=engine) == ref


def _run(ckdir: Path, steps: int, *, stop_after: int | None = None, engine: str = "concurrent",
         accumulate: int = 1) -> dict[str, Any]:
    """An Accelerate loop (model, AdamW, scheduler and loader all prepared) with hpcckpt; returns
    the final parameters and every loss, or raises RequeueExit after step ``stop_after``.
    ``accumulate`` > 1: ``accelerator.accumulate`` over that many batches, the Accelerator registered."""
    torch.manual_seed(0)
    acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=accumulate)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, 3, gamma=0.5)
    data = DataLoader(torch.utils.data.TensorDataset(torch.randn(40, 3), torch.randn(40, 1)), batch_size=4,
                      shuffle=True)
    model, opt, data, sched = acc.prepare(model, opt, data, sched)
    assert type(opt).__name__ == "AcceleratedOptimizer"
    ck = Checkpointer(ckdir, every_steps=2, engine=engine)
    ck.register(model=model, optimizer=opt, scheduler=sched, **({"accelerator": acc} if accumulate > 1 else {}))
    losses = []
    for step, (x, y) in ck.loop(data, steps):
        with acc.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x), y)
            acc.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
        losses.append((step, loss.item()))
        if stop_after is not None and step == stop_after:
            os.kill(os.getpid(), signal.SIGUSR2)  # the stop, through the real handler
    ck.close()
    return {"params": [p.detach().clone() for p in model.parameters()], "losses": losses}


@pytest.mark.parametrize("engine", ["sync", "concurrent"])
def test_an_accelerated_optimizer_is_saved_and_resumed_exactly(engine: str, tmp_path: Path) -> None:
    ref = _run(tmp_path / "a", 25, engine=engine)
    for stop in (6, 13):
        with pytest.raises(RequeueExit):
            _run(tmp_path / "b", 25, stop_after=stop, engine=engine)
    got = _run(tmp_path / "b", 25, engine=engine)
    assert [s for s, _ in got["losses"]] == list(range(14, 25))
    assert got["losses"] == ref["losses"][14:]
    assert all(torch.equal(a, b) for a, b in zip(got["params"], ref["params"]))


@pytest.mark.parametrize("engine", ["sync", "concurrent"])
def test_accelerate_accumulation_resumes_exactly_with_the_accelerator_registered(engine: str, tmp_path: Path) -> None:
    """``accelerator.accumulate`` over 3 batches, stopped inside accumulations (7: one batch in;
    14: two in): the gradients accumulated so far and the Accelerator's count of batches come back."""
    ref = _run(tmp_path / "a", 25, engine=engine, accumulate=3)
    for stop in (6, 13):
        with pytest.raises(RequeueExit):
            _run(tmp_path / "b", 25, stop_after=stop, engine=engine, accumulate=3)
    got = _run(tmp_path / "b", 25, engine=engine, accumulate=3)
    assert got["losses"] == ref["losses"][14:]
    assert all(torch.equal(a, b) for a, b in zip(got["params"], ref["params"]))


def test_accelerate_accumulation_without_the_accelerator_is_named() -> None:
    from hpcckpt.coverage import unsaved
    from hpcckpt.state import TrainState
    acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=4)
    model = torch.nn.Linear(2, 2)
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    state = TrainState()
    state.register("model", model)
    state.register("optimizer", opt)
    lines = unsaved(state.objects)
    assert len(lines) == 1 and "every 4 batches" in lines[0] and "accelerator=accelerator" in lines[0], lines
    state.register("accelerator", acc)  # saved as its count of batches
    assert unsaved(state.objects) == []
    assert state.objects["accelerator"].state_dict() == {"step": acc.step}


def test_the_step_hooks_go_on_the_optimizer_a_wrapper_steps() -> None:
    inner = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    wrapped = accelerate.optimizer.AcceleratedOptimizer(inner, device_placement=False)
    assert stepping_optimizer(wrapped, "optimizer") is inner
    assert stepping_optimizer(inner, "optimizer") is inner

    class Opaque(torch.optim.Optimizer):  # an Optimizer subclass without Optimizer.__init__, wrapping nothing
        def __init__(self) -> None:
            self.param_groups: list[dict[str, Any]] = []

    with pytest.raises(ConfigError, match=r"optimizer 'opt' \(.*Opaque\) runs no torch step hooks.*engine='sync'"):
        stepping_optimizer(Opaque(), "opt")
