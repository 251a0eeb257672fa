"""Disk full while a save streams through a staging ring smaller than the state: the
optimizer pre-hook (which waits for the ring) never hangs, training goes on, the error is
reported once, and the previous checkpoint stays intact (a real 8 MiB tmpfs)."""
from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hpcckpt.api import Checkpointer
from hpcckpt.engines import load_rank
from hpcckpt.engines.concurrent import ConcurrentEngine
from hpcckpt.store import catalog

pytestmark = [pytest.mark.native, pytest.mark.fault]


def test_enospc_mid_ring_releases_the_step_and_keeps_the_previous_checkpoint(
        small_tmpfs: Callable[[str], Path], caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    full_fs = small_tmpfs("8m")
    monkeypatch.setenv("HPCCKPT_CLUSTER", "local")
    torch.manual_seed(0)
    # 2 x Linear(512, 512) + Adam: about 6.3 MB per checkpoint; the second one cannot fit in 8 MiB.
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    caplog.set_level(logging.ERROR, logger="hpcckpt")
    with Checkpointer(full_fs, engine="concurrent", every_steps=2, keep=3, staging_bytes=1 << 20) as ck:
        ck.register(model=model, optimizer=opt)
        engine = ck.engine
        assert isinstance(engine, ConcurrentEngine)
        steps_run = []
        for step in ck.steps(7):  # saves at steps 2, 4, 6; the pre-hook waits for each stream
            loss = model(torch.randn(16, 512)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            steps_run.append(step)
            engine.drain()
            if step == 1:
                want = {n: t.clone() for n, t in model.state_dict().items()}
        assert steps_run == list(range(7))
        assert 0 < engine.stats.staging_bytes <= 1 << 20 and engine.stats.ring_chunks >= 2

        failures = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
        assert len([m for m in failures if "step 4 failed" in m]) == 1
        assert len([m for m in failures if "step 6 failed" in m]) == 1
        assert all("No space left on device" in m for m in failures)
        assert sorted(p.name for p in full_fs.iterdir() if p.name.startswith("step-")) == ["step-2"]
        info = catalog.find(full_fs, None)
        assert info.step == 2 and catalog.check(info.path, full=True)[1] == []
        saved = load_rank(info, 0, 1).tensors
        for name, t in want.items():
            assert torch.equal(saved[f"objects/model/{name}"], t), name
