"""``hpcckpt export DIR [--step S] --to FILE.safetensors|FILE.pt``: a full model for use elsewhere.

Assembles every tensor whole (the pieces of replicated and sharded tensors, from
whichever rank files hold them, each checksum verified) and writes one registered
object's state dict: safetensors for ``*.safetensors``, a plain ``torch.save`` dict of
tensors for ``*.pt``/``*.pth`` (loads with ``torch.load(..., weights_only=True)``).

The object is the first registered one whose state is a model's (names -> tensors;
optimizers, samplers and schedulers are not), or ``--object NAME``. A DDP
``module.`` prefix is stripped from the keys unless ``--keep-prefix``. The file is
written to a temporary name in the same directory and renamed into place.
"""
from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..fsio import replacing
from .common import add_json, directory, emit, human_bytes

SAFETENSORS = (".safetensors",)
TORCH = (".pt", ".pth")
DDP_PREFIX = "module."


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write a checkpoint's model as one safetensors or torch file",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", type=Path)
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest committed)")
    p.add_argument("--to", type=Path, required=True, metavar="FILE",
                   help="output file: *.safetensors, or *.pt / *.pth for a torch state dict")
    p.add_argument("--object", default=None, metavar="NAME",
                   help="registered object to export (default: the first model-like one)")
    p.add_argument("--keep-prefix", action="store_true",
                   help=f"keep a DDP {DDP_PREFIX!r} prefix on the keys (default: strip it)")
    p.add_argument("--force", action="store_true", help="replace FILE if it exists")
    add_json(p)
    p.set_defaults(func=run)


def _destination(to: Path, force: bool) -> tuple[Path, str]:
    """(path, "safetensors" | "torch"), checked before a byte is read."""
    from ..errors import ConfigError
    if to.is_dir():
        raise ConfigError(f"--to={to} is a directory; name a file in it, e.g. --to={to / 'model.safetensors'}")
    suffix = to.suffix.lower()
    if suffix in SAFETENSORS:
        kind = "safetensors"
    elif suffix in TORCH:
        kind = "torch"
    else:
        raise ConfigError(f"--to={to}: unknown suffix {to.suffix or '(none)'!r}; name the file *.safetensors "
                          "(safetensors) or *.pt / *.pth (a torch state dict)")
    parent = to.parent if str(to.parent) else Path(".")
    if not parent.is_dir():
        what = "is not a directory" if parent.exists() else "does not exist"
        raise ConfigError(f"--to={to}: its directory {parent} {what}; create it first (mkdir -p {parent}) "
                          "or pick another path")
    if (to.exists() or to.is_symlink()) and not force:
        raise ConfigError(f"--to={to} exists; pass --force to replace it, or pick another path")
    return to, kind


def _is_optimizer(tree: Any) -> bool:
    return isinstance(tree, dict) and "param_groups" in tree and "state" in tree


def _tensor_leaves(tree: Any) -> bool:
    """A model-like state in the metadata tree: a non-empty flat mapping of names to tensors."""
    return (isinstance(tree, dict) and bool(tree) and not any(k.startswith("__") for k in tree)
            and all(isinstance(v, dict) and isinstance(v.get("__tensor__"), str) for v in tree.values()))


def choose_object(objects: Mapping[str, Any], wanted: str | None, where: str) -> str:
    """The registered object to export; ConfigError naming the objects there are."""
    from ..errors import ConfigError
    held = ", ".join(objects) or "none"
    if wanted is not None:
        if wanted not in objects:
            raise ConfigError(f"{where} has no registered object {wanted!r} (it holds: {held}); "
                              "pick one of those with --object")
        return wanted
    for name, tree in objects.items():
        if not _is_optimizer(tree) and _tensor_leaves(tree):
            return name
    raise ConfigError(f"{where} holds no model-like object (a state of names -> tensors) among: {held}; "
                      "pick one with --object NAME")


def state_tensors(state: Any, name: str, keep_prefix: bool) -> dict[str, Any]:
    """The object's state as a flat dict of tensors (dotted keys for nested mappings)."""
    import torch

    from ..errors import ConfigError
    out: dict[str, torch.Tensor] = {}

    def walk(obj: Any, prefix: str) -> None:
        if isinstance(obj, torch.Tensor):
            out[prefix] = obj
        elif isinstance(obj, Mapping) and obj:
            for k, v in obj.items():
                walk(v, f"{prefix}.{k}" if prefix else str(k))
        elif isinstance(obj, Mapping):
            raise ConfigError(f"object {name!r} holds no tensors" + (f" at {prefix!r}" if prefix else "") +
                              "; export writes tensors only: pick a model with --object NAME")
        else:
            raise ConfigError(f"object {name!r} holds a value of type {type(obj).__name__} at {prefix!r}, not a "
                              "tensor; export writes tensors only: pick a model with --object NAME")

    try:
        walk(state, "")
    except ConfigError as exc:
        raise ConfigError(f"{exc} (an optimizer, sampler or scheduler has no weights to export)") from None
    if not keep_prefix and out and all(k.startswith(DDP_PREFIX) for k in out):
        out = {k[len(DDP_PREFIX):]: v for k, v in out.items()}
    return out


def _own(t: Any) -> Any:
    """A contiguous tensor that owns exactly its bytes (no view of a larger read buffer)."""
    t = t.detach()
    if not t.is_contiguous() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.contiguous().clone()
    return t


def _write(path: Path, kind: str, tensors: Mapping[str, Any], metadata: dict[str, str]) -> None:
    """Write to a temporary file next to ``path``, fsync, rename over it (``fsio.replacing``):
    a file as the user's others are (0666 less the umask); the directory's fsync is best
    effort (a directory the user may write in but not read)."""
    from ..errors import ConfigError
    with replacing(path, mode=0o666, strict=False) as tmp:
        if kind == "safetensors":
            from safetensors.torch import save_file
            try:
                save_file(dict(tensors), tmp, metadata=metadata)
            except (ValueError, TypeError, RuntimeError) as exc:
                raise ConfigError(f"--to={path}: safetensors cannot hold this state ({exc}); "
                                  "export it as a torch state dict instead (--to FILE.pt)") from None
        else:
            import torch
            torch.save(dict(tensors), tmp)


def _load(root: Path, step: int | None) -> tuple[Any, Any]:
    """(info, Flat) of the whole state, every shared tensor assembled and every piece verified."""
    from ..errors import CheckpointCorrupt, NoCheckpoint
    from ..store import catalog
    from ..store.read import load_rank
    from .inspect import _info
    for _attempt in range(50):
        info = _info(root, step)
        if info.manifest is None or info.status != "committed":
            problems = "; ".join(info.problems or [info.status])
            raise CheckpointCorrupt(f"step {info.step} at {info.path} is {info.status} ({problems}); "
                                    "export another step with --step S (hpcckpt ls DIR lists them)")
        try:
            return info, load_rank(info, 0, 1)
        except (CheckpointCorrupt, OSError) as exc:
            if catalog.vanished(info):
                if step is None:
                    continue  # pruned while read: the newest is another one now
                raise NoCheckpoint(f"checkpoint step {step} under {root} was removed (retention) while "
                                   "being read; export a newer step") from None
            text = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            where = f" ({exc.filename})" if isinstance(exc, OSError) and exc.filename else ""
            raise CheckpointCorrupt(f"step {info.step} at {info.path} cannot be exported: {text}{where}; "
                                    "run hpcckpt verify DIR --step S for every damaged tensor, and export "
                                    "another step with --step S") from None
    raise NoCheckpoint(f"checkpoints under {root} kept being removed while read (another job is pruning it)")


def run(args: argparse.Namespace) -> int:
    from ..state import unflatten
    root = directory(args.dir, option="DIR")
    dest, kind = _destination(args.to, args.force)
    info, flat = _load(root, args.step)
    objects = (flat.meta or {}).get("objects") or {}
    where = f"checkpoint step {info.step} at {info.path}"
    name = choose_object(objects, args.object, where)
    tensors = {k: _own(v) for k, v in state_tensors(unflatten(objects[name], flat.tensors), name,
                                                    args.keep_prefix).items()}
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    _write(dest, kind, tensors, {"format": "pt", "hpcckpt_step": str(info.step), "hpcckpt_object": name})
    emit(args, {"path": str(dest), "format": kind, "step": info.step, "checkpoint": str(info.path),
                "object": name, "tensors": len(tensors), "bytes": nbytes},
         f"exported {name!r} of step {info.step} ({len(tensors)} tensors, {human_bytes(nbytes)}) to {dest} ({kind})")
    return 0
