"""Per-engine figures at one state size: visible stall, durable persist, cold load.

One checkpoint's life as training sees it (both engines, same loop)::

    forward/backward -> save() -> forward/backward -> optimizer.step() -> (wait durable)

``stall_s`` is the time training is blocked: all of ``save()`` for the sync engine;
``save()`` plus the optimizer pre-hook's wait for the concurrent one (its copy
overlaps the second forward/backward). ``persist_s`` runs from ``save()`` to the
committed, fsynced checkpoint. A first, unmeasured save sets up staging.
Loads are measured afterwards, all engines interleaved (``measure_loads``).
"""
from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ..engines import SaveContext, make_engine
from ..errors import HpcckptError
from ..ranks import Ranks
from ..store import catalog
from .limits import GB, direct_write_bps, drop_caches, parallel_read_bps
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
    """Stall and persist figures; the newest checkpoint stays in ``root`` for ``measure_loads``."""
    shutil.rmtree(root, ignore_errors=True)
    engine = _engine(name, root, options)
    engine.bind(rig.state)
    nbytes = rig.state_bytes
    raw_file = root.parent / f"raw-write-{name}.bin"
    try:
        _one_checkpoint(engine, rig, 1)
        stalls, persists, raws = [], [], []
        for i in range(repeats):
            # The disk's own speed right before this checkpoint: dd O_DIRECT + fsync of the same bytes.
            raws.append(nbytes / direct_write_bps(raw_file, nbytes))
            raw_file.unlink()
            stall, persist = _one_checkpoint(engine, rig, 2 + i)
            stalls.append(stall)
            persists.append(persist)
    finally:
        engine.close()
        raw_file.unlink(missing_ok=True)
    out: dict[str, Any] = {
        "stall_s": statistics.median(stalls), "persist_s": statistics.median(persists),
        "stall_all_s": stalls, "persist_all_s": persists, "raw_write_all_s": raws,
        "raw_write_gbps": nbytes / statistics.median(raws) / GB,
        # paired: each checkpoint against the raw write just before it
        "persist_vs_raw_write": statistics.median(r / p for r, p in zip(raws, persists)),
    }
    out["persist_gbps"] = nbytes / out["persist_s"] / GB
    return out


def _rank_file(info: catalog.CheckpointInfo) -> tuple[Path, str]:
    rec = (info.manifest or {})["ranks"]["0"]
    return info.path / rec["file"], str(rec["format"])


def _timed_in_fresh_process(kind: str, *args: object) -> float:
    """Seconds of one load in a new interpreter (``hpcckpt.bench.loadproc``)."""
    out = subprocess.run([sys.executable, "-m", "hpcckpt.bench.loadproc", kind, *map(str, args)],
                         capture_output=True, text=True, timeout=600, check=False)
    if out.returncode != 0:
        raise HpcckptError(f"bench: {kind} load of {' '.join(map(str, args))} failed ({out.returncode}): {out.stderr.strip()[-500:]}")
    return float(json.loads(out.stdout.strip().splitlines()[-1])["load_s"])


def measure_loads(roots: dict[str, Path], nbytes: int, *, rounds: int, rig_bytes: int) -> dict[str, dict[str, Any]]:
    """Cold-cache loads of each engine's newest checkpoint (read + crc32c verify).

    Round by round, each load runs next to a raw parallel O_DIRECT read of the very
    same file; every run starts from a dropped cache and each load runs in a fresh
    process (``hpcckpt.bench.loadproc``). ``load_s`` is a resume: the model and
    optimizer are built as a requeued job builds them (``SyntheticRig(rig_bytes)``,
    no Adam moments yet), then restored; ``load_fresh_s`` reads into new tensors with
    no model at all; ``torch_load_s`` (torch archives) is ``torch.load`` +
    ``load_state_dict`` into a freshly built model. Ratios are taken within a round
    (runs seconds apart on the same bytes), then the median over rounds, because
    this disk's speed drifts by 2x from minute to minute. Keys per engine:
    ``load_s``/``load_gbps`` (medians), ``load_fresh_s``, ``raw_read_gbps``,
    ``load_vs_raw_read``, ``raw_read_fresh_vs_raw_read`` (the raw read into new memory,
    in a fresh process), ``torch_load_s``, the ``*_all_s`` samples, ``cold_cache``.
    """
    infos = {name: catalog.find(root, None) for name, root in roots.items()}
    kinds = ("load", "fresh", "raw", "raw_fresh", "torch_load")
    samples: dict[str, dict[str, list[float]]] = {n: {k: [] for k in kinds} for n in infos}
    method = ""
    for _ in range(max(1, rounds)):
        for name, info in infos.items():
            path, fmt = _rank_file(info)
            got = samples[name]
            method = drop_caches([path])
            got["raw"].append(path.stat().st_size / parallel_read_bps(path))
            drop_caches([path])
            got["load"].append(_timed_in_fresh_process("resume", roots[name], info.step, rig_bytes))
            drop_caches([path])
            got["fresh"].append(_timed_in_fresh_process("fresh", roots[name], info.step))
            drop_caches([path])
            got["raw_fresh"].append(_timed_in_fresh_process("rawfresh", path))
            if fmt == "torch":
                drop_caches([path])
                got["torch_load"].append(_timed_in_fresh_process("torch", path, roots[name], info.step, rig_bytes))
    out: dict[str, dict[str, Any]] = {}
    for name, got in samples.items():
        load_s = statistics.median(got["load"])
        raw_s = statistics.median(got["raw"])
        e: dict[str, Any] = {
            "load_s": load_s, "load_gbps": nbytes / load_s / GB, "raw_read_gbps": nbytes / raw_s / GB,
            "load_vs_raw_read": statistics.median(r / l for r, l in zip(got["raw"], got["load"])),
            "load_fresh_s": statistics.median(got["fresh"]),
            "load_fresh_vs_raw_read": statistics.median(r / f for r, f in zip(got["raw"], got["fresh"])),
            # the same raw read with its bytes landing in new memory, as a load's new tensors do
            "raw_read_fresh_vs_raw_read": statistics.median(r / f for r, f in zip(got["raw"], got["raw_fresh"])),
            "load_fresh_vs_raw_read_fresh": statistics.median(rf / f for rf, f in zip(got["raw_fresh"], got["fresh"])),
            "raw_read_fresh_all_s": got["raw_fresh"],
            "load_all_s": got["load"], "load_fresh_all_s": got["fresh"], "raw_read_all_s": got["raw"],
            "cold_cache": method,
        }
        if got["torch_load"]:
            e["torch_load_s"] = statistics.median(got["torch_load"])
            e["torch_load_all_s"] = got["torch_load"]
        out[name] = e
    return out
