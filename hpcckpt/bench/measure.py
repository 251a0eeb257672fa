"""Per-engine figures at one state size: visible stall, durable persist, cold load.

One checkpoint's life as training sees it (both engines, same loop)::

    forward/backward -> save() -> forward/backward -> optimizer.step() -> (wait durable)

``stall_s`` is the time training is blocked: all of ``save()`` for the sync engine;
``save()`` plus the optimizer pre-hook's wait for the concurrent one (its copy
overlaps the second forward/backward). ``persist_s`` runs from ``save()`` to the
committed, fsynced checkpoint. A first, unmeasured save sets up staging.
"""
from __future__ import annotations

import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from ..engines import SaveContext, load_rank, make_engine
from ..ranks import Ranks
from ..store import catalog
from .limits import GB, drop_caches
from .synthetic import SyntheticRig


def _engine(name: str, root: Path, options: dict[str, Any]) -> Any:
    ctx = SaveContext(root=root, keep=1, job={}, user={})
    return make_engine(name, ctx, Ranks(), **(options if name == "concurrent" else {}))


def _one_checkpoint(engine: Any, rig: SyntheticRig, step: int) -> tuple[float, float]:
    """(stall_s, persist_s) of one checkpoint in the loop described above."""
    rig.forward_backward()
    stats = getattr(engine, "stats", None)
    hook_before = stats.hook_wait_s if stats else 0.0
    t0 = time.perf_counter()
    handle = engine.save(rig.state.capture(step=step), step)
    call_s = time.perf_counter() - t0
    rig.forward_backward()
    rig.opt.step()  # the concurrent engine's pre-hook blocks here until its copy is done
    handle.wait()
    hook_s = (stats.hook_wait_s - hook_before) if stats else 0.0
    return call_s + hook_s, float(handle.save_s or call_s)


def measure_engine(name: str, rig: SyntheticRig, root: Path, *, repeats: int,
                   options: dict[str, Any]) -> dict[str, Any]:
    shutil.rmtree(root, ignore_errors=True)
    engine = _engine(name, root, options)
    engine.bind(rig.state)
    nbytes = rig.state_bytes
    try:
        _one_checkpoint(engine, rig, 1)
        stalls, persists = [], []
        for i in range(repeats):
            stall, persist = _one_checkpoint(engine, rig, 2 + i)
            stalls.append(stall)
            persists.append(persist)
    finally:
        engine.close()
    out: dict[str, Any] = {
        "stall_s": statistics.median(stalls), "persist_s": statistics.median(persists),
        "stall_all_s": stalls, "persist_all_s": persists,
    }
    out["persist_gbps"] = nbytes / out["persist_s"] / GB
    out.update(measure_load(root, nbytes))
    shutil.rmtree(root, ignore_errors=True)
    return out


def measure_load(root: Path, nbytes: int) -> dict[str, Any]:
    """Cold-cache load of the newest checkpoint (read + per-tensor crc32c verify)."""
    info = catalog.find(root, None)
    method = drop_caches([info.path])
    t0 = time.perf_counter()
    flat = load_rank(info, 0, 1)
    load_s = time.perf_counter() - t0
    del flat
    out: dict[str, Any] = {"load_s": load_s, "load_gbps": nbytes / load_s / GB, "cold_cache": method}
    manifest = info.manifest or {}
    if manifest.get("ranks", {}).get("0", {}).get("format") == "torch":
        path = info.path / manifest["ranks"]["0"]["file"]
        drop_caches([path])
        t0 = time.perf_counter()
        data = torch.load(path, map_location="cpu", weights_only=True)
        out["torch_load_s"] = time.perf_counter() - t0
        del data
    return out
