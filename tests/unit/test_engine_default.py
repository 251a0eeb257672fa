"""What ``Checkpointer(dir)`` uses with no options: the concurrent engine, its staging chosen
from the state's size and the node's memory (``staging_bytes="auto"``); ``sync`` is named."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hpcckpt import Checkpointer
from hpcckpt.config import DEFAULT_ENGINE, parse_staging, resolve_options
from hpcckpt.engines.concurrent import ConcurrentEngine
from hpcckpt.engines.staging import AUTO_FULL_BYTES, auto_staging_bytes, local_ranks
from hpcckpt.errors import ConfigError

GB = 1 << 30


def test_the_default_engine_is_concurrent_with_auto_staging(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HPCCKPT_ENGINE", raising=False)
    monkeypatch.delenv("HPCCKPT_STAGING_BYTES", raising=False)
    o = resolve_options(tmp_path / "a")
    assert DEFAULT_ENGINE == "concurrent" and (o.engine, o.staging_bytes) == ("concurrent", "auto")
    assert resolve_options(tmp_path / "a", engine="sync").engine == "sync"  # the baseline, named
    monkeypatch.setenv("HPCCKPT_STAGING_BYTES", "full")
    assert resolve_options(tmp_path / "a").staging_bytes == "full"
    monkeypatch.setenv("HPCCKPT_STAGING_BYTES", "Auto")
    assert resolve_options(tmp_path / "a").staging_bytes == "auto"
    monkeypatch.setenv("HPCCKPT_STAGING_BYTES", "half")
    with pytest.raises(ConfigError, match="HPCCKPT_STAGING_BYTES"):
        resolve_options(tmp_path / "a")
    assert parse_staging("64M") == 64 << 20 and parse_staging(" FULL ") == "full"


def test_auto_staging_never_holds_a_second_copy_of_a_large_state() -> None:
    # a small state: a full copy (None); a large one: a quarter of it as a ring
    assert auto_staging_bytes(3 << 20, available=16 * GB) is None
    assert auto_staging_bytes(AUTO_FULL_BYTES, available=16 * GB) is None
    assert auto_staging_bytes(2 * GB, available=16 * GB) == GB // 2
    assert auto_staging_bytes(100 << 20, available=16 * GB) == AUTO_FULL_BYTES  # the floor, still a ring
    # the node's available memory, shared by its ranks, caps it; so does a memory budget
    assert auto_staging_bytes(8 * GB, available=4 * GB) == GB
    assert auto_staging_bytes(8 * GB, available=4 * GB, ranks_here=4) == GB // 4
    assert auto_staging_bytes(2 * GB, available=None, budget=100 << 20) == 100 << 20
    assert auto_staging_bytes(2 * GB, available=1 << 20) == 8 << 20  # never below 2 x 4 MiB
    assert auto_staging_bytes(2 * GB, available=None) == GB // 2  # memory unknown: the quarter


def test_local_ranks_follow_the_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("SLURM_NTASKS_PER_NODE", raising=False)
    assert local_ranks() == 1
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "4(x2)")
    assert local_ranks() == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert local_ranks() == 8


def test_a_default_checkpointer_saves_and_resumes_through_the_concurrent_engine(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HPCCKPT_ENGINE", raising=False)
    monkeypatch.delenv("HPCCKPT_STAGING_BYTES", raising=False)
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with Checkpointer(tmp_path / "ckpt", every_steps=2) as ck:
        assert isinstance(ck.engine, ConcurrentEngine) and ck.engine.staging_bytes == "auto"
        ck.register(model=model, optimizer=opt)
        for _ in ck.steps(4):
            opt.zero_grad()
            model(torch.randn(8, 64)).sum().backward()
            opt.step()
        assert ck.engine.stats.staging_auto and ck.engine.stats.ring_chunks == 0  # small: a full copy
    want = {k: v.clone() for k, v in model.state_dict().items()}
    model2 = torch.nn.Linear(64, 64)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    with Checkpointer(tmp_path / "ckpt") as ck:
        assert ck.register(model=model2, optimizer=opt2) == 4
    assert all(torch.equal(want[k], v) for k, v in model2.state_dict().items())


def test_auto_staging_streams_a_large_state_through_a_ring(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ring rule on a state above the full-copy limit (the limit lowered, not the state raised)."""
    import hpcckpt.engines.staging as staging
    monkeypatch.setattr(staging, "AUTO_FULL_BYTES", 64 << 10)
    monkeypatch.setattr(staging, "MIN_RING_CHUNKS", 2)
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)  # 257 KiB of parameters, 0.75 MiB with AdamW's moments
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with Checkpointer(tmp_path / "ckpt", every_steps=1, ring_chunk_bytes=16 << 10) as ck:
        ck.register(model=model, optimizer=opt)
        for _ in ck.steps(3):
            opt.zero_grad()
            model(torch.randn(8, 256)).sum().backward()
            opt.step()
        st = ck.engine.stats
        assert st.staging_auto and st.ring_chunks >= 2 and 0 < st.staging_bytes < 1 << 20
    want = {k: v.clone() for k, v in model.state_dict().items()}
    model2 = torch.nn.Linear(256, 256)
    with Checkpointer(tmp_path / "ckpt") as ck:
        assert ck.register(model=model2, optimizer=torch.optim.AdamW(model2.parameters(), lr=1e-2)) == 3
    assert all(torch.equal(want[k], v) for k, v in model2.state_dict().items())


def test_an_optimizer_without_step_hooks_is_copied_inside_save(tmp_path: Path) -> None:
    """The default engine takes an optimizer torch's step hooks cannot reach: its state and the
    parameters are copied inside save() instead of behind the next step, never refused."""

    class Opaque(torch.optim.Optimizer):  # an Optimizer subclass without Optimizer.__init__
        def __init__(self, params: list[torch.nn.Parameter]) -> None:
            self.params = params
            self.param_groups: list[dict[str, object]] = []
            self.state: dict[object, object] = {}

        def step(self, closure: object = None) -> None:
            with torch.no_grad():
                for p in self.params:
                    p.add_(p.grad, alpha=-0.1)

        def state_dict(self) -> dict[str, object]:
            return {"state": {}, "param_groups": []}

        def load_state_dict(self, sd: dict[str, object]) -> None:
            pass

    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    opt = Opaque(list(model.parameters()))
    with Checkpointer(tmp_path / "ckpt") as ck:
        assert isinstance(ck.engine, ConcurrentEngine)
        ck.register(model=model, optimizer=opt)
        model(torch.randn(4, 16)).sum().backward()
        opt.step()
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        handle = ck.save()
        opt.step()  # mutates at once: the checkpoint must hold the values above
        handle.wait()
    model2 = torch.nn.Linear(16, 16)
    with Checkpointer(tmp_path / "ckpt") as ck:
        assert ck.register(model=model2, optimizer=Opaque(list(model2.parameters()))) is not None
    assert all(torch.equal(saved[k], v) for k, v in model2.state_dict().items())


def test_a_final_save_settled_at_once_never_moves_committed_step_back(tmp_path: Path) -> None:
    """A periodic save still listed when a final one is settled is accounted for first: the
    ledger's commits follow the steps and committed_step stays at the final step."""
    from hpcckpt.lifecycle.ledger import Ledger

    model = torch.nn.Linear(8, 8)
    with Checkpointer(tmp_path / "ckpt", every_steps=None) as ck:
        ck.register(model=model)
        ck.step = 1
        ck.save()  # in the background, not settled yet
        ck.step = 2
        ck.save(final=True)  # settled at once
        ck._saves.reap()
        assert ck.committed_step == 2 and ck._saves.handles == []
    commits = [e["step"] for e in Ledger(tmp_path / "ckpt").read() if e["event"] == "commit"]
    assert commits == [1, 2]
