"""A DataLoader with persistent workers that is not trained through ``ckpt.batches`` (an evaluation
loader) draws its workers' base seed from the global torch RNG once, on its first pass (issue 55,
item 1). The uninterrupted run drew it after epoch 0; a run resumed in epoch 2 drew it after epoch 2,
one draw more in the stream the next epoch's shuffle comes from: from there on the training order
differed, silently. hpcckpt records the seed such a loader took and gives it back on its first pass
after a resume (no draw from the global RNG), or, where it cannot, names the loader and the fix."""
from __future__ import annotations

import logging
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from hpcckpt.api import Checkpointer, RequeueExit

pytestmark = pytest.mark.native

EPOCHS = 4
PER_EPOCH = 4


class Noisy(Dataset[Any]):
    """An evaluation set whose items carry a draw of the worker's torch RNG (random augmentation)."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.rand(()) + i


def stop_workers(loader: Any) -> None:
    it = getattr(loader, "_iterator", None)
    if it is not None and hasattr(it, "_shutdown_workers"):
        it._shutdown_workers()


def make_eval(**kw: Any) -> DataLoader[Any]:
    return DataLoader(Noisy(), batch_size=4, num_workers=2, persistent_workers=True, **kw)


def run(ckdir: Path, log: list[str], *, stop_at: int | None = None, engine: str = "sync",
        late_eval: bool = False, **eval_kw: Any) -> None:
    torch.manual_seed(0)
    train = DataLoader(TensorDataset(torch.randn(PER_EPOCH * 4, 3), torch.randn(PER_EPOCH * 4, 1)), batch_size=4,
                       shuffle=True)  # its order comes from the global torch RNG
    evaluation = None if late_eval else make_eval(**eval_kw)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ck = Checkpointer(ckdir, engine=engine, every_steps=None, signals=("USR2",))
    ck.register(model=model, opt=opt)
    try:
        for epoch in ck.epochs(EPOCHS):
            for x, y in ck.batches(train):
                loss = torch.nn.functional.mse_loss(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                log.append(float.hex(loss.item()))
                if stop_at is not None and ck.step + 1 == stop_at:
                    os.kill(os.getpid(), signal.SIGUSR2)
            if evaluation is None:
                evaluation = make_eval(**eval_kw)  # made at its first use
            with torch.no_grad():
                log.append(f"eval {epoch} " + " ".join(float.hex(float(b.sum())) for b in evaluation))
    finally:
        if evaluation is not None:
            stop_workers(evaluation)


def training(log: list[str]) -> list[str]:
    return [x for x in log if not x.startswith("eval")]


def evals(log: list[str]) -> list[str]:
    return [x.split(" ", 2)[2] for x in log if x.startswith("eval")]


@pytest.mark.parametrize("late", [False, True], ids=["made before the loop", "made at its first use"])
@pytest.mark.parametrize("engine", ["sync", "concurrent"])
def test_an_evaluation_loader_with_persistent_workers_leaves_the_training_order_as_it_was(
        tmp_path: Path, engine: str, late: bool, caplog: pytest.LogCaptureFixture) -> None:
    ref: list[str] = []
    run(tmp_path / "ref", ref, engine=engine, late_eval=late)
    log: list[str] = []
    with pytest.raises(RequeueExit):
        run(tmp_path / "ck", log, stop_at=2 * PER_EPOCH + 2, engine=engine, late_eval=late)  # inside epoch 2
    caplog.set_level(logging.INFO, logger="hpcckpt")
    resumed: list[str] = []
    run(tmp_path / "ck", resumed, engine=engine, late_eval=late)
    assert training(log + resumed) == training(ref)
    # The evaluation's workers took the seed they took in the uninterrupted run: its first pass in
    # the resumed run (epoch 2) is what its first pass there was (epoch 0; the workers draw in it).
    assert evals(resumed)[0] == evals(ref)[0]
    gave = [r.getMessage() for r in caplog.records if "with the seed it took" in r.getMessage()]
    assert len(gave) == 1 and "Noisy[8]" in gave[0]
    assert [r for r in caplog.records if r.levelno >= logging.WARNING and "persistent" in r.getMessage()] == []


def test_a_generator_of_its_own_needs_nothing(tmp_path: Path) -> None:
    """With ``generator=`` the workers' seed is drawn from the loader's own generator: the global
    stream is untouched, in the uninterrupted run and after a resume alike."""
    kw = {"generator": torch.Generator().manual_seed(3)}
    ref: list[str] = []
    run(tmp_path / "ref", ref, **kw)
    log: list[str] = []
    with pytest.raises(RequeueExit):
        run(tmp_path / "ck", log, stop_at=2 * PER_EPOCH + 2, **kw)
    run(tmp_path / "ck", log, **kw)
    assert training(log) == training(ref)


def remade(ckdir: Path, log: list[str], *, stop_at: int | None = None, keep_first: bool = False) -> None:
    """An evaluation loader made anew each epoch (each draws its seed at its first pass, in every
    run alike); with ``keep_first``, the one made first is kept and used again at the end of each epoch."""
    torch.manual_seed(0)
    train = DataLoader(TensorDataset(torch.randn(PER_EPOCH * 4, 3)), batch_size=4, shuffle=True)
    kept: Any = None
    made: list[Any] = []
    ck = Checkpointer(ckdir, every_steps=None, signals=("USR2",))
    ck.register(model=torch.nn.Linear(3, 1))
    try:
        for epoch in ck.epochs(EPOCHS):
            for (x,) in ck.batches(train):
                log.append(float.hex(float(x.sum())))
                if stop_at is not None and ck.step + 1 == stop_at:
                    os.kill(os.getpid(), signal.SIGUSR2)
            fresh = make_eval()
            made.append(fresh)
            log.append(f"eval {epoch} " + " ".join(float.hex(float(b.sum())) for b in fresh))
            if keep_first and kept is None:
                kept = fresh
            else:
                stop_workers(fresh)
                made.remove(fresh)
                del fresh
            if kept is not None:
                log.append(f"eval {epoch} " + " ".join(float.hex(float(b.sum())) for b in kept))
    finally:
        for loader in made:
            stop_workers(loader)


def test_a_loader_made_anew_each_epoch_draws_anew_in_every_run(tmp_path: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    ref: list[str] = []
    remade(tmp_path / "ref", ref)
    log: list[str] = []
    with pytest.raises(RequeueExit):
        remade(tmp_path / "ck", log, stop_at=2 * PER_EPOCH + 2)
    caplog.set_level(logging.INFO, logger="hpcckpt")
    remade(tmp_path / "ck", log)
    assert training(log) == training(ref)
    assert not [r for r in caplog.records if "with the seed it took" in r.getMessage()]


def test_loaders_it_cannot_tell_apart_are_named_with_the_fix(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Loaders of one kind, some made anew (gone by the save), one kept: which of them a loader of
    the resumed run is cannot be told, so its seed is not given back; the resumed run says so,
    naming the loader and the fix, and so does hpcckpt check (its first hint)."""
    from hpcckpt.check import LOADER_SEED_HINT, _hints, read_trace
    trace = tmp_path / "trace.jsonl"
    monkeypatch.setenv("_HPCCKPT_CHECK_TRACE", str(trace))
    log: list[str] = []
    with pytest.raises(RequeueExit):
        remade(tmp_path / "ck", log, stop_at=2 * PER_EPOCH + 2, keep_first=True)
    caplog.set_level(logging.WARNING, logger="hpcckpt")
    remade(tmp_path / "ck", log, keep_first=True)
    said = [r.getMessage() for r in caplog.records if "persistent_workers=True" in r.getMessage()]
    assert len(said) == 1, said
    assert "Noisy[8]" in said[0] and "generator=torch.Generator()" in said[0], said[0]
    notes = read_trace(trace)[2]
    assert "loader_seed" in notes and _hints(["rng.torch"], notes)[0] == LOADER_SEED_HINT


# --- the timm-shaped loop of the acceptance ---------------------------------------------------

class Augmented(Dataset[Any]):
    """Training images with random augmentation drawn in the worker processes."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(24, 6, generator=g), torch.randint(0, 3, (24,), generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i] + 0.1 * torch.randn(6), self.y[i]


class Ema:
    """timm's ModelEmaV3 in small: its decay warms up with the number of updates it counts."""

    def __init__(self, model: torch.nn.Module) -> None:
        import copy
        self.module = copy.deepcopy(model)
        self.updates = 0

    def update(self, model: torch.nn.Module) -> None:
        self.updates += 1
        decay = min(0.99, (1 + self.updates) / (10 + self.updates))
        with torch.no_grad():
            for e, p in zip(self.module.parameters(), model.parameters()):
                e.mul_(decay).add_(p, alpha=1 - decay)

    def state_dict(self) -> dict[str, Any]:
        return {"module": self.module.state_dict(), "updates": self.updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["module"])
        self.updates = int(state["updates"])


def timm_like(ckdir: Path, trace: list[str], *, stops: tuple[int, ...] = (), engine: str = "sync") -> None:
    import numpy as np
    torch.manual_seed(0)
    np.random.seed(0)
    train = DataLoader(Augmented(), batch_size=4, shuffle=True, drop_last=True, num_workers=2, persistent_workers=True)
    evaluation = DataLoader(TensorDataset(torch.randn(8, 6)), batch_size=4, num_workers=2, persistent_workers=True)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(8, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=8)
    ema = Ema(model)
    ck = Checkpointer(ckdir, engine=engine, every_steps=None, signals=("USR2",))
    ck.register(model=model, opt=opt, sched=sched, ema=ema)
    try:
        for epoch in ck.epochs(8):
            model.train()
            for x, y in ck.batches(train):
                lam = float(np.random.beta(1.0, 1.0))  # mixup: numpy's global RNG, then torch's
                perm = torch.randperm(x.shape[0])
                x = lam * x + (1 - lam) * x[perm]
                out = model(x)
                loss = lam * torch.nn.functional.cross_entropy(out, y) + (1 - lam) * torch.nn.functional.cross_entropy(
                    out, y[perm])
                opt.zero_grad()
                loss.backward()
                opt.step()
                ema.update(model)
                digest = [float.hex(loss.item()), *(float.hex(float(p.detach().sum())) for p in ema.module.parameters())]
                trace.append(f"{ck.step + 1} " + " ".join(digest))
                if ck.step + 1 in stops:
                    os.kill(os.getpid(), signal.SIGUSR2)
            model.eval()
            with torch.no_grad():
                trace.append(f"eval {epoch} " + " ".join(float.hex(float(ema.module(b).sum())) for (b,) in evaluation))
            sched.step()
        trace.append("end " + " ".join(float.hex(float(p.detach().sum())) for p in [*model.parameters(), *ema.module.parameters()])
                     + " " + " ".join(float.hex(float(v.sum())) for s in opt.state.values() for v in s.values()))
    finally:
        stop_workers(train)
        stop_workers(evaluation)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["sync", "concurrent"])
def test_a_timm_shaped_run_stopped_in_epochs_2_and_6_is_bit_identical(tmp_path: Path, engine: str) -> None:
    per_epoch = 6  # 24 items, batches of 4
    ref: list[str] = []
    timm_like(tmp_path / "ref", ref, engine=engine)
    got: list[str] = []
    for stop in (2 * per_epoch + 3, 6 * per_epoch + 2):  # inside epochs 2 and 6
        with pytest.raises(RequeueExit) as exc:
            timm_like(tmp_path / "ck", got, stops=(stop,), engine=engine)
        assert exc.value.step == stop
    timm_like(tmp_path / "ck", got, engine=engine)
    assert got == ref
