"""hpcckpt.integrations.torchtitan without torchtitan's trainer: what it registers, and the
torchtitan options and calls it refuses, each with the fix (one process, no process group).
The 4-rank preemption and resume is tests/integration/test_torchtitan.py."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from hpcckpt.errors import ConfigError
from hpcckpt.integrations.torchtitan import TitanCheckpoints, check_config, optimizer_objects


class Container(torch.optim.Optimizer):
    """As torchtitan's OptimizersContainer: an Optimizer without lr stepping inner optimizers."""

    def __init__(self, opts: list[torch.optim.Optimizer]) -> None:
        self.optimizers = opts
        torch.optim.Optimizer.__init__(self, [p for o in opts for g in o.param_groups for p in g["params"]], {})


class Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.n = sd["n"]


def test_the_container_s_inner_optimizers_are_registered() -> None:
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    oa, ob = torch.optim.AdamW(a.parameters()), torch.optim.SGD(b.parameters(), lr=0.1)
    assert optimizer_objects(Container([oa])) == {"optimizer": oa}
    assert optimizer_objects(Container([oa, ob])) == {"optimizer_0": oa, "optimizer_1": ob}
    assert optimizer_objects(oa) == {"optimizer": oa}  # a plain optimizer as it is


def test_unsupported_torchtitan_options_are_refused_by_name() -> None:
    ok = SimpleNamespace(load_step=-1, initial_load_path=None, exclude_from_loading=[], last_save_in_hf=False,
                         create_seed_checkpoint=False, enable_first_step_checkpoint=False)
    check_config(ok)
    bad = SimpleNamespace(**{**vars(ok), "initial_load_path": "/seed", "exclude_from_loading": ["dataloader"]})
    with pytest.raises(ConfigError, match=r"checkpoint.initial_load_path='/seed'.*adopt.*"
                                          r"checkpoint.exclude_from_loading=\['dataloader'\]"):
        check_config(bad)


def _titan(tmp_path: Path, total: int = 4) -> tuple[TitanCheckpoints, torch.nn.Module, Counter]:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    train_state = Counter()
    titan = TitanCheckpoints(folder=tmp_path / "ckpt", interval=2, total_steps=total, engine="sync",
                             model_parts=[model], optimizers=Container([opt]), lr_schedulers=sched,
                             dataloader=None, states={"train_state": train_state})
    return titan, model, train_state


def test_a_short_run_checkpoints_at_the_interval_and_resumes(tmp_path: Path) -> None:
    titan, model, state = _titan(tmp_path)
    try:
        assert titan.load() is False
        for step in range(1, 4):
            model.weight.data.add_(1.0)
            state.n = step
            titan.save(step)
    finally:
        titan.close()
    titan, model, state = _titan(tmp_path)
    try:
        assert titan.load() is True
        assert state.n == 2 and titan.ckpt.step == 2  # the checkpoint of the interval, step 2
        with pytest.raises(ConfigError, match=r"save\(4\) after step 2"):
            titan.save(4)
        with pytest.raises(ConfigError, match="load_step=5"):
            titan.load(step=5)
    finally:
        titan.close()


def test_clashing_state_names_are_refused(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ConfigError, match=r"states \['model'\] clash"):
        TitanCheckpoints(folder=tmp_path, interval=2, total_steps=4, model_parts=[model], optimizers=opt,
                         lr_schedulers=Counter(), dataloader=None, states={"model": Counter()})


@pytest.mark.skipif(importlib.util.find_spec("torchtitan") is not None, reason="torchtitan is installed")
def test_the_manager_class_without_torchtitan_says_what_to_install() -> None:
    import hpcckpt.integrations.torchtitan as tt
    with pytest.raises(ImportError, match="needs torchtitan.*pip install torchtitan"):
        tt.HpcckptCheckpointManager  # noqa: B018
