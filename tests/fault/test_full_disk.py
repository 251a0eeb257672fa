"""A full disk at the worst moments (a real, small tmpfs filled to the last byte).

- SIGTERM arrives and the final save cannot be written: the job still requeues
  (exit 75) from the previous committed checkpoint and says so; the next run resumes
  from it once space is back.
- The ledger cannot be appended to: training goes on.
"""
from __future__ import annotations

import errno
import logging
import os
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hpcckpt.api import EXIT_REQUEUE, Checkpointer, RequeueExit
from hpcckpt.lifecycle.ledger import Ledger
from hpcckpt.store import catalog

pytestmark = [pytest.mark.native, pytest.mark.fault]


def fill(fs: Path) -> Path:
    """Write a file until the file system is full; it returns the filler (delete it to free space)."""
    filler = fs / "filler"
    chunk = b"\xa5" * (64 << 10)
    with open(filler, "wb", buffering=0) as f:
        for size in (len(chunk), 4096, 1):
            while True:
                try:
                    if f.write(chunk[:size]) == 0:
                        break
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC
                    break
    return filler


def model_and_opt() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))  # ~1.6 MB with Adam
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    loss = model(torch.randn(8, 256)).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


@pytest.mark.parametrize("engine", ["sync", "concurrent"])
def test_sigterm_with_a_full_disk_requeues_from_the_previous_checkpoint(
        small_tmpfs: Callable[[str], Path], engine: str, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    fs = small_tmpfs("16m")
    root = fs / "ck"
    monkeypatch.setenv("HPCCKPT_CLUSTER", "local")
    caplog.set_level(logging.INFO, logger="hpcckpt")
    model, opt = model_and_opt()
    ck = Checkpointer(root, engine=engine, every_steps=2, keep=3)
    with pytest.raises(RequeueExit) as stop:
        with ck:
            ck.register(model=model, optimizer=opt)
            for step in ck.steps(10):
                train(model, opt)
                if step == 2:  # step 2 is committed; now the disk fills up and the job is told to stop
                    if engine == "concurrent":
                        ck.engine.drain()  # type: ignore[attr-defined]  # step 2's commit lands first
                    filler = fill(fs)
                    os.kill(os.getpid(), signal.SIGTERM)
    assert stop.value.code == EXIT_REQUEUE and stop.value.step == 3
    assert ck.committed_step == 2  # the failed save did not move it
    messages = [r.getMessage() for r in caplog.records]
    said = [m for m in messages if "final checkpoint of step 3 failed twice" in m]  # tried once more first
    assert said and "resumes from the previous committed checkpoint, step 2" in said[0], messages
    if engine == "sync":  # torch's own "unexpected pos" error is replaced by what happened
        assert f"no space left on the device holding {root}" in said[0]
    assert any("requeue decision" in m for m in messages)
    assert not [p for p in root.iterdir() if ".tmp-" in p.name]  # the failed save left nothing behind
    assert [(i.step, i.status) for i in catalog.scan(root)] == [(2, "committed")]

    filler.unlink()  # space is back: the requeued job resumes from step 2
    model2, opt2 = model_and_opt()
    with Checkpointer(root, engine=engine, every_steps=2, keep=3) as ck2:
        assert ck2.register(model=model2, optimizer=opt2) == 2
    failed = [e for e in Ledger(root).read() if e["event"] in ("commit", "save_failed")]
    assert all(e["path"] is not None for e in failed if e["event"] == "commit")


def test_ledger_on_a_full_disk_never_stops_training(small_tmpfs: Callable[[str], Path],
                                                    caplog: pytest.LogCaptureFixture,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    fs = small_tmpfs("4m")
    root = fs / "ck"
    root.mkdir()
    monkeypatch.setenv("HPCCKPT_CLUSTER", "local")
    filler = fill(fs)
    caplog.set_level(logging.ERROR, logger="hpcckpt")
    model, opt = model_and_opt()
    with Checkpointer(root, every_steps=None) as ck:
        ck.register(model=model, optimizer=opt)
        done = []
        for step in ck.steps(5):
            train(model, opt)
            done.append(step)
    assert done == [0, 1, 2, 3, 4]
    assert any("could not record 'start'" in r.getMessage() for r in caplog.records)
    assert any("could not record 'stop'" in r.getMessage() for r in caplog.records)
    filler.unlink()
    Ledger(root).append("probe")  # a torn line from the full disk does not swallow the next event
    assert Ledger(root).read()[-1]["event"] == "probe"
