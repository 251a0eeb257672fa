"""Trained state that the registered objects do not save (``coverage.unsaved``): layers kept
in a plain list (pytorch/examples ``mnist_forward_forward``) and an optimizer registered
without its module are named; submodules, aliases of submodules, frozen layers, another
registered module holding them and objects of the user's own are not."""
from __future__ import annotations

import torch
from torch import nn

from hpcckpt.coverage import unsaved


class Layer(nn.Linear):
    def __init__(self, i: int, o: int) -> None:
        super().__init__(i, o)
        self.opt = torch.optim.Adam(self.parameters(), lr=0.03)


class PlainList(nn.Module):
    """As mnist_forward_forward's Net: layers in a Python list, each with its own optimizer."""

    def __init__(self) -> None:
        super().__init__()
        self.layers: list[Layer] = []
        for d in ((8, 6), (6, 4)):
            self.layers = self.layers + [Layer(*d)]


def test_layers_in_a_plain_list_are_named_with_their_size() -> None:
    net = PlainList()
    lines = unsaved({"net": net, **{f"opt{k}": layer.opt for k, layer in enumerate(net.layers)}})
    assert len(lines) == 2, lines
    assert lines[0].startswith("net.layers[0] (Layer) is held in a plain Python container")
    assert "2 parameters (54 values)" in lines[0] and "nn.ModuleList" in lines[0]
    assert lines[1].startswith("net.layers[1] (Layer)") and "(28 values)" in lines[1]
    # The same layers in a ModuleList are the model's own: nothing to say.
    net.layers = nn.ModuleList(net.layers)  # type: ignore[assignment]
    assert unsaved({"net": net, **{f"opt{k}": layer.opt for k, layer in enumerate(net.layers)}}) == []


def test_an_optimizer_registered_without_its_module_is_named() -> None:
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    [line] = unsaved({"optimizer": opt, "scheduler": sched})
    assert line.startswith("optimizer 'optimizer' trains 4 parameters (23 values) that nothing registered saves")
    assert unsaved({"model": model, "optimizer": opt, "scheduler": sched}) == []
    # Half of the parameters registered: the other half is named.
    [line] = unsaved({"first": model[0], "optimizer": opt})
    assert "2 parameters (8 values)" in line


def test_aliases_frozen_layers_and_objects_of_the_users_own_are_not_named() -> None:
    class Aliased(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)
            self.blocks = [self.a, self.b]  # the same submodules, listed again
            self.teacher = [nn.Linear(2, 2).requires_grad_(False)]  # frozen, kept out of parameters()

    m = Aliased()
    assert unsaved({"m": m, "opt": torch.optim.SGD(m.parameters(), lr=0.1)}) == []
    # A plain-list layer registered on its own is saved.
    net = PlainList()
    assert unsaved({"net": net, "l0": net.layers[0], "l1": net.layers[1]}) == []

    class Holder:  # an object of the user's own may save anything: nothing is said
        def __init__(self, module: nn.Module) -> None:
            self.module = module

        def state_dict(self) -> dict:
            return self.module.state_dict()

        def load_state_dict(self, sd: dict) -> None:
            self.module.load_state_dict(sd)

    model = nn.Linear(3, 3)
    assert unsaved({"holder": Holder(model), "opt": torch.optim.SGD(model.parameters(), lr=0.1)}) == []
