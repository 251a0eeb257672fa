"""torch.distributed.checkpoint (DCP) checkpoints in and out of hpcckpt.

In: ``adopt(ckpt, DIR)`` in a job that registered its objects and found no hpcckpt
checkpoint: the DCP checkpoint a run wrote with ``dcp.save`` is read into the live objects
by DCP's own reader (any mesh, any placement: DCP reshards), and the Checkpointer goes on
from its step; its first save makes it an hpcckpt checkpoint. ``load`` is the same
without a Checkpointer.

Out: ``export(DIR, OUT)`` (or ``python -m hpcckpt.interop.dcp export DIR OUT``), in one
process without a process group: every tensor of an hpcckpt checkpoint assembled whole
(each piece's checksum verified, as ``hpcckpt export`` does), written as a DCP directory
``{object name: its state_dict, "step": S}`` that ``dcp.load``,
``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` and tools built on them
read.

The layout DCP users write, and ``adopt`` expects: one top-level key per object, the
model's state dict as ``get_state_dict``/``get_model_state_dict`` give it, the
optimizer's as ``get_optimizer_state_dict`` gives it (keyed by parameter name), and the
step under ``"step"``. ``keys`` maps a registered name to another top-level key
(``{"optimizer": "optim"}``).
"""
from __future__ import annotations

import argparse
import logging
import re
import sys
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..errors import ConfigError

if TYPE_CHECKING:
    from ..api import Checkpointer

log = logging.getLogger("hpcckpt")

STEP_KEY = "step"
_STEP_IN_NAME = re.compile(r"(\d+)$")


def _top_keys(path: Path) -> set[str]:
    """The top-level keys of a DCP checkpoint (its metadata's flattened names, before the first dot)."""
    from torch.distributed.checkpoint import FileSystemReader
    try:
        md = FileSystemReader(str(path)).read_metadata()
    except (OSError, ValueError, RuntimeError) as exc:
        raise ConfigError(f"{path} is not a readable torch.distributed.checkpoint directory ({exc}); "
                          "name the directory dcp.save wrote (it holds a .metadata file)") from None
    return {k.split(".", 1)[0] for k in md.state_dict_metadata}


def _model_of(opt: torch.optim.Optimizer, modules: Mapping[str, torch.nn.Module], name: str) -> torch.nn.Module:
    params = {id(p) for g in opt.param_groups for p in g["params"]}
    for module in modules.values():
        if params <= {id(p) for p in module.parameters()}:
            return module
    raise ConfigError(f"optimizer {name!r}: no registered model holds all of its parameters; DCP keys an "
                      "optimizer's state by parameter name, so register the model it trains too")


def load(path: str | Path, objects: Mapping[str, Any], *, keys: Mapping[str, str] | None = None,
         step_key: str = STEP_KEY) -> int | None:
    """Read a DCP checkpoint into live ``objects`` (name -> model, optimizer, or any object with
    ``state_dict``/``load_state_dict``); return its step (None when it holds no ``step_key``).

    Collective: every rank calls it, with its objects as the job places them now; DCP's
    reader reshards. A model or optimizer the checkpoint has no key for is a
    ConfigError; any other object it has no key for keeps its state (a warning says so).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    path = Path(path)
    keys = dict(keys or {})
    top = _top_keys(path)
    modules = {n: o for n, o in objects.items() if isinstance(o, torch.nn.Module)}
    sd: dict[str, Any] = {}
    plan: list[tuple[str, str, Any]] = []
    for name, obj in objects.items():
        key = keys.get(name, name)
        if key not in top:
            if isinstance(obj, (torch.nn.Module, torch.optim.Optimizer)):
                raise ConfigError(f"the DCP checkpoint {path} has no {key!r} for {name!r} (it holds "
                                  f"{', '.join(sorted(top))}); map the name with keys={{{name!r}: 'KEY'}}")
            log.warning("hpcckpt: the DCP checkpoint %s has no %r: %s keeps its state", path, key, name)
            continue
        if isinstance(obj, torch.nn.Module):
            sd[key] = get_model_state_dict(obj)
        elif isinstance(obj, torch.optim.Optimizer):
            sd[key] = get_optimizer_state_dict(_model_of(obj, modules, name), obj)
        else:
            sd[key] = obj.state_dict()
        plan.append((name, key, obj))
    if step_key in top:
        sd[step_key] = 0
    dcp.load(sd, checkpoint_id=str(path))
    for name, key, obj in plan:
        if isinstance(obj, torch.nn.Module):
            set_model_state_dict(obj, sd[key])
        elif isinstance(obj, torch.optim.Optimizer):
            set_optimizer_state_dict(_model_of(obj, modules, name), obj, sd[key])
        else:
            obj.load_state_dict(sd[key])
    if step_key not in top:
        return None
    step = sd[step_key]
    return int(step.item() if isinstance(step, torch.Tensor) else step)


def adopt(ckpt: Checkpointer, path: str | Path, *, keys: Mapping[str, str] | None = None, step: int | None = None,
          step_key: str = STEP_KEY) -> int | None:
    """Resume a Checkpointer's registered objects from a DCP checkpoint when it restored none of its own.

    Call it after ``ckpt.register(...)`` and before the training loop, on every rank.
    Returns the step training goes on from (``step``, else the checkpoint's ``step_key``,
    else the number that ends the directory's name, as in ``step-1000``), or None when
    ``ckpt`` resumed from an hpcckpt checkpoint (newer than the DCP one: it wins, and
    the DCP checkpoint is not read). What DCP did not save (RNG states, the data order)
    starts afresh.
    """
    if ckpt.resumed_from is not None:
        return None
    if getattr(ckpt, "_started", False):
        raise ConfigError("adopt() a DCP checkpoint before the training loop starts (after register(), "
                          "before ckpt.loop/steps/batches)")
    path = Path(path)
    found = load(path, dict(ckpt.state.objects), keys=keys, step_key=step_key)
    if step is None:
        step = found
    if step is None:
        m = _STEP_IN_NAME.search(path.name)
        step = int(m.group(1)) if m else 0
    ckpt.step = int(step)
    log.warning("hpcckpt: resumed from the torch.distributed.checkpoint %s at step %d", path, step)
    return int(step)


def export(root: str | Path, out: str | Path, *, step: int | None = None) -> dict[str, Any]:
    """Write an hpcckpt checkpoint (the newest committed one under ``root``, or ``step``) as a
    DCP directory ``out``: ``{object name: state_dict, "step": S}``, every tensor whole.

    One process, no process group; the whole state is held in memory once. The ranks'
    own state (RNG states, the loop's progress) is not exported. Returns what was written.
    """
    import torch.distributed.checkpoint as dcp

    from ..cli.export import _load
    from ..data import Progress
    from ..state import unflatten
    root, out = Path(root), Path(out)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"{out} exists and is not empty; name a new directory for the DCP checkpoint")
    info, flat = _load(root, step)
    objects = (flat.meta or {}).get("objects") or {}
    sd: dict[str, Any] = {name: unflatten(tree, flat.tensors) for name, tree in objects.items()
                          if name != Progress.NAME}
    sd[STEP_KEY] = int(info.step)
    out.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():  # one process on purpose: DCP's note that it assumes so
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(out)), no_dist=True)
    nbytes = sum(t.numel() * t.element_size() for t in flat.tensors.values())
    return {"path": str(out), "step": info.step, "checkpoint": str(info.path),
            "objects": sorted(n for n in sd if n != STEP_KEY), "bytes": nbytes}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hpcckpt.interop.dcp",
                                description="Convert between hpcckpt and torch.distributed.checkpoint.")
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export", help="write an hpcckpt checkpoint as a DCP directory")
    e.add_argument("dir", type=Path, help="the hpcckpt checkpoint directory (the one holding step-*/)")
    e.add_argument("out", type=Path, help="a new directory for the DCP checkpoint")
    e.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest committed)")
    a = p.parse_args(argv)
    try:
        got = export(a.dir, a.out, step=a.step)
    except ConfigError as exc:
        print(f"hpcckpt: {exc}", file=sys.stderr)
        return 2
    print(f"exported step {got['step']} ({', '.join(got['objects'])}) to {got['path']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
