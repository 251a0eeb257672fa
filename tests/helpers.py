"""Helpers shared by tests (importable as tests.helpers)."""
from __future__ import annotations

from typing import Any


def tiny_state(seed: int = 0) -> dict[str, Any]:
    """A model + AdamW + cosine schedule + GradScaler, as users register them."""
    import torch
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                torch.nn.Dropout(0.2), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=100)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    return {"model": model, "optimizer": opt, "scheduler": sched, "scaler": scaler}


def train_step(objs: dict[str, Any]) -> float:
    import torch
    model, opt, sched = objs["model"], objs["optimizer"], objs["scheduler"]
    x = torch.randn(32, 8)
    y = torch.randint(0, 4, (32,))
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    return float(loss.item())


def built_once(factory: Any, key: str, build: Any) -> Any:
    """``factory.getbasetemp()``-relative directory ``key``, made by ``build(path)`` once per test
    session, by whichever pytest-xdist worker asks first (the others wait for it, then reuse it):
    for the uninterrupted reference runs that many tests compare against. They are deterministic,
    so one run serves every worker. A build that fails is retried by the next worker that asks."""
    import os
    import shutil

    from filelock import FileLock

    base = factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # the session's, shared by workers
    out = root / "built-once" / key
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if not (out / ".built").exists():
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()
            build(out)
            (out / ".built").touch()
    return out
