"""What a JIT checkpoint holds, and where each part comes from.

- *Replicated* tensors: the parameters of registered ``DistributedDataParallel`` modules
  whose group spans the world, and the state of optimizers over only such parameters.
  Only ``optimizer.step()`` changes them; with further steps held back (``StepGate``)
  the live tensors of any survivor are the state after its last completed step.
- *Rank-local* state: everything else (module buffers, schedulers, samplers, scalers,
  RNG, user metadata). It changes between steps (a forward pass updates buffers, the
  loop advances the sampler), so it is copied at every step boundary (``Boundary``),
  which costs a few small copies and never touches parameters or optimizer state.
  The optimizers' hyperparameters (each param group's ``lr``, weight decay...) are copied
  there too: a scheduler stepped before ``optimizer.step()`` changes them mid-step.
"""
from __future__ import annotations

import copy
import json
import threading
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .._core import crc32c
from ..state import _escape, flatten, rng_state, stepping_optimizer

FINGERPRINT_BYTES = 4 << 20  # per sampled tensor
CUDA_WAIT_S = 30.0  # the most the JIT path waits for CUDA work (events, copies) before giving up
_PLAIN = (int, float, bool, str, bytes, type(None))


class CudaWaitTimeout(RuntimeError):
    """CUDA work the JIT copy depends on did not complete in time (a stuck device or stream)."""


def replication_problem(objects: Mapping[str, Any], world: int, state: Any = None) -> str | None:
    """Why the registered state is not replicated on every rank (None: JIT applies).

    With ``state`` (a ``TrainState`` that knows the setup's declaration, the
    ``replicated`` option), every parameter of every registered module and the state
    of every registered optimizer must be declared replicated; without it, every
    module must be a ``DistributedDataParallel`` over the whole world.
    """
    for name, obj in objects.items():
        if isinstance(obj, torch.nn.Module) and any(_is_dtensor(p) for p in obj.parameters()):
            return f"model {name!r} has sharded (DTensor) parameters with no live replica"
    placement = getattr(state, "placement", None)
    if callable(placement) and getattr(state, "world", 1) == world:
        return _declared_problem(objects, placement(), getattr(state, "replicated", "auto"))
    from torch.nn.parallel import DistributedDataParallel as DDP
    ddp_params: set[int] = set()
    models = 0
    for name, obj in objects.items():
        if isinstance(obj, torch.nn.Module):
            if not isinstance(obj, DDP):
                return (f"model {name!r} is a {type(obj).__name__}, not a DistributedDataParallel module: "
                        "its parameters are not declared replicated")
            group = getattr(obj, "process_group", None)
            size = group.size() if group is not None and hasattr(group, "size") else world
            if size != world:
                return f"model {name!r} replicates over {size} of {world} ranks, not over the whole world"
            for p in obj.parameters():
                if _is_dtensor(p):
                    return f"model {name!r} has sharded (DTensor) parameters with no live replica"
                ddp_params.add(id(p))
            models += 1
    if not models:
        return "no DistributedDataParallel model is registered"
    for name, obj in objects.items():
        if isinstance(obj, torch.optim.Optimizer):
            params = [p for g in obj.param_groups for p in g["params"]]
            if any(id(p) not in ddp_params for p in params):
                return f"optimizer {name!r} holds parameters outside the registered DDP models"
    return None


def _declared_problem(objects: Mapping[str, Any], placement: Any, option: str) -> str | None:
    fix = ("register the DistributedDataParallel model (replicated='auto'), or declare the module inside "
           "it replicated (replicated='models')")
    modules = 0
    for name, obj in objects.items():
        if isinstance(obj, torch.nn.Module):
            for pname, _ in obj.named_parameters(remove_duplicate=False):
                if not placement.is_replicated(f"objects/{name}/{_escape(pname)}"):
                    return (f"the parameters of model {name!r} are not declared replicated "
                            f"(replicated={option!r}); {fix}")
            modules += 1
        elif isinstance(obj, torch.optim.Optimizer) and obj.param_groups and \
                not placement.is_replicated(f"objects/{name}/state/0"):
            return f"the state of optimizer {name!r} is not declared replicated (replicated={option!r}); {fix}"
    if not modules:
        return "no model is registered"
    return None


def _is_dtensor(t: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - older torch
        return False
    return isinstance(t, DTensor)


class StepGate:
    """Optimizer step hooks: count completed steps; once frozen, no step may start."""

    def __init__(self, optimizers: Mapping[str, torch.optim.Optimizer]) -> None:
        self.names = sorted(optimizers)
        self.counts = {n: 0 for n in self.names}
        self.in_step = 0
        self.frozen = False
        self.cond = threading.Condition()
        self._handles = []
        # CUDA devices of each optimizer's parameters: an event recorded after each step marks
        # when its kernels are done (the JIT copy waits on it from a stream of its own).
        self._devices = {n: sorted({p.device for g in optimizers[n].param_groups for p in g["params"]
                                    if p.is_cuda}, key=str) for n in self.names}
        self.events: dict[tuple[str, Any], Any] = {}
        for n in self.names:
            opt = stepping_optimizer(optimizers[n], n)  # a wrapper's (Accelerate's) inner optimizer
            self._handles.append(opt.register_step_pre_hook(self._pre(n)))
            self._handles.append(opt.register_step_post_hook(self._post(n)))

    def _pre(self, name: str) -> Any:
        def hook(opt: Any, args: Any, kwargs: Any) -> None:
            with self.cond:
                while self.frozen:  # the JIT save owns the state now; the process ends with it
                    self.cond.wait()
                self.in_step += 1
        return hook

    def _post(self, name: str) -> Any:
        def hook(opt: Any, args: Any, kwargs: Any) -> None:
            for device in self._devices[name]:
                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(device))
                self.events[(name, device)] = ev
            with self.cond:
                self.in_step -= 1
                self.counts[name] += 1
                self.cond.notify_all()
        return hook

    def snapshot(self) -> tuple[int, ...]:
        return tuple(self.counts[n] for n in self.names)

    def freeze(self, timeout_s: float) -> bool:
        """Hold back every further step; True once no step is running (within ``timeout_s``)."""
        with self.cond:
            self.frozen = True
            return self.cond.wait_for(lambda: self.in_step <= 0, timeout_s)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


@dataclass
class Boundary:
    """Rank-local state as of the end of ``step`` (after its optimizer steps)."""

    step: int
    counts: tuple[int, ...]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    trees: dict[str, Any] = field(default_factory=dict)  # {"objects": {name: tree}, "rng": tree, "user": {...}}
    raw_rng: Any = None  # rng_state() as taken; ``finish`` flattens it
    groups: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # optimizers' param groups sans params
    events: list[Any] = field(default_factory=list)  # CUDA events after the copies (devices' streams)


def _copy_value(v: Any) -> Any:
    if isinstance(v, _PLAIN):
        return v
    if isinstance(v, torch.Tensor):
        return v.detach().clone()
    if isinstance(v, tuple) and all(isinstance(x, _PLAIN) for x in v):
        return v  # betas and the like: immutable already
    return copy.deepcopy(v)


def copy_groups(opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each param group's entries but ``params`` (hyperparameters), copied."""
    return [{k: _copy_value(v) for k, v in g.items() if k != "params"} for g in opt.param_groups]


_persistent: weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple[str, ...], frozenset[str]]] = \
    weakref.WeakKeyDictionary()


def persistent_buffers(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``named_buffers()`` that ``state_dict()`` holds (non-persistent ones are never saved)."""
    named = list(module.named_buffers())
    names = tuple(n for n, _ in named)
    cached = _persistent.get(module)
    if cached is None or cached[0] != names:
        keys = frozenset(module.state_dict(keep_vars=True))
        cached = _persistent[module] = (names, keys)
    return [(n, t) for n, t in named if n in cached[1]]


def capture_boundary(step: int, counts: tuple[int, ...], objects: Mapping[str, Any],
                     user_meta: Mapping[str, Any]) -> Boundary:
    """Copy the rank-local state now (small objects, RNG, persistent module buffers, optimizer
    hyperparameters); main thread."""
    b = Boundary(step, counts)
    objs: dict[str, Any] = {}
    group_tensors: list[torch.Tensor] = []
    for name, obj in objects.items():
        if isinstance(obj, torch.optim.Optimizer):
            b.groups[name] = copy_groups(obj)
            group_tensors += [v for g in b.groups[name] for v in g.values() if isinstance(v, torch.Tensor)]
            continue
        if isinstance(obj, torch.nn.Module):
            for key, buf in persistent_buffers(obj):
                b.tensors[f"objects/{name}/{_escape(key)}"] = buf.detach().clone()
            continue
        objs[name] = flatten(obj.state_dict(), f"objects/{name}", b.tensors)
    b.trees["objects"] = objs
    b.trees["user"] = json.loads(json.dumps(dict(user_meta), default=str)) if user_meta else {}
    for n, t in list(b.tensors.items()):
        if n.split("/")[1] in objs:
            b.tensors[n] = t.detach().clone()  # flatten aliases live state; buffers are copies already
    b.raw_rng = rng_state()  # fresh copies; flattened only if a JIT save needs them (``finish``)
    for device in sorted({t.device for t in (*b.tensors.values(), *group_tensors) if t.is_cuda}, key=str):
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(device))
        b.events.append(ev)
    return b


def wait_events(events: list[Any], deadline: float, what: str = "CUDA work") -> None:
    """Poll ``events`` until each completed; ``CudaWaitTimeout`` at ``deadline`` (monotonic)."""
    pending = list(events)
    while pending:
        pending = [ev for ev in pending if not ev.query()]
        if not pending:
            return
        if time.monotonic() >= deadline:
            raise CudaWaitTimeout(f"{what} did not complete within the JIT path's bound "
                                  f"({len(pending)} event(s) pending): the device or its stream is stuck")
        time.sleep(0.002)


def to_host(tensors: Mapping[str, torch.Tensor], events: list[Any],
            timeout_s: float = CUDA_WAIT_S) -> dict[str, torch.Tensor]:
    """Host copies of ``tensors``; CUDA ones copied on a stream of the JIT's own.

    The training stream may be stuck for good behind a collective that will never
    complete (a NCCL all-reduce waiting for the dead rank): anything queued there would
    wait too. The JIT stream waits only on ``events`` (recorded after the last optimizer
    step and after the boundary copies), then copies. No wait is unbounded: the events
    and the copies are polled (``event.query()``) until ``timeout_s``, then
    ``CudaWaitTimeout`` (the survivor reports no consistent state and still requeues).
    CPU tensors are returned as they are, without any wait. (The CUDA path cannot be
    exercised by the CPU test suite.)
    """
    out: dict[str, torch.Tensor] = {}
    cuda = {n: t for n, t in tensors.items() if t.is_cuda}
    for n, t in tensors.items():
        if not t.is_cuda:
            out[n] = t
    if not cuda:
        return out
    deadline = time.monotonic() + timeout_s
    wait_events(events, deadline, "the last optimizer step or boundary copy")
    streams: dict[Any, Any] = {}
    for n, t in cuda.items():
        stream = streams.get(t.device)
        if stream is None:
            stream = streams[t.device] = torch.cuda.Stream(device=t.device)
            for ev in events:
                stream.wait_event(ev)  # complete already; an event of another device is waited on by that device's stream only
        host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)  # pinned: the copy is asynchronous
        with torch.cuda.stream(stream):
            host.copy_(t.detach(), non_blocking=True)
        out[n] = host
    done = []
    for stream in streams.values():
        ev = torch.cuda.Event()
        ev.record(stream)
        done.append(ev)
    wait_events(done, deadline, "the JIT's device-to-host copy")
    return {n: out[n] for n in tensors}


def finish(b: Boundary) -> Boundary:
    """Flatten the RNG states of ``b`` into its tensors and trees (the JIT path; idempotent)."""
    if b.raw_rng is not None:
        b.trees["rng"] = flatten(b.raw_rng, "rng", b.tensors)
        b.raw_rng = None
    return b


def capture_replicated(objects: Mapping[str, Any], groups: Mapping[str, list[dict[str, Any]]] | None = None
                       ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(trees, tensors) of models and optimizers, aliasing live state; steps must be frozen.

    ``groups``: each optimizer's hyperparameters as copied at the boundary (``Boundary.groups``);
    they replace the live ones, which a scheduler may have moved on since.
    """
    trees: dict[str, Any] = {}
    tensors: dict[str, torch.Tensor] = {}
    for name, obj in objects.items():
        if isinstance(obj, (torch.nn.Module, torch.optim.Optimizer)):
            sd = obj.state_dict()
            if isinstance(obj, torch.optim.Optimizer) and groups and name in groups:
                kept = groups[name]
                sd = {**sd, "param_groups": [{**g, **kept[i], "params": g["params"]} if i < len(kept) else g
                                             for i, g in enumerate(sd["param_groups"])]}
            trees[name] = flatten(sd, f"objects/{name}", tensors)
    return trees, tensors


def fingerprint(step: int, counts: tuple[int, ...], tensors: Mapping[str, torch.Tensor],
                events: list[Any] | None = None) -> str:
    """Step, optimizer step counts and crc32c of a few replicated tensors (first, middle, last)."""
    names = sorted(n for n, t in tensors.items() if t.numel())
    picked = sorted({names[0], names[len(names) // 2], names[-1]}) if names else []
    parts = [f"step={step}", f"counts={list(counts)}"]
    count = {n: max(1, FINGERPRINT_BYTES // tensors[n].element_size()) for n in picked}
    # A view of a contiguous tensor launches nothing on the (maybe stuck) training stream.
    heads = to_host({n: tensors[n].detach().view(-1)[:count[n]] if tensors[n].is_contiguous()
                     else tensors[n].detach() for n in picked}, events or [])
    for n in picked:
        head = heads[n].reshape(-1)[:count[n]].contiguous()
        raw = head.view(torch.uint8).numpy() if head.dtype != torch.bool else head.to(torch.uint8).numpy()
        parts.append(f"{n}:{crc32c(raw):08x}")
    return ";".join(parts)
