"""Gradient accumulation: whether a step boundary falls inside one, and its gradients.

A hook on each registered optimizer (after its step) and on the first and last trained
parameter of each registered module (after a backward accumulated into it) tell a boundary
inside a gradient accumulation (a loop that steps every N batches): the gradients summed
so far are saved with it (``Progress.grads``) and put back on resume (``put_back``).
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from ..errors import ConfigError
from ..state import TrainState, stepping_optimizer

log = logging.getLogger("hpcckpt")


class Accumulation:
    """Follows the registered optimizers' steps and the registered modules' backward passes."""

    def __init__(self, state: TrainState) -> None:
        self._state = state
        self.accumulating = False  # a backward since a registered optimizer last stepped
        self.trained = 0  # optimizer steps and gradient accumulations seen (a left pass's batch was trained)
        self._step_hooks: dict[int, Any] = {}
        self._grad_hooks: dict[int, Any] = {}

    @property
    def hooked(self) -> bool:
        """Whether anything registered is followed (without it every batch counts as trained)."""
        return bool(self._step_hooks or self._grad_hooks)

    def hook(self, objects: dict[str, Any]) -> None:
        """Follow each registered optimizer's steps, and the gradients reaching the first and last
        trained parameter of each registered module (two Python calls a backward, whatever the
        model's size)."""
        for name, obj in objects.items():
            if isinstance(obj, torch.optim.Optimizer):
                try:
                    stepping = stepping_optimizer(obj, name)
                except ConfigError:
                    continue  # a wrapper without hooks: the engine says so where it needs them
                if id(stepping) not in self._step_hooks:
                    self._step_hooks[id(stepping)] = stepping.register_step_post_hook(self._stepped)
            elif isinstance(obj, torch.nn.Module):
                trained = [p for p in obj.parameters() if p.requires_grad]
                for p in {id(p): p for p in trained[:1] + trained[-1:]}.values():
                    if id(p) not in self._grad_hooks and hasattr(p, "register_post_accumulate_grad_hook"):
                        self._grad_hooks[id(p)] = p.register_post_accumulate_grad_hook(self._accumulated)

    def _stepped(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.accumulating = False
        self.trained += 1

    def _accumulated(self, param: Any) -> None:
        self.accumulating = True
        self.trained += 1

    def grads(self) -> dict[str, dict[str, torch.Tensor]]:
        """The gradients of the registered modules when this boundary falls inside a gradient
        accumulation: they are the partial sum the next batches add to, so a resume from here
        must have them. Empty at any other boundary (and without a registered optimizer)."""
        if not self._step_hooks or not self.accumulating:
            return {}
        out: dict[str, dict[str, torch.Tensor]] = {}
        for name, obj in self._state.objects.items():
            if isinstance(obj, torch.nn.Module):
                grads = {pname: p.grad for pname, p in obj.named_parameters()
                         if p.grad is not None and type(p.grad) is torch.Tensor}  # not a DTensor's
                if grads:
                    out[name] = grads
        return out

    def put_back(self, objects: dict[str, Any], restored: dict[str, Any]) -> None:
        """After a resume inside a gradient accumulation: the registered modules get the gradients
        accumulated so far back (``restored``: the saved ones, by module; taken from it)."""
        back = []
        for name, obj in objects.items():
            saved = restored.pop(name, None)
            if not saved or not isinstance(obj, torch.nn.Module):
                continue
            back.append(name)
            params = dict(obj.named_parameters())
            for pname, grad in saved.items():
                p = params.get(pname)
                if p is None or p.shape != grad.shape or p.dtype != grad.dtype:
                    raise ConfigError(f"the checkpoint holds the gradient accumulated for {name}.{pname} "
                                      f"({tuple(grad.shape)}, {grad.dtype}), which {name} does not have as such; "
                                      "resume with the model that saved it")
                p.grad = grad.to(p.device, copy=True)
        if back:
            self.accumulating = True  # the accumulation goes on until the optimizer steps
            log.info("hpcckpt: resumed inside a gradient accumulation: the gradients accumulated since the last "
                     "optimizer step are back in %s", ", ".join(back))

    def remove(self) -> None:
        """Remove every hook (close)."""
        for hook in (*self._step_hooks.values(), *self._grad_hooks.values()):
            hook.remove()
        self._step_hooks.clear()
        self._grad_hooks.clear()
