"""What is saved: train state flattened to named tensors + a JSON metadata tree.

Nothing is pickled. Tensors (and NumPy arrays) become entries of a flat table keyed
by stable slash-separated names; everything else must be JSON-representable and goes
into the metadata tree, where each tensor is referenced as ``{"__tensor__": name}``.
Restoring the table and tree into the same objects reproduces the run bit for bit.
"""
from __future__ import annotations

import array
import ctypes
import json
import math
import random
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from ._gc import collector_paused
from .errors import CheckpointCorrupt, ConfigError, StateRefused

JSONScalar = (str, int, bool, type(None))


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> Any: ...
    def load_state_dict(self, state: Any) -> Any: ...


class AcceleratorCounter:
    """A registered Hugging Face ``Accelerator``: its count of batches since the last gradient
    sync (``accelerator.step``), which decides at which batch ``accelerator.accumulate`` lets
    the optimizer step. An Accelerator has no ``state_dict()``; registering it saves that count."""

    def __init__(self, accelerator: Any) -> None:
        self.accelerator = accelerator

    @staticmethod
    def wraps(obj: Any) -> bool:
        return type(obj).__name__ == "Accelerator" and type(obj).__module__.startswith("accelerate") \
            and isinstance(getattr(obj, "step", None), int)

    def state_dict(self) -> dict[str, Any]:
        return {"step": int(self.accelerator.step)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        step = state.get("step") if isinstance(state, Mapping) else None
        if not (isinstance(step, int) and not isinstance(step, bool) and step >= 0):
            raise CheckpointCorrupt(f"the Accelerator's saved step count is {step!r}, not a count")
        self.accelerator.step = step


@dataclass
class Flat:
    """A flattened state: ``tensors`` by name and the JSON ``meta`` tree.

    A capture for saving (``TrainState.capture``) holds in ``tensors`` only what this
    rank writes (its pieces of replicated and sharded tensors, and its local ones);
    ``shared`` and ``pieces`` then describe the distributed tensors
    (``store.placement``).
    """

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: Any = None
    shared: dict[str, dict[str, Any]] = field(default_factory=dict)
    pieces: dict[str, Any] = field(default_factory=dict)  # name -> start byte, or a DTensor shard's region
    fingerprints: dict[str, int] = field(default_factory=dict)  # check_replicas: crc32c of each replica


def _escape(key: str) -> str:
    # HDF5 uses '/' as the group separator; keep names round-trippable.
    if key and "%" not in key and "/" not in key:
        return key
    return key.replace("%", "%25").replace("/", "%2F") or "%00"


_SCALAR_TYPES = frozenset((int, str, bool, type(None)))


def _scalars(seq: list[Any] | tuple[Any, ...]) -> bool:
    """Whether every item is an int, str, bool or None (kept as they are, no call for each)."""
    for v in seq:
        if type(v) not in _SCALAR_TYPES:
            return False
    return True


def _plain_keys(obj: dict[Any, Any]) -> bool:
    """Whether every key is a string that does not start with ``__`` (kept as a JSON object)."""
    for k in obj:
        if type(k) is not str or k.startswith("__"):
            return False
    return True


def _int_keys(obj: dict[Any, Any]) -> bool:
    """Whether every key is an int (not a bool): kept as ``__dict__`` pairs, named by number."""
    for k in obj:
        if type(k) is not int:
            return False
    return True


def flatten(obj: Any, prefix: str, out: dict[str, torch.Tensor]) -> Any:
    """Replace every tensor in a nested structure by a reference into ``out``.

    Plain dicts and tensors are tested first: a state of tens of thousands of tensors is
    mostly those (an optimizer's state: a dict of tensors per parameter)."""
    if isinstance(obj, dict):  # dict, OrderedDict (a module's state_dict), defaultdict
        if _plain_keys(obj):
            tree = {}
            for k, v in obj.items():
                tv = type(v)
                # Plain tensor leaves (by far the most common values) and JSON scalars (an
                # optimizer's hyperparameters) without a call of their own.
                if tv in _PLAIN_TENSORS:
                    tree[k] = _tensor_ref(v, f"{prefix}/{_escape(k)}", out)
                elif tv in _SCALAR_TYPES or tv is float and math.isfinite(v):
                    tree[k] = v
                else:
                    tree[k] = flatten(v, f"{prefix}/{_escape(k)}", out)
            return tree
        if _int_keys(obj):  # an optimizer's state: parameter index -> its state
            return {"__dict__": [[k, _tensor_ref(v, f"{prefix}/{k}", out) if type(v) in _PLAIN_TENSORS
                                  else flatten(v, f"{prefix}/{k}", out)] for k, v in obj.items()]}
    if isinstance(obj, torch.Tensor):
        return _tensor_ref(obj, prefix, out)
    if isinstance(obj, np.ndarray):
        out[prefix] = torch.from_numpy(np.ascontiguousarray(obj))
        return {"__ndarray__": prefix}
    if isinstance(obj, np.generic):
        return flatten(obj.item(), prefix, out)
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {"__float__": repr(obj)}
    if isinstance(obj, JSONScalar):
        return obj
    # Tuples and lists before the Mapping test (an ABC check: the slowest here), which the
    # RNG states (tuples) would otherwise pass through at every capture.
    if isinstance(obj, tuple):
        if _scalars(obj):  # e.g. Python's RNG state: 625 ints, saved at every checkpoint
            return {"__tuple__": list(obj)}
        return {"__tuple__": [flatten(v, f"{prefix}/{i}", out) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        if _scalars(obj):
            return list(obj)
        return [flatten(v, f"{prefix}/{i}", out) for i, v in enumerate(obj)]
    if isinstance(obj, Mapping):
        if all(isinstance(k, str) for k in obj) and not any(k.startswith("__") for k in obj):
            return {k: flatten(v, f"{prefix}/{_escape(k)}", out) for k, v in obj.items()}
        items = []
        for k, v in obj.items():
            if not isinstance(k, JSONScalar):
                raise ConfigError(f"state at {prefix!r} has a key of type {type(k).__name__}; keys must be str/int/bool/None")
            items.append([k, flatten(v, f"{prefix}/{_escape(str(k))}", out)])
        return {"__dict__": items}
    if isinstance(obj, torch.dtype):
        return {"__dtype__": str(obj).removeprefix("torch.")}
    raise ConfigError(
        f"state at {prefix!r} holds a {type(obj).__name__}, which hpcckpt cannot save without "
        "pickling; convert it to tensors, numbers, strings, lists or dicts in state_dict()")


_PLAIN_TENSORS = frozenset((torch.Tensor, torch.nn.Parameter))


def _tensor_ref(t: torch.Tensor, name: str, out: dict[str, torch.Tensor]) -> dict[str, Any]:
    """``t`` put in ``out`` as ``name``; its reference in the metadata tree."""
    if name in out:
        raise ConfigError(f"two tensors map to the state name {name!r}")
    out[name] = t.detach() if t.requires_grad else t  # state_dict()'s are detached already
    ref: dict[str, Any] = {"__tensor__": name}
    if not t.is_contiguous() and _permuted(t):
        ref["__stride__"] = list(t.stride())  # a transposed or channels_last layout comes back as saved
    return ref


def _json_copy(value: Any, what: str) -> Any:
    """A deep copy of JSON data; ConfigError naming ``what`` when it is not JSON."""
    try:
        return json.loads(json.dumps(value, allow_nan=True))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{what} must hold only JSON values (numbers, strings, lists, dicts with string "
                          f"keys): {exc}; convert the value, e.g. to a float or a string") from None


def _permuted(t: torch.Tensor) -> bool:
    """A dense tensor whose memory order is not its index order (transposed, channels_last).

    Fused optimizers walk a parameter and its state as flat memory, so state restored
    contiguous next to a transposed parameter would pair the wrong elements.
    """
    if t.dim() < 2 or t.is_contiguous() or _not_plain(t):
        return False
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride()), key=lambda d: d[1]):
        if size > 1 and stride != expected:
            return False  # overlapping or a view with gaps: saved and restored contiguous
        expected *= size
    return True


def _not_plain(t: torch.Tensor) -> bool:
    """Sparse, or a tensor subclass (DTensor): its layout is not ours to keep."""
    return t.layout != torch.strided or type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter)


def _with_strides(t: torch.Tensor, stride: Any) -> torch.Tensor:
    """``t`` with the saved strides (a copy when they differ)."""
    if not isinstance(stride, list) or tuple(stride) == t.stride() or len(stride) != t.dim():
        return t
    out = torch.empty_strided(t.shape, tuple(int(s) for s in stride), dtype=t.dtype, device=t.device)
    out.copy_(t)
    return out


def unflatten(meta: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """Inverse of ``flatten``."""
    if isinstance(meta, list):
        return [unflatten(v, tensors) for v in meta]
    if not isinstance(meta, dict):
        return meta
    if "__tensor__" in meta:
        return _with_strides(tensors[meta["__tensor__"]], meta.get("__stride__"))
    if "__ndarray__" in meta:
        return tensors[meta["__ndarray__"]].numpy()
    if "__float__" in meta:
        return float(meta["__float__"])
    if "__tuple__" in meta:
        return tuple(unflatten(v, tensors) for v in meta["__tuple__"])
    if "__dict__" in meta:
        return {k: unflatten(v, tensors) for k, v in meta["__dict__"]}
    if "__dtype__" in meta:
        return getattr(torch, meta["__dtype__"])
    return {k: unflatten(v, tensors) for k, v in meta.items()}


class _RngReader:
    """The Python and NumPy RNG states, read at every capture (a small state saved at every
    step pays for this each time) without their cost when nothing drew since the last read.

    ``np.random.get_state()`` copies the Mersenne Twister's 624 words one Python object at a
    time (0.15-0.3 ms here); the generator's own state (``ctypes.state_address``: the words
    and the position, 2,500 bytes) is read in a microsecond, and while it is unchanged no
    number was drawn, so the last state still holds, unless a cached Gaussian was pending
    (``has_gauss``: the second of a pair is taken without drawing): then it is read again.
    Anything unexpected (another bit generator, no ctypes) reads ``get_state()`` every time.
    The arrays returned are shared between captures and never written."""

    _MT_BYTES = 624 * 4 + 4  # mt19937_state: uint32_t key[624]; int pos

    def __init__(self) -> None:
        self._gen: Any = None
        self._address = 0
        self._raw = b""
        self._numpy: Any = None
        self._python_key: tuple[int, ...] = ()
        self._python_words: Any = None
        self._lock = threading.Lock()

    def python(self) -> tuple[Any, Any, Any]:
        version, words, gauss = random.getstate()
        with self._lock:
            if self._python_words is None or self._python_key != words:
                # 625 words as an array, not 625 JSON numbers: encoding those cost ~0.1 ms of
                # every commit (most of a small state's manifest); array.array converts in C.
                self._python_words = np.frombuffer(array.array("I", words), dtype=np.uint32)
                self._python_key = words
            return (version, self._python_words, gauss)

    def numpy(self) -> Any:
        gen: Any = getattr(np.random.mtrand._rand, "_bit_generator", None)
        if gen is not self._gen:
            self._gen, self._address, self._numpy = gen, 0, None
            try:
                if type(gen).__name__ == "MT19937":
                    self._address = int(gen.ctypes.state_address)
            except Exception:  # noqa: BLE001 - no fast path: get_state() every time
                self._address = 0
        if not self._address:
            return np.random.get_state()
        with self._lock:
            raw = ctypes.string_at(self._address, self._MT_BYTES)
            if self._numpy is not None and raw == self._raw and not self._numpy[3]:
                return self._numpy
            state = np.random.get_state()
            # Kept only if nothing drew while it was read (another thread): then it is raw's state.
            same = ctypes.string_at(self._address, self._MT_BYTES) == raw
            self._numpy, self._raw = (state, raw) if same else (None, b"")
            return state


_rng = _RngReader()


def rng_state() -> dict[str, Any]:
    """Every RNG that training touches: Python, NumPy, torch CPU, each CUDA device."""
    state: dict[str, Any] = {
        "python": _rng.python(),
        "numpy": _rng.numpy(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def python_rng(saved: Any) -> tuple[Any, ...]:
    """``random.setstate``'s argument from a saved Python RNG state: (version, words, gauss),
    its words an array (a list in checkpoints written before the array)."""
    words = saved[1].tolist() if hasattr(saved[1], "tolist") else saved[1]
    return (saved[0], tuple(words), saved[2])


def set_rng_state(state: Mapping[str, Any]) -> None:
    random.setstate(python_rng(state["python"]))
    np_state = state["numpy"]
    np.random.set_state((np_state[0], np_state[1], int(np_state[2]), int(np_state[3]), float(np_state[4])))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        cuda_states = list(state["cuda"])
        if len(cuda_states) != torch.cuda.device_count():
            raise ConfigError(
                f"checkpoint holds RNG states for {len(cuda_states)} CUDA devices, this node has "
                f"{torch.cuda.device_count()}; resume on the same device count for an exact resume")
        torch.cuda.set_rng_state_all(cuda_states)


def _ddp_ignored(module: Any) -> set[str]:
    """Parameter names (as ``module.named_parameters`` gives them) that DDP leaves unsynchronised."""
    ddp = getattr(getattr(torch.nn, "parallel", None), "DistributedDataParallel", None)
    if ddp is not None and isinstance(module, ddp):
        return {f"module.{n}" for n in getattr(module, "parameters_to_ignore", ())}
    return set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))


def _replicates_world(obj: Any, world: int) -> bool:
    """``obj`` is a DistributedDataParallel module whose group is the whole job."""
    ddp = getattr(getattr(torch.nn, "parallel", None), "DistributedDataParallel", None)
    if ddp is None or not isinstance(obj, ddp):
        return False
    group = getattr(obj, "process_group", None)
    try:
        import torch.distributed as dist
        size = dist.get_world_size(group) if group is not None else dist.get_world_size()
    except (RuntimeError, ValueError):
        return False
    return size == world


class TrainState:
    """The registry of objects that make up one rank's training state.

    ``mutable`` objects change outside ``optimizer.step()`` (buffers, RNG,
    scheduler, sampler, counters); the concurrent engine captures those
    synchronously at the step boundary and only copies parameters and optimizer
    state in the background.
    """

    def __init__(self) -> None:
        self.objects: dict[str, Stateful] = {}
        self.user_meta: dict[str, Any] = {}
        self.rank, self.world = 0, 1  # set by the Checkpointer (``placement``)
        self.replicated = "auto"  # config.REPLICATED: which registered state the setup declares replicated
        self.check_replicas = False  # debug: checksum replicated tensors at each save, compared at the commit

    def placement(self) -> Any:
        """Rank, world and the tensors the setup declares replicated (``store.placement``).

        Replicated (``self.replicated``): "auto", the parameters of a registered
        ``DistributedDataParallel`` module whose process group spans the world;
        "models", the parameters of every registered module (the user registered the
        module inside a DDP wrapper); "none", nothing. Plus the state of an optimizer
        whose parameters are all such parameters. Buffers stay local (DDP broadcasts
        rank 0's at the next forward, so each rank keeps its own to restore exactly).
        """
        from .store.placement import Placement
        if self.world <= 1 or self.replicated == "none":
            return Placement()
        names: set[str] = set()
        prefixes: list[str] = []
        ddp_params: set[int] = set()
        for name, obj in self.objects.items():
            if (_replicates_world(obj, self.world) if self.replicated == "auto"
                    else isinstance(obj, torch.nn.Module)):
                ignored = _ddp_ignored(obj)
                for pname, param in obj.named_parameters(remove_duplicate=False):  # type: ignore[attr-defined]  # obj is a Module here (checked above)
                    if pname in ignored:  # DDP does not synchronise it: each rank's own
                        continue
                    names.add(f"objects/{name}/{_escape(pname)}")
                    ddp_params.add(id(param))
        for name, obj in self.objects.items():
            if isinstance(obj, torch.optim.Optimizer) and ddp_params:
                params = [p for g in obj.param_groups for p in g["params"]]
                if params and all(id(p) in ddp_params for p in params):
                    prefixes.append(f"objects/{name}/state/")
        return Placement(self.rank, self.world, frozenset(names), tuple(prefixes))

    def register(self, name: str, obj: Any) -> None:
        if AcceleratorCounter.wraps(obj):
            obj = AcceleratorCounter(obj)
        if not isinstance(obj, Stateful):
            raise ConfigError(
                f"{name}={type(obj).__name__} has no state_dict()/load_state_dict(); register "
                "models, optimizers, schedulers, scalers, samplers or objects that implement both")
        if "/" in name or name.startswith("__") or name in self.objects:
            raise ConfigError(f"state name {name!r} is invalid or registered twice")
        self.objects[name] = obj

    def capture(self, *, step: int, extra: Mapping[str, Any] | None = None, plan: bool = True) -> Flat:
        """Flatten every registered object plus step, RNG and user metadata.

        Tensors in the result alias live state (no copy): the engine decides
        when and how to copy them. ``plan``: only what this rank writes
        (``store.placement.plan``: pieces of replicated tensors, local shards of
        DTensors); False: every live tensor as registered (DTensors included), the
        targets of a restore. With the cyclic collector paused: a container per tensor, none
        in a cycle (``collector_paused``).
        """
        with collector_paused():
            return self._capture(step, extra, plan)

    def _capture(self, step: int, extra: Mapping[str, Any] | None, plan: bool) -> Flat:
        flat = Flat()
        # The tree is the save's own: the engine may write it after training has changed the
        # objects (flatten builds new containers; user_meta is copied, and checked, here).
        tree: dict[str, Any] = {"step": step,
                                "user": _json_copy(self.user_meta, "user_meta") if self.user_meta else {}}
        tree["objects"] = {name: flatten(obj.state_dict(), f"objects/{name}", flat.tensors)
                           for name, obj in self.objects.items()}
        tree["rng"] = flatten(rng_state(), "rng", flat.tensors)
        if extra:
            tree["extra"] = flatten(dict(extra), "extra", flat.tensors)
        flat.meta = tree
        if plan:
            from .store.placement import plan as place
            p = place(flat.tensors, self.placement(), fingerprint=self.check_replicas)
            flat.tensors, flat.shared, flat.pieces, flat.fingerprints = p.tensors, p.shared, p.pieces, p.fingerprints
        return flat

    def restore(self, flat: Flat) -> dict[str, Any]:
        """Load every registered object; return the tree (step, user, extra)."""
        tree = flat.meta
        missing = set(self.objects) - set(tree["objects"])
        if missing:
            raise ConfigError(
                f"checkpoint has no state for {sorted(missing)} (it holds {sorted(tree['objects'])}); "
                "register the same objects under the same names as the run that saved it")
        for name, obj in self.objects.items():
            saved: Any = None
            try:
                saved = unflatten(tree["objects"][name], flat.tensors)
                obj.load_state_dict(saved)
            except ConfigError:
                raise  # the object's own verdict on this job's configuration (another seed, dataset)
            except CheckpointCorrupt as exc:  # hpcckpt's own objects: the saved state is damaged
                raise CheckpointCorrupt(f"cannot restore {name}: {exc}") from exc
            except Exception as exc:  # noqa: BLE001 - whatever a load_state_dict raises
                raise _refused(name, obj, saved, exc, tree.get("step")) from exc
        set_rng_state(unflatten(tree["rng"], flat.tensors))
        self.user_meta.update(tree.get("user", {}))
        return tree

    def background_safe(self) -> set[str]:
        """Names (and prefixes, ending in ``/``) of captured tensors that nothing but a
        registered ``optimizer.step()`` mutates: the registered optimizers' state, the
        parameters they hold, and the RNG states, which ``rng_state`` copies at every capture
        (nothing else holds those copies). A parameter no registered optimizer holds (stepped
        by an optimizer kept elsewhere, or frozen) is not: no step hook would hold back what
        changes it while a save still copies it, so it is copied inside ``save()``."""
        safe: set[str] = {"rng/"}
        stepped: set[int] = set()
        for name, obj in self.objects.items():
            if isinstance(obj, torch.optim.Optimizer):
                safe.add(f"objects/{name}/state/")
                stepped.update(id(p) for group in _param_groups(obj) for p in group.get("params", ()))
        for name, obj in self.objects.items():
            if isinstance(obj, torch.nn.Module):
                for pname, param in obj.named_parameters():
                    if id(param) in stepped:
                        safe.add(f"objects/{name}/{_escape(pname)}")
        return safe


def _param_groups(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The optimizer's parameter groups, or none where a wrapper cannot give them (it then
    protects nothing: its parameters are copied inside save())."""
    try:
        groups = optimizer.param_groups
    except Exception:  # noqa: BLE001 - a wrapper that skipped Optimizer.__init__
        return []
    return [g for g in groups if isinstance(g, dict)] if isinstance(groups, list) else []


# Where a wrapper keeps the optimizer it steps: Hugging Face Accelerate's AcceleratedOptimizer
# (``optimizer``), Lightning's LightningOptimizer (``_optimizer``), torch's
# PostLocalSGDOptimizer (``optim``).
_WRAPPED_OPTIMIZER = ("optimizer", "_optimizer", "optim")


def stepping_optimizer(obj: torch.optim.Optimizer, name: str) -> torch.optim.Optimizer:
    """The optimizer whose ``step()`` runs torch's step hooks: ``obj`` itself, or the one it wraps.

    Some wrappers subclass ``torch.optim.Optimizer`` without running its ``__init__`` and
    call the wrapped optimizer's ``step()`` from their own (Accelerate's
    ``AcceleratedOptimizer``): hooks cannot be registered on them, and the wrapped
    optimizer's hooks are the ones every step runs. ConfigError, naming the object and
    what to do, when no wrapped optimizer runs hooks either.
    """
    current: Any = obj
    for _ in range(4):
        if isinstance(getattr(current, "_optimizer_step_pre_hooks", None), dict):
            return current
        inner = next((getattr(current, a) for a in _WRAPPED_OPTIMIZER
                      if isinstance(getattr(current, a, None), torch.optim.Optimizer)), None)
        if inner is None or inner is current:
            break
        current = inner
    raise ConfigError(
        f"optimizer {name!r} ({type(obj).__module__}.{type(obj).__qualname__}) runs no torch step hooks and "
        "wraps no optimizer that does (hpcckpt needs them to know when step() may overwrite what a save "
        f"is still copying); register the optimizer it wraps as {name!r} instead, or use engine='sync'")


def _group_sizes(groups: Any) -> list[int] | None:
    """The parameter count of each saved parameter group, or None if they are not well formed."""
    if not isinstance(groups, (list, tuple)):
        return None
    sizes = []
    for g in groups:
        params = g.get("params") if isinstance(g, Mapping) else None
        if not isinstance(params, (list, tuple)):
            return None
        sizes.append(len(params))
    return sizes


def _refused(name: str, obj: Any, saved: Any, exc: BaseException, step: Any) -> ConfigError | StateRefused:
    """What a failed ``load_state_dict`` means: the user's code changed (ConfigError, what to do),
    or the checkpoint holds state the object refuses (StateRefused: damaged, unless every
    checkpoint is refused alike, which ``resume.load_newest`` tells)."""
    where = f"the checkpoint of step {step}" if step is not None else "the checkpoint"
    if isinstance(obj, torch.optim.Optimizer) and isinstance(saved, Mapping):
        now = [len(g["params"]) for g in obj.param_groups]
        then = _group_sizes(saved.get("param_groups"))
        if then is not None and now != then:  # well formed, another layout: the optimizer was built otherwise
            return ConfigError(
                f"cannot restore {name}: {where} has {len(then)} parameter group(s) of {then} parameters, "
                f"the optimizer now has {len(now)} of {now}. Build the optimizer as it was when the "
                "checkpoint was taken before register(): parameter groups added during training "
                "(progressive unfreezing) are added again first, with optimizer.add_param_group(...), "
                "in the same order; or start fresh in another directory")
    what = f"{type(exc).__name__}: {exc}".rstrip(" .\n\t")
    if len(what) > 300:
        what = what[:300] + "..."
    return StateRefused(
        f"cannot restore {name} ({type(obj).__name__}): {what}", key=f"{name}:{type(exc).__name__}",
        advice=(f"cannot restore {name} ({type(obj).__name__}) from {where}: {what}. Register an object built "
                "as in the run that saved it (same shapes, same structure), or start fresh in another directory"))


def init_dtensor_optimizer_state(optimizer: torch.optim.Optimizer) -> bool:
    """Create the state of a fresh optimizer over DTensor parameters; True if it did.

    One ``step()`` with zero gradients and learning rate 0 (parameters unchanged, as
    ``torch.distributed.checkpoint`` initialises state before loading into it): the
    state tensors then exist as DTensors sharded like their parameters, the targets
    a restore fills. Nothing happens to an optimizer that already has state, has
    gradients set, or has no DTensor parameter.
    """
    from .store.placement import _is_dtensor
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if optimizer.state or not any(_is_dtensor(p) for p in params) or any(p.grad is not None for p in params):
        return False
    name = type(optimizer).__name__
    if not all("lr" in g for g in optimizer.param_groups):
        raise ConfigError(f"cannot restore the state of {name} over DTensor parameters: it has no 'lr' to set "
                          "to 0 while its state is created; create the state yourself (one step) before "
                          "Checkpointer.register, or save it sharded another way")
    lrs = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
    try:
        for p in params:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
        optimizer.step(lambda: 0.0)
    except Exception as exc:
        optimizer.state.clear()
        raise ConfigError(f"cannot create the state of {name} over DTensor parameters before restoring it "
                          f"({type(exc).__name__}: {exc}); create it yourself (one step) before "
                          "Checkpointer.register") from None
    finally:
        for g, lr in zip(optimizer.param_groups, lrs):
            g["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
    return True
