"""Which captured tensors the concurrent engine may copy after ``save()`` returns: only what a
registered optimizer's step changes (its hooks hold that step back until the copy is done).
A parameter stepped by an optimizer hpcckpt was not given, or frozen, is copied inside save()."""
from __future__ import annotations

import torch

from hpcckpt.state import TrainState


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def test_the_parameters_a_registered_optimizer_holds_are_background_safe() -> None:
    model = _model()
    st = TrainState()
    st.register("model", model)
    st.register("optimizer", torch.optim.AdamW(model.parameters()))
    safe = st.background_safe()
    assert {f"objects/model/{n}" for n, _ in model.named_parameters()} <= safe
    assert "objects/optimizer/state/" in safe and "rng/" in safe


def test_parameters_no_registered_optimizer_steps_are_copied_inside_save() -> None:
    model = _model()
    torch.optim.SGD(model.parameters(), lr=0.1)  # the script's own, never registered: no hook holds its step
    st = TrainState()
    st.register("model", model)
    assert st.background_safe() == {"rng/"}


def test_a_frozen_parameter_is_copied_inside_save() -> None:
    model = _model()
    model[0].weight.requires_grad_(False)
    st = TrainState()
    st.register("model", model)
    st.register("optimizer", torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1))
    safe = st.background_safe()
    assert "objects/model/0.weight" not in safe
    assert {"objects/model/0.bias", "objects/model/2.weight", "objects/model/2.bias"} <= safe
