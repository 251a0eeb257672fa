"""``hpcckpt bench``: the limits of this machine, then each engine against them.

All figures come from one run on one file system (``--dir``) and one device
(``--device``), so their ratios are meaningful even on a noisy machine. See
``run_bench`` for the JSON layout. Progress goes to the ``progress`` callback (the
CLI prints it on stderr, so ``--json`` keeps stdout for the result alone).
"""
from __future__ import annotations

import math
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError
from .isolate import children_cpu_s, held_vs_state, peak_bytes, reset_peak, rss_bytes, run_isolated
from .limits import GB, fresh_memory_gbps, memcpy_gbps, write_read_gbps
from .measure import STAGING_FRACTIONS, measure_engine, measure_loads, measure_staging, supports_staging_budget
from .overhead import DemoLoad, measure_overhead
from .smallstate import measure_small_state
from .smallstate import summary as small_summary
from .synthetic import SyntheticRig

ENGINES = ("sync", "concurrent")
INTERVALS = (1, 10, 50)
# Bytes on disk at the worst moment, per byte of state: each engine's newest checkpoint
# (kept for the loads), a save being committed next to the previous one, a raw file.
DISK_FACTOR = 4


@dataclass(frozen=True, kw_only=True)
class BenchOptions:
    size_bytes: int = 2_000_000_000
    dir: Path | None = None
    quick: bool = False
    repeats: int = 3
    overhead_steps: int = 50
    rounds: int = 5
    overhead_rounds: int = 5
    max_async: int = 1
    writer_threads: int = 0
    direct: bool | None = None
    device: str = "cpu"

    @staticmethod
    def make(*, size_gb: float | None, dir: Path | None, quick: bool, direct: bool | None = None,
             device: str = "cpu") -> BenchOptions:
        size = check_size_gb(size_gb)
        if quick:
            return BenchOptions(size_bytes=int((size or 0.016) * GB), dir=dir, quick=True, repeats=1, rounds=1,
                                overhead_rounds=1, overhead_steps=50, direct=direct,
                                device=device)
        # On a GPU node the overhead model holds 1.2 GB of state: saving it at every step for
        # 50 steps costs a minute or two per engine, so one round (a GPU node is quieter
        # than the shared VM the rounds are for) keeps the 2 GB run within 10 minutes.
        # On the CPU three paired rounds of loads and of training runs: with five the 2 GB
        # run took 1,015 s on the 2-core VM (670 s of training runs), and the medians of three
        # moved less than the VM's own minute-to-minute drift.
        cuda = device == "cuda"
        return BenchOptions(size_bytes=int((size or 2.0) * GB), dir=dir, direct=direct, device=device,
                            rounds=3, overhead_rounds=1 if cuda else 3)

    def sizes(self) -> list[int]:
        """State sizes from small to the requested one (each a quarter of the next); --quick: one."""
        steps = 1 if self.quick else 3
        return sorted({max(1 << 20, self.size_bytes >> (2 * k)) for k in range(steps)})


def check_size_gb(size_gb: float | None) -> float | None:
    """``--size-gb``: a finite number of GB above zero (the disk check comes with ``--dir``)."""
    if size_gb is None:
        return None
    if not math.isfinite(size_gb) or size_gb <= 0:
        raise ConfigError(f"--size-gb {size_gb}: give a state size in GB above zero (e.g. --size-gb 2)")
    if size_gb * GB < 1 << 20:
        raise ConfigError(f"--size-gb {size_gb}: at least 0.001 GB (1 MiB) of state is measured (e.g. --size-gb 0.016)")
    return size_gb


def require_room(directory: Path, size_bytes: int, *, disk_factor: int, memory_bytes: int,
                 memory_what: str, option: str = "", other_fix: str = "") -> None:
    """Refuse a size this file system or this host's memory cannot hold, before writing anything.

    ``memory_bytes``: what the run holds in host memory; ``memory_what`` says what that is.
    ``option``: more of the command line to name in the message (e.g. " --ranks 4");
    ``other_fix``: another way out to offer (e.g. " or fewer --ranks").
    """
    gb = size_bytes / GB
    free = shutil.disk_usage(directory).free
    need = disk_factor * size_bytes
    if need > free:
        raise ConfigError(
            f"--size-gb {gb:g}{option}: the bench needs about {disk_factor}x the state on disk "
            f"({need / GB:.1f} GB) and {directory} has {free / GB:.1f} GB free; give a smaller size "
            f"(e.g. --size-gb {max(0.001, free / disk_factor / GB / 2):.3g}) or another --dir")
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return
    if memory_bytes > ram:
        raise ConfigError(
            f"--size-gb {gb:g}{option}: the bench holds {memory_what} in host memory "
            f"({memory_bytes / GB:.1f} GB) and this host has {ram / GB:.1f} GB; give a smaller size "
            f"(e.g. --size-gb {max(0.001, gb * ram / memory_bytes / 2):.3g}){other_fix}")


def check_room(o: BenchOptions, directory: Path) -> None:
    """``require_room`` for the single-process bench: the state and its staging copy in memory."""
    require_room(directory, o.size_bytes, disk_factor=DISK_FACTOR, memory_bytes=2 * o.size_bytes,
                 memory_what="the state and a staging copy")


def _targets(top: dict[str, Any], limits: dict[str, Any], over: dict[str, Any], device: str) -> dict[str, Any]:
    """The issues' target ratios, computed from this run's numbers."""
    sync, conc = top["sync"], top["concurrent"]
    state_bytes = top["state_bytes"]
    cuda = device == "cuda"
    copy_gbps = limits["pinned_d2h_gbps"] if cuda else limits["memcpy_gbps"]
    copy_bound_s = state_bytes / (copy_gbps * GB)
    torch_load = sync.get("torch_load_all_s")
    vs_torch = ceiling = None
    if torch_load:
        # paired by round: torch.load and hpcckpt's load ran seconds apart
        vs_torch = statistics.median(t / c for t, c in zip(torch_load, conc["load_all_s"]))
        # the best any reader could do from this disk: raw read of the same bytes vs torch.load
        ceiling = statistics.median(t / r for t, r in zip(torch_load, conc["raw_read_all_s"]))
    torch_target = 2.0 if cuda else 3.0
    model = over["overhead_detail"]
    quarter = (top.get("staging") or {}).get("fractions", {}).get("0.25", {})
    return {
        "device": device,
        # what the Checkpointer adds to the process at its peak with staging_bytes = 25% of the state
        "staging_25_engine_held_vs_state": quarter.get("engine_held_vs_state"),
        "staging_25_engine_held_vs_state_target": 1.4,
        "stall_vs_sync": conc["stall_s"] / sync["stall_s"], "stall_vs_sync_target": 0.02 if cuda else 0.1,
        "stall_vs_copy_bound": conc["stall_s"] / copy_bound_s, "copy_bound_s": copy_bound_s,
        "snapshot_vs_copy_limit": conc.get("snapshot_gbps", 0.0) / copy_gbps,
        "snapshot_vs_copy_limit_target": 0.8,
        "snapshot_copy_limit": "pinned_d2h_gbps" if cuda else "memcpy_gbps",
        "first_vs_steady": conc["first_vs_steady"], "first_vs_steady_target": 2.0,
        "persist_vs_write": conc["persist_vs_raw_write"], "persist_vs_write_target": 0.85,
        "persist_vs_write_limit": conc["persist_gbps"] / limits["write_gbps"],
        "load_vs_read": conc["load_vs_raw_read"], "load_vs_read_target": 0.85,
        "load_vs_read_limit": conc["load_gbps"] / limits["read_gbps"],
        "load_fresh_vs_read": conc["load_fresh_vs_raw_read"],
        # the disk's own limit for bytes landing in new memory, and the load against it
        "raw_read_fresh_vs_read": conc["raw_read_fresh_vs_raw_read"],
        "load_fresh_vs_raw_read_fresh": conc["load_fresh_vs_raw_read_fresh"],
        # a load into new tensors cannot beat the first touch of fresh memory
        "load_vs_read_fresh_memory_ceiling": limits["fresh_memory_gbps"] / conc["raw_read_gbps"],
        "load_vs_torch_load": vs_torch, "load_vs_torch_load_target": torch_target,
        "load_vs_torch_load_ceiling": ceiling,
        "load_vs_torch_load_reachable": None if ceiling is None else ceiling >= torch_target,
        "overhead_at_10": {n: v.get("10") for n, v in over["overhead"].items()}, "overhead_at_10_target": 0.03,
        "overhead_blocked_at_10": {n: v.get("10") for n, v in over["overhead_blocked"].items()},
        # whether the disk can absorb one checkpoint of the overhead model within each interval
        "disk_absorbs": {str(i): model["state_bytes"] / (limits["write_gbps"] * GB) <= i * model["step_s"]
                         for i in INTERVALS},
    }


def _small_targets(small: dict[str, Any]) -> dict[str, Any]:
    """The small-state figures the issues name: saving every step, concurrent engine; on a
    CPU also the floor measured beside it (``bench.floor``: what this machine allows)."""
    conc = small["engines"]["concurrent"]
    out = {"small_state_every_step_overhead": conc["overhead"], "small_state_every_step_target": 0.25,
           "small_state_per_save_ms": conc["per_save_ms"]}
    floor = small["engines"].get("floor")
    if floor is not None:
        out["small_state_floor_overhead"] = floor["overhead"]
        out["small_state_floor_per_save_ms"] = floor["per_save_ms"]
    return out


class _Phases:
    """Wall seconds per phase of the run, and CPU seconds (this process and its isolated
    children): where ``bench --quick``'s time goes, even on a machine other work keeps busy."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}

    def __call__(self, name: str, fn: Callable[[], Any]) -> Any:
        t0, c0 = time.monotonic(), time.process_time() + children_cpu_s()
        try:
            return fn()
        finally:
            self.wall[name] = time.monotonic() - t0
            self.cpu[name] = time.process_time() + children_cpu_s() - c0


class _Steps:
    """Numbered progress lines with the elapsed time: ``[bench 12.3s 4/17] what``."""

    def __init__(self, total: int, say: Callable[[str], None]) -> None:
        self.total, self.done, self.say, self.t0 = total, 0, say, time.monotonic()

    def __call__(self, what: str) -> None:
        self.done += 1
        self.say(f"[bench {time.monotonic() - self.t0:6.1f}s {self.done}/{self.total}] {what}")


def _limits(o: BenchOptions, base: Path, tick: Callable[[str], None]) -> dict[str, Any]:
    limits: dict[str, Any] = write_read_gbps(base, max(o.size_bytes, 64 << 20))
    tick(f"disk: raw parallel O_DIRECT write {limits['write_gbps']:.2f} GB/s, read {limits['read_gbps']:.2f} GB/s")
    n = min(o.size_bytes, 512 << 20)
    limits["memcpy_gbps"] = memcpy_gbps(n)
    limits["memcpy_1t_gbps"] = memcpy_gbps(n, threads=1)
    limits["fresh_memory_gbps"] = fresh_memory_gbps(n)
    if o.device == "cuda":
        from .gpu import copy_limits
        limits.update(copy_limits(o.size_bytes))
        tick(f"copies: pinned D2H {limits['pinned_d2h_gbps']:.1f} GB/s, H2D {limits['pinned_h2d_gbps']:.1f} GB/s, "
             f"memcpy {limits['memcpy_gbps']:.1f} GB/s")
    else:
        tick(f"copies: memcpy {limits['memcpy_gbps']:.1f} GB/s (no GPU: host copies only)")
    return limits


def child_engine(name: str, size: int, device: str, root: str, repeats: int,
                 options: dict[str, Any]) -> dict[str, Any]:
    """``measure_engine`` on a rig built in this (isolated) process: its peak RSS is the save's."""
    rig = SyntheticRig(size, device=device)
    return {**measure_engine(name, rig, Path(root), repeats=repeats, options=options),
            "state_bytes": rig.state_bytes}


def child_staging(size: int, device: str, root: str, repeats: int, options: dict[str, Any],
                  fraction: float) -> dict[str, Any]:
    """``measure_staging`` at one budget, in an isolated process of its own; with
    ``engine_held_vs_state``: the peak RSS beyond the RSS once the model and optimizer are
    built, per byte of state (what the Checkpointer adds, staging included)."""
    rig = SyntheticRig(size, device=device)
    how = reset_peak()
    before = rss_bytes()
    got = measure_staging(rig, Path(root), repeats=repeats, options=options, fractions=(fraction,))
    held = (peak_bytes(how) - before) / max(1, rig.state_bytes)
    for v in got.get("fractions", {}).values():
        v["engine_held_vs_state"] = held
    return {**got, "state_bytes": rig.state_bytes}


def _isolated(fn: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """``fn`` in a child (``isolate``); its peak RSS beyond its start per byte of state as ``held_vs_state``."""
    got = run_isolated(fn, *args)
    got["held_vs_state"] = held_vs_state(got.pop("rss"), int(got["state_bytes"]))
    got.pop("cpu_s", None)
    return got


def _staging(o: BenchOptions, size: int, base: Path, options: dict[str, Any]) -> dict[str, Any]:
    """Each staging budget in a child of its own: the peak RSS per budget is its own."""
    if not supports_staging_budget():
        return {"supported": False, "why": "this concurrent engine takes no staging_bytes option"}
    out: dict[str, Any] = {"supported": True, "fractions": {}}
    for frac in STAGING_FRACTIONS:
        # one steady save per budget beside the first: the stall of a ring is its persist's, steady
        got = _isolated(child_staging, size, o.device, str(base / "staging"), max(1, o.repeats - 2), options, frac)
        out["fractions"].update({k: {**v, "held_vs_state": got["held_vs_state"]}
                                 for k, v in got["fractions"].items()})
    return out


def _one_size(o: BenchOptions, size: int, base: Path, options: dict[str, Any], *, top: bool,
              tick: Callable[[str], None]) -> dict[str, Any]:
    """Stall/persist of each engine at one size; at the largest, staging budgets and cold loads.

    Each engine runs in a child of its own (``isolate``) on a rig built there from the same
    seed, so its peak RSS is its own (``save_held_vs_state``) and this process holds no
    state while the loads run (a resumed job has its node to itself)."""
    row: dict[str, Any] = {}
    for name in ENGINES:
        # The sync baseline blocks for its whole persist (8 s a save at 2 GB on the VM) and its
        # first save is no different from a steady one: one repeat beside the first is its figure.
        repeats = o.repeats if name != "sync" else max(1, o.repeats - 2)
        got = _isolated(child_engine, name, size, o.device, str(base / name), repeats, options)
        got["save_held_vs_state"] = got.pop("held_vs_state")
        row[name], row["state_bytes"] = got, got["state_bytes"]
        tick(f"{name} at {got['state_bytes'] / GB:.3f} GB: stall {got['stall_s']:.4f}s, "
             f"persist {got['persist_gbps']:.2f} GB/s, peak RSS {got['save_held_vs_state']:.2f}x the state")
    if top:
        row["staging"] = _staging(o, size, base, options)
        tick("concurrent staging budgets" + ("" if row["staging"]["supported"] else ": not supported by this engine"))
    nbytes = int(row["state_bytes"])
    if top:
        loads = measure_loads({n: base / n for n in ENGINES}, nbytes, rounds=o.rounds, rig_bytes=size,
                              device=o.device)
        for name in ENGINES:
            row[name].update(loads[name])
        tick(f"cold loads onto {o.device} at {nbytes / GB:.3f} GB: concurrent {loads['concurrent']['load_gbps']:.2f} GB/s")
    for name in ENGINES:
        shutil.rmtree(base / name, ignore_errors=True)
    return row


def run_bench(o: BenchOptions, progress: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Measure everything; return the result tree.

    Keys: ``state_bytes`` (the largest size), ``device``, ``limits`` {write_gbps (raw
    parallel O_DIRECT), write_dd_gbps, read_gbps, memcpy_gbps, ...; on CUDA
    pinned_d2h_gbps, pinned_h2d_gbps, pageable_d2h_gbps}, ``engines`` {sync, concurrent}
    at the largest size (stall_s, first_stall_s, first_vs_steady, snapshot_gbps,
    persist_s, persist_gbps, persist_vs_raw_write, load_s, load_gbps, load_vs_raw_read,
    torch_load_s, ...), ``staging`` (stall at 100/50/25% staging budgets), ``sizes``
    (the same per size), ``overhead`` {engine: {interval: fraction}}, ``small_state`` (a ~3 MB
    state saved at every ~6 ms step: overhead and per-save cost per engine), ``targets``
    (ratios), ``phases_s``/``phases_cpu_s`` (wall and CPU seconds per phase, children's included).
    Peak RSS per byte of state: ``save_held_vs_state`` per engine (its saves run in a child of
    their own), ``load_held_vs_state``/``torch_load_held_vs_state`` (each resume's process),
    ``held_vs_state`` per staging budget, and ``engine_held_vs_state`` (beyond the RSS once
    the model and optimizer are built: what the Checkpointer adds, staging included).
    """
    base = Path(tempfile.mkdtemp(prefix="hpcckpt-bench-", dir=o.dir))
    sizes = o.sizes()
    options = {"max_async": o.max_async, "writer_threads": o.writer_threads, "direct": o.direct}
    load = DemoLoad.for_device(o.device, steps=o.overhead_steps, quick=o.quick)
    tick = _Steps(2 + len(sizes) * len(ENGINES) + 2 + 2, progress)
    phases = _Phases()
    progress(f"[bench] {o.device}, state up to {o.size_bytes / GB:.3f} GB, files under {base}")
    try:
        limits = phases("limits", lambda: _limits(o, base, tick))
        per_size = phases("engines", lambda: [_one_size(o, size, base, options, top=size == sizes[-1], tick=tick)
                                              for size in sizes])
        over = phases("overhead", lambda: measure_overhead(list(ENGINES), list(INTERVALS), base / "overhead", load,
                                                           options, rounds=o.overhead_rounds))
        tick("training overhead at intervals " + ", ".join(
            f"{n} {'/'.join(f'{100 * v:.0f}%' for v in per.values())}" for n, per in over["overhead"].items()))
        small = phases("small_state", lambda: measure_small_state(base / "small", options, quick=o.quick,
                                                                                device=o.device))
        tick(small_summary(small))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    top = per_size[-1]
    machine: dict[str, Any] = {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                               "dir": str(o.dir or tempfile.gettempdir()), "torch": torch.__version__}
    if o.device == "cuda":
        from .gpu import device_name
        machine["gpu"] = device_name()
    result: dict[str, Any] = {
        "state_bytes": top["state_bytes"],
        "device": o.device,
        "limits": limits,
        "engines": {n: top[n] for n in ENGINES},
        "staging": top["staging"],
        "sizes": [{k: v for k, v in row.items() if k != "staging"} for row in per_size],
        **over,
        "small_state": small,
        "phases_s": phases.wall,
        "phases_cpu_s": phases.cpu,
        "machine": machine,
        "options": {"repeats": o.repeats, "quick": o.quick, "rounds": o.rounds,
                    "overhead_rounds": o.overhead_rounds, **options},
    }
    result["targets"] = {**_targets(top, limits, over, o.device), **_small_targets(small)}
    return result
