"""Per-engine figures at one state size: visible stall, snapshot, durable persist, cold load.

One checkpoint's life as training sees it (both engines, same loop)::

    forward/backward -> save() -> forward/backward -> optimizer.step() -> (wait durable)

``stall_s`` is the time training is blocked. On the CPU: all of ``save()`` for the
sync engine; ``save()`` plus the optimizer pre-hook's wait for the concurrent one
(its copy overlaps the second forward/backward). On CUDA the pre-hook makes the GPU,
not the host, wait for the device-to-host copy, so the stall is taken as the step
sees it: the wall time of ``save(); forward/backward; optimizer.step()`` (device
synchronised) minus the same step without a save, measured just before (and never
less than the host's own wait). ``persist_s`` runs from ``save()`` to the committed,
fsynced checkpoint. The first save (staging set up) is reported apart
(``first_stall_s``). ``snapshot_s``: from ``save()`` until the state is copied off
the device (CUDA) or out of the live tensors (CPU), timed alone in one extra save.
Loads are measured afterwards, all engines interleaved (``measure_loads``).
"""
from __future__ import annotations

import dataclasses
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from ..config import ConcurrentOptions, engine_options
from ..engines import SaveContext, make_engine
from ..ranks import Ranks
from ..store import catalog
from ..store.names import TORCH
from .limits import GB, drop_caches, parallel_read_bps, parallel_write_bps
from .synthetic import SyntheticRig

STAGING_FRACTIONS = (1.0, 0.5, 0.25)


def supports_staging_budget() -> bool:
    """Whether the concurrent engine takes ``staging_bytes`` (a ring smaller than the state)."""
    return "staging_bytes" in {f.name for f in dataclasses.fields(ConcurrentOptions)}


def _engine(name: str, root: Path, options: dict[str, Any], rig: SyntheticRig) -> Any:
    """The engine bound to the rig, with its staging prepared as a training loop would
    have it by its first save: the concurrent engine lays staging out on a background
    thread once the state's shapes are known, while a real loop keeps training; the rig
    saves at once, so it waits for that here (the time is reported as ``prepare_s``)."""
    ctx = SaveContext(root=root, keep=1, job={}, user={})
    engine = make_engine(name, ctx, Ranks(), engine_options(**options) if name == "concurrent" else None)
    engine.bind(rig.state)
    if hasattr(engine, "wait_prepared"):
        engine.wait_prepared()
    return engine


def _plain_step_s(rig: SyntheticRig) -> float:
    """One forward/backward + optimizer step with nothing saved (device synchronised)."""
    rig.sync()
    t0 = time.perf_counter()
    rig.forward_backward()
    rig.opt.step()
    rig.sync()
    return time.perf_counter() - t0


def _one_checkpoint(engine: Any, rig: SyntheticRig, step: int) -> dict[str, float]:
    """Stall, save call, pre-hook wait and persist of one checkpoint in the loop above."""
    base_s = _plain_step_s(rig) if rig.device == "cuda" else 0.0
    rig.forward_backward()
    stats = getattr(engine, "stats", None)
    hook_before = float(getattr(stats, "hook_wait_s", 0.0))
    rig.sync()
    t0 = time.perf_counter()
    handle = engine.save(rig.state.capture(step=step), step)
    call_s = time.perf_counter() - t0
    rig.forward_backward()
    rig.opt.step()  # the concurrent engine's pre-hook blocks here (CPU) or orders the GPU (CUDA)
    rig.sync()
    step_s = time.perf_counter() - t0
    handle.wait()
    hook_s = float(getattr(stats, "hook_wait_s", 0.0)) - hook_before
    host_stall = call_s + hook_s
    stall = max(host_stall, step_s - base_s) if rig.device == "cuda" else host_stall
    return {"stall_s": stall, "call_s": call_s, "hook_s": hook_s, "persist_s": float(handle.save_s or call_s)}


def _snapshot_probe(engine: Any, rig: SyntheticRig, step: int) -> dict[str, Any]:
    """One save timed until the state is copied off the live tensors, nothing overlapping it.

    The engine's own D2H figures (``stats.d2h_bytes``/``d2h_s``, CUDA events on its copy
    stream) are preferred where it keeps them; otherwise the copy is timed from here
    (save() to device synchronised, or to ``wait_copied()`` on the CPU): an upper bound.
    """
    stats = getattr(engine, "stats", None)
    d2h_b0, d2h_s0 = int(getattr(stats, "d2h_bytes", 0)), float(getattr(stats, "d2h_s", 0.0))
    rig.forward_backward()
    rig.sync()
    t0 = time.perf_counter()
    handle = engine.save(rig.state.capture(step=step), step)
    if rig.device == "cuda":
        rig.sync()
    elif hasattr(engine, "wait_copied"):
        engine.wait_copied()
    snap_s = time.perf_counter() - t0
    handle.wait()
    nbytes = rig.device_bytes if rig.device == "cuda" else rig.state_bytes
    out: dict[str, Any] = {"snapshot_s": snap_s, "snapshot_gbps": nbytes / snap_s / GB, "snapshot_source": "outside"}
    d2h_b, d2h_s = int(getattr(stats, "d2h_bytes", 0)) - d2h_b0, float(getattr(stats, "d2h_s", 0.0)) - d2h_s0
    if d2h_b > 0 and d2h_s > 0:
        out.update(snapshot_s=d2h_s, snapshot_gbps=d2h_b / d2h_s / GB, snapshot_source="engine d2h stats")
    return out


def measure_engine(name: str, rig: SyntheticRig, root: Path, *, repeats: int, options: dict[str, Any],
                   probe: bool = True) -> dict[str, Any]:
    """Stall, snapshot and persist figures; the newest checkpoint stays in ``root`` for ``measure_loads``."""
    shutil.rmtree(root, ignore_errors=True)
    engine = _engine(name, root, options, rig)
    nbytes = rig.state_bytes
    raw_file = root.parent / f"raw-write-{name}.bin"
    try:
        first = _one_checkpoint(engine, rig, 1)
        runs, raws = [], []
        for i in range(repeats):
            # The disk's own speed right before this checkpoint: a raw parallel O_DIRECT write of the same bytes.
            raws.append(nbytes / parallel_write_bps(raw_file, nbytes))
            raw_file.unlink()
            runs.append(_one_checkpoint(engine, rig, 2 + i))
        snap = _snapshot_probe(engine, rig, 2 + repeats) if probe and name == "concurrent" else {}
        first_call = getattr(getattr(engine, "stats", None), "first_save_call_s", None)
        prepare_s = getattr(getattr(engine, "stats", None), "prepare_s", None)
    finally:
        engine.close()
        raw_file.unlink(missing_ok=True)
    stalls, persists = [r["stall_s"] for r in runs], [r["persist_s"] for r in runs]
    out: dict[str, Any] = {
        "stall_s": statistics.median(stalls), "persist_s": statistics.median(persists),
        "save_call_s": statistics.median(r["call_s"] for r in runs),
        "hook_wait_s": statistics.median(r["hook_s"] for r in runs),
        "first_stall_s": first["stall_s"], "first_save_call_s": float(first_call or first["call_s"]),
        "stall_all_s": stalls, "persist_all_s": persists, "raw_write_all_s": raws,
        "raw_write_gbps": nbytes / statistics.median(raws) / GB,
        # paired: each checkpoint against the raw write just before it
        "persist_vs_raw_write": statistics.median(r / p for r, p in zip(raws, persists)),
        **snap,
    }
    if prepare_s is not None:
        out["prepare_s"] = float(prepare_s)
    # What issue figures compare: the first save() call (staging allocated and pinned on the
    # step path unless prepared) against a steady one; the stall ratio too, as seen by the step
    # (one first sample against a median, so noisier when the steady stall is milliseconds).
    out["first_vs_steady"] = out["first_save_call_s"] / max(out["save_call_s"], 1e-9)
    out["first_stall_vs_steady"] = out["first_stall_s"] / max(out["stall_s"], 1e-9)
    out["persist_gbps"] = nbytes / out["persist_s"] / GB
    return out


def measure_staging(rig: SyntheticRig, root: Path, *, repeats: int, options: dict[str, Any],
                    fractions: tuple[float, ...] = STAGING_FRACTIONS) -> dict[str, Any]:
    """The concurrent engine's stall with staging at ``fractions`` of the state, when it takes a budget."""
    if not supports_staging_budget():
        return {"supported": False, "why": "this concurrent engine takes no staging_bytes option"}
    nbytes = rig.state_bytes
    out: dict[str, Any] = {"supported": True, "fractions": {}}
    for frac in fractions:
        budget = int(nbytes * frac)
        shutil.rmtree(root, ignore_errors=True)
        engine = _engine("concurrent", root, {**options, "staging_bytes": budget}, rig)
        try:
            first = _one_checkpoint(engine, rig, 1)
            runs = [_one_checkpoint(engine, rig, 2 + i) for i in range(max(1, repeats))]
            stats = getattr(engine, "stats", None)
            shape = {k: getattr(stats, k) for k in ("ring_chunks", "ring_chunk_bytes", "staging_pinned")
                     if hasattr(stats, k)}
        finally:
            engine.close()
            shutil.rmtree(root, ignore_errors=True)
        out["fractions"][str(frac)] = {
            **shape, "staging_bytes": budget, "first_stall_s": first["stall_s"],
            "stall_s": statistics.median(r["stall_s"] for r in runs),
            "persist_s": statistics.median(r["persist_s"] for r in runs),
        }
    return out


def _rank_file(info: catalog.CheckpointInfo) -> tuple[Path, str]:
    rec = (info.manifest or {})["ranks"]["0"]
    return info.path / rec["file"], str(rec["format"])


def _timed_in_fresh_process(kind: str, *args: object, held: list[float] | None = None,
                            nbytes: int = 0) -> float:
    """Seconds of one load in a fresh process (``loadproc.child_load`` in a child forked from
    the bench's preloaded forkserver); ``held`` receives its peak RSS beyond its start per
    byte of state."""
    from .isolate import held_vs_state, run_isolated
    from .loadproc import child_load
    got = run_isolated(child_load, [kind, *map(str, args)], timeout_s=600)
    if held is not None:
        held.append(held_vs_state(got["rss"], nbytes))
    return float(got["load_s"])


def measure_loads(roots: dict[str, Path], nbytes: int, *, rounds: int, rig_bytes: int,
                  device: str = "cpu") -> dict[str, dict[str, Any]]:
    """Cold-cache loads of each engine's newest checkpoint (read + crc32c verify).

    Round by round, each load runs next to a raw parallel O_DIRECT read of the very
    same file; every run starts from a dropped cache and each load runs in a fresh
    process (``hpcckpt.bench.loadproc``). ``load_s`` is a resume onto ``device``: the model and
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
    kinds = ("load", "fresh", "raw", "raw_fresh", "torch_load", "load_held", "torch_load_held")
    samples: dict[str, dict[str, list[float]]] = {n: {k: [] for k in kinds} for n in infos}
    method = ""
    for _ in range(max(1, rounds)):
        for name, info in infos.items():
            method = _load_round(samples[name], roots[name], info, nbytes, rig_bytes, device)
    return {name: _load_figures(got, nbytes, method) for name, got in samples.items()}


def _load_round(got: dict[str, list[float]], root: Path, info: catalog.CheckpointInfo, nbytes: int,
                rig_bytes: int, device: str) -> str:
    """One round of ``measure_loads`` for one engine's checkpoint, each run from a dropped
    cache, appended to ``got``; returns how the cache was dropped."""
    path, fmt = _rank_file(info)
    method = drop_caches([path])
    got["raw"].append(path.stat().st_size / parallel_read_bps(path))
    drop_caches([path])
    got["load"].append(_timed_in_fresh_process("resume", root, info.step, rig_bytes, device,
                                               held=got["load_held"], nbytes=nbytes))
    drop_caches([path])
    got["fresh"].append(_timed_in_fresh_process("fresh", root, info.step))
    drop_caches([path])
    got["raw_fresh"].append(_timed_in_fresh_process("rawfresh", path))
    if fmt == TORCH:
        drop_caches([path])
        got["torch_load"].append(_timed_in_fresh_process("torch", path, root, info.step, rig_bytes,
                                                         device, held=got["torch_load_held"], nbytes=nbytes))
    return method


def _load_figures(got: dict[str, list[float]], nbytes: int, method: str) -> dict[str, Any]:
    """One engine's ``measure_loads`` figures: medians and ratios taken within a round."""
    load_s = statistics.median(got["load"])
    raw_s = statistics.median(got["raw"])
    e: dict[str, Any] = {
        "load_s": load_s, "load_gbps": nbytes / load_s / GB, "raw_read_gbps": nbytes / raw_s / GB,
        "load_vs_raw_read": statistics.median(raw / load for raw, load in zip(got["raw"], got["load"])),
        "load_fresh_s": statistics.median(got["fresh"]),
        "load_fresh_vs_raw_read": statistics.median(r / f for r, f in zip(got["raw"], got["fresh"])),
        # the same raw read with its bytes landing in new memory, as a load's new tensors do
        "raw_read_fresh_vs_raw_read": statistics.median(r / f for r, f in zip(got["raw"], got["raw_fresh"])),
        "load_fresh_vs_raw_read_fresh": statistics.median(rf / f for rf, f in zip(got["raw_fresh"], got["fresh"])),
        "raw_read_fresh_all_s": got["raw_fresh"],
        "load_all_s": got["load"], "load_fresh_all_s": got["fresh"], "raw_read_all_s": got["raw"],
        "cold_cache": method,
        # peak RSS of the resume's process beyond its start (imports), per byte of state
        "load_held_vs_state": statistics.median(got["load_held"]),
    }
    if got["torch_load"]:
        e["torch_load_s"] = statistics.median(got["torch_load"])
        e["torch_load_held_vs_state"] = statistics.median(got["torch_load_held"])
        e["torch_load_all_s"] = got["torch_load"]
    return e
