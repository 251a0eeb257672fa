"""Trained state that the registered objects do not save.

A resume is exact only if everything training changes comes back, and two mistakes lose
parameters without a sound: a module that keeps its layers in a plain Python list or dict
(``self.layers = [Layer(...), ...]``, as pytorch/examples ``mnist_forward_forward`` does),
whose layers are then no submodules, so neither ``state_dict()`` nor ``parameters()`` of
the registered model holds them; and an optimizer registered without the module whose
parameters it trains. The optimizer's state comes back, the weights start again from
their initial values, and the run goes on from there as if nothing had happened.

``unsaved(objects)`` names both, from the objects themselves (no ``state_dict()`` of any
object other than a module is called: that of a data loader may start its workers). A
parameter counts as saved when a registered module holds it (``parameters()`` or
``state_dict(keep_vars=True)``, by identity or by storage). Where an object of a kind that
could hold parameters is registered (anything but a module, an optimizer, a scheduler, a
gradient scaler, a sampler or a data loader), it may save them itself, and nothing is said.
"""
from __future__ import annotations

import gc
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from .state import AcceleratorCounter

# Registered kinds that hold no parameters of their own (they cannot save a module's).
_NO_PARAMETERS: tuple[type, ...] = (torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler,
                                    torch.utils.data.Sampler, torch.utils.data.DataLoader, AcceleratorCounter)
try:
    _NO_PARAMETERS += (torch.amp.GradScaler,)
except AttributeError:  # torch without torch.amp.GradScaler
    pass


def _key(t: torch.Tensor) -> tuple[int, int] | None:
    """Where a tensor's values live (storage start and length): a view or ``detach()`` of a
    parameter shares it. None for tensors without storage (meta, some wrappers)."""
    try:
        storage = t.untyped_storage()
        return (storage.data_ptr(), storage.nbytes())
    except (RuntimeError, NotImplementedError, AttributeError):
        return None


def _hidden_modules(root: torch.nn.Module, name: str) -> Iterator[tuple[str, torch.nn.Module]]:
    """Modules held in a plain list, tuple or dict attribute of ``root`` or of one of its
    submodules (one level deep), with the path a user would write."""
    for prefix, module in root.named_modules():
        for attr, value in vars(module).items():
            if attr.startswith("_"):  # nn.Module's own registries (_parameters, _modules...)
                continue
            if isinstance(value, dict):
                items: Any = value.items()
            elif isinstance(value, (list, tuple)):
                items = enumerate(value)
            else:
                continue
            for key, item in items:
                if isinstance(item, torch.nn.Module):
                    owner = f"{name}.{prefix}" if prefix else name
                    yield f"{owner}.{attr}[{key!r}]", item


def _values(params: list[torch.Tensor]) -> str:
    n = sum(p.numel() for p in params)
    return f"{len(params)} parameter{'s' if len(params) != 1 else ''} ({n:,} values)"


def _accumulation_uncounted(objects: Mapping[str, Any]) -> list[str]:
    """An optimizer stepped through Accelerate's gradient accumulation, without the Accelerator
    that counts its batches registered: a resume inside an accumulation would count again from 0."""
    if any(isinstance(o, AcceleratorCounter) for o in objects.values()):
        return []
    lines = []
    for name, obj in objects.items():
        every = getattr(getattr(obj, "gradient_state", None), "num_steps", 1)
        if isinstance(obj, torch.optim.Optimizer) and isinstance(every, int) and every > 1:
            lines.append(f"optimizer {name!r} steps every {every} batches through Accelerate's gradient "
                         "accumulation, whose count of batches is the Accelerator's: register it too "
                         "(ckpt.register(accelerator=accelerator)), or a resume inside an accumulation steps "
                         "the optimizer at other batches than the uninterrupted run")
    return lines


def unsaved(objects: Mapping[str, Any]) -> list[str]:
    """One line per piece of trained state that no registered object saves (empty: none seen)."""
    accumulation = _accumulation_uncounted(objects)
    if any(not isinstance(o, (torch.nn.Module, *_NO_PARAMETERS)) for o in objects.values()):
        return accumulation  # an object of the user's own may save what the modules do not
    held = [p for o in objects.values() if isinstance(o, torch.nn.Module) for p in o.parameters()]
    ids = {id(p) for p in held}
    keys: set[tuple[int, int] | None] | None = None  # storages, looked up only past the identity test

    def lost(params: Iterator[torch.Tensor]) -> list[torch.Tensor]:
        nonlocal keys
        out = []
        for p in params:
            if id(p) in ids:
                continue
            if keys is None:
                keys = {_key(t) for t in held} - {None}
            if _key(p) not in keys:
                out.append(p)
        return out

    lines: list[str] = []
    seen: set[int] = set()
    for name, obj in objects.items():
        if not isinstance(obj, torch.nn.Module):
            continue
        for path, module in _hidden_modules(obj, name):
            trained = lost(p for p in module.parameters() if p.requires_grad and id(p) not in seen)
            seen.update(id(p) for p in trained)
            if trained:
                lines.append(f"{path} ({type(module).__name__}) is held in a plain Python container, not as a "
                             f"submodule: its {_values(trained)} are not in {name}.state_dict() and nothing "
                             "registered saves them. Hold such layers in nn.ModuleList / nn.ModuleDict, or "
                             "register them")
    for name, obj in objects.items():
        if not isinstance(obj, torch.optim.Optimizer):
            continue
        trained = lost(p for g in obj.param_groups for p in g["params"] if id(p) not in seen)
        seen.update(id(p) for p in trained)
        if trained:
            lines.append(f"optimizer {name!r} trains {_values(trained)} that nothing registered saves: a resume "
                         "would bring back its state without them. Register the module they belong to")
    return lines + accumulation


def loose_loader_iterators(objects: Mapping[str, Any]) -> list[str]:
    """One line per live DataLoader iterator (``iter(loader)`` kept by the script), for a run
    whose training takes no batch through ``ckpt.batches``/``loop``: hpcckpt does not know
    such an iterator's place, and a resumed run makes a new one, whose pass starts again
    (another order when shuffled; batches trained before the stop come again, others are
    never seen). Looked for once, at the first step boundary (one ``gc.get_objects()``, ~45 ms
    with transformers imported). The iterator of a registered loader that saves its own place
    (torchdata's ``StatefulDataLoader``) is not one."""
    from torch.utils.data.dataloader import _BaseDataLoaderIter
    stateful = any(isinstance(o, torch.utils.data.DataLoader) and hasattr(o, "load_state_dict")
                   for o in objects.values())
    lines = []
    gc.collect()  # iterators only a reference cycle still holds (a finished loop's frame) are gone
    for obj in gc.get_objects():
        # type(), not isinstance(): isinstance reads __class__, which some objects answer with a
        # warning (torch.distributed's deprecated reduce_op)
        if not issubclass(type(obj), _BaseDataLoaderIter) or (stateful and hasattr(obj, "state_dict")):
            continue
        dataset = type(getattr(obj, "_dataset", None)).__name__
        sampler = getattr(obj, "_index_sampler", None)
        inner = getattr(sampler, "sampler", sampler)
        shuffled = isinstance(inner, (torch.utils.data.RandomSampler, torch.utils.data.SubsetRandomSampler,
                                      torch.utils.data.WeightedRandomSampler))
        taken = int(getattr(obj, "_num_yielded", 0))
        lines.append(f"the place in its pass of a DataLoader iterator over {dataset} ({taken} "
                     f"batch{'' if taken == 1 else 'es'} taken so far), which the script takes batches from "
                     "outside ckpt.batches/loop: a resumed run makes a new iterator, whose pass starts again"
                     f"{' in another order' if shuffled else ''} (batches trained before the stop come again, "
                     "others are never seen). For training, take them from `for step, batch in ckpt.loop(loader, "
                     "total_steps):` or `ckpt.batches(loader)` each epoch")
    return lines
