"""hpcckpt's own files are private: whatever the user's umask, every file a run writes in
its checkpoint directory (lock, writer lease, ledger, LATEST, manifests, rank files,
budgets) is 0600 and every directory 0700. A checkpoint directory that others can
write is warned about (test_options_table)."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hpcckpt import Checkpointer
from hpcckpt.cluster import LocalCluster
from hpcckpt.cluster.env import JobEnv
from hpcckpt.lifecycle import requeue


@pytest.fixture()
def open_umask() -> Iterator[None]:
    old = os.umask(0o002)  # the most permissive umask in common use (group-writable)
    try:
        yield
    finally:
        os.umask(old)


def _train(root: Path, engine: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Checkpointer(root, engine=engine, every_steps=1) as ck:
        ck.register(model=model, optimizer=opt)
        for _ in ck.steps(3):
            opt.zero_grad()
            model(torch.ones(1, 4)).sum().backward()
            opt.step()
    requeue(cluster=LocalCluster(JobEnv(environ={})), state_dir=root, cause="signal", committed_step=3,
            source="test")  # writes the budget files


@pytest.mark.native
@pytest.mark.parametrize("engine", ["sync", "concurrent"])
def test_every_file_a_run_writes_is_private(tmp_path: Path, engine: str, open_umask: None) -> None:
    root = tmp_path / "ckpt"
    _train(root, engine)
    modes = {str(p.relative_to(root)): stat.S_IMODE(p.lstat().st_mode) for p in root.rglob("*")}
    assert any(name.startswith("step-") and "/rank-0" in name for name in modes), modes
    loose = {name: oct(mode) for name, mode in modes.items()
             if mode != (0o700 if (root / name).is_dir() else 0o600)}
    assert not loose, f"files other users can read or write: {loose}"
