"""Disk full during a concurrent persist: training goes on, the error is reported once,
the previous checkpoint stays intact (a real 8 MiB tmpfs as the checkpoint directory)."""
from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hpcckpt.api import Checkpointer
from hpcckpt.engines import load_rank
from hpcckpt.errors import CheckpointFailed
from hpcckpt.lifecycle.ledger import Ledger
from hpcckpt.store import catalog

pytestmark = [pytest.mark.native, pytest.mark.fault]


def test_enospc_during_persist_training_continues_error_once(small_tmpfs: Callable[[str], Path],
                                                            caplog: pytest.LogCaptureFixture,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    full_fs = small_tmpfs("8m")
    monkeypatch.setenv("HPCCKPT_CLUSTER", "local")
    torch.manual_seed(0)
    # 2 x Linear(512, 512) + Adam: about 6.3 MB per checkpoint; the second one cannot fit in 8 MiB.
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    caplog.set_level(logging.ERROR, logger="hpcckpt")
    with Checkpointer(full_fs, engine="concurrent", every_steps=2, keep=3, max_async=2) as ck:
        ck.register(model=model, optimizer=opt)
        steps_run = []
        for step in ck.steps(7):  # saves at steps 2, 4, 6, and the finished run's state at 7
            loss = model(torch.randn(16, 512)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            steps_run.append(step)
            # Let each save finish before the next boundary, so the boundary reports it.
            ck.engine.drain()  # type: ignore[attr-defined]
            if step == 1:  # the state checkpoint "step 2" holds (two optimizer steps done)
                want = {n: t.clone() for n, t in model.state_dict().items()}
        assert steps_run == list(range(7))  # training went on after the failures

        failures = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
        assert len([m for m in failures if "step 4 failed" in m]) == 1
        assert len([m for m in failures if "step 6 failed" in m]) == 1
        assert all("No space left on device" in m and str(full_fs) in m for m in failures)
        events = [e for e in Ledger(full_fs).read() if e["event"] == "save_failed"]
        assert [e["step"] for e in events] == [4, 6, 7, 7]  # the end-of-run one does not fit either (twice)
        # a failed save is never recorded as a commit, and does not move the committed step
        commits = [e for e in Ledger(full_fs).read() if e["event"] == "commit"]
        assert [(e["step"], e["path"] is not None) for e in commits] == [(2, True)]
        assert ck.committed_step == 2

        # The previous checkpoint is intact and no half-written temp directory is left.
        assert sorted(p.name for p in full_fs.iterdir() if p.name.startswith("step-")) == ["step-2"]
        info = catalog.find(full_fs, None)
        assert info.step == 2 and catalog.check(info.path, full=True)[1] == []
        saved = load_rank(info, 0, 1).tensors
        for name, t in want.items():
            assert torch.equal(saved[f"objects/model/{name}"], t), name

        # A final save on a full disk must not pretend to succeed.
        with pytest.raises(CheckpointFailed, match="No space left on device"):
            ck.save(final=True)
