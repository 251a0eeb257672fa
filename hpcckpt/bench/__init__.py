"""``hpcckpt bench``: the limits of this machine, then each engine against them.

All figures come from one run on one file system (``--dir``), so their ratios
are meaningful even on a noisy machine. See ``run_bench`` for the JSON layout.
"""
from __future__ import annotations

import gc
import os
import shutil
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from .limits import GB, fresh_memory_gbps, memcpy_gbps, write_read_gbps
from .measure import measure_engine, measure_loads
from .overhead import DemoLoad, measure_overhead
from .synthetic import SyntheticRig

ENGINES = ("sync", "concurrent")
INTERVALS = (1, 10, 50)


@dataclass(frozen=True, kw_only=True)
class BenchOptions:
    size_bytes: int = 2_000_000_000
    dir: Path | None = None
    quick: bool = False
    repeats: int = 3
    overhead_steps: int = 50
    rounds: int = 5
    max_async: int = 1
    writer_threads: int = 0
    direct: bool | None = None

    @staticmethod
    def make(*, size_gb: float | None, dir: Path | None, quick: bool, direct: bool | None = None) -> BenchOptions:
        if quick:
            return BenchOptions(size_bytes=int((size_gb or 0.016) * GB), dir=dir, quick=True, repeats=1,
                                overhead_steps=6, direct=direct)
        return BenchOptions(size_bytes=int((size_gb or 2.0) * GB), dir=dir, direct=direct)

    def sizes(self) -> list[int]:
        """State sizes from small to the requested one (each a quarter of the next)."""
        steps = 2 if self.quick else 3
        return sorted({max(1 << 20, self.size_bytes >> (2 * k)) for k in range(steps)})


def _targets(top: dict[str, Any], limits: dict[str, float], overhead: dict[str, Any]) -> dict[str, Any]:
    """The issue's target ratios, computed from this run's numbers."""
    sync, conc = top["sync"], top["concurrent"]
    state_bytes = top["state_bytes"]
    memcpy_bound_s = state_bytes / (limits["memcpy_gbps"] * GB)
    torch_load = sync.get("torch_load_all_s")
    vs_torch = ceiling = None
    if torch_load:
        # paired by round: torch.load and hpcckpt's load ran seconds apart
        vs_torch = statistics.median(t / c for t, c in zip(torch_load, conc["load_all_s"]))
        # the best any reader could do from this disk: raw read of the same bytes vs torch.load
        ceiling = statistics.median(t / r for t, r in zip(torch_load, conc["raw_read_all_s"]))
    return {
        "stall_vs_sync": conc["stall_s"] / sync["stall_s"], "stall_vs_sync_target": 0.1,
        "stall_vs_memcpy_bound": conc["stall_s"] / memcpy_bound_s, "stall_vs_memcpy_bound_target": 1.3,
        "memcpy_bound_s": memcpy_bound_s,
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
        "load_vs_torch_load": vs_torch, "load_vs_torch_load_target": 3.0,
        "load_vs_torch_load_ceiling": ceiling,
        "load_vs_torch_load_reachable": None if ceiling is None else ceiling >= 3.0,
        "overhead_at_10": {n: v.get("10") for n, v in overhead["overhead"].items()}, "overhead_at_10_target": 0.03,
        "overhead_blocked_at_10": {n: v.get("10") for n, v in overhead["overhead_blocked"].items()},
    }


def run_bench(o: BenchOptions, progress: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Measure everything; return the result tree.

    Keys: ``state_bytes`` (the largest size), ``limits`` {write_gbps, read_gbps,
    memcpy_gbps, memcpy_1t_gbps}, ``engines`` {sync, concurrent} at the largest size
    (stall_s, persist_s, persist_gbps, load_s, load_gbps, ...), ``sizes`` (the same per
    size), ``overhead`` {engine: {interval: fraction}}, ``targets`` (ratios).
    """
    from tqdm import tqdm

    base = Path(tempfile.mkdtemp(prefix="hpcckpt-bench-", dir=o.dir))
    sizes = o.sizes()
    options = {"max_async": o.max_async, "writer_threads": o.writer_threads, "direct": o.direct}
    rounds = 1 if o.quick else o.rounds
    total = 2 + len(sizes) * (len(ENGINES) + 1) + rounds * (1 + len(ENGINES) * len(INTERVALS))
    bar = tqdm(total=total, desc="hpcckpt bench", unit="task", disable=None, leave=False)
    try:
        def tick(what: str = "") -> None:
            if what:
                bar.set_postfix_str(what)
                progress(what)
            bar.update(1)

        bar.set_postfix_str("write/read limits")
        limits: dict[str, Any] = write_read_gbps(base, max(o.size_bytes, 64 << 20))
        tick("limits: dd direct write + fsync, cold read")
        limits["memcpy_gbps"] = memcpy_gbps(min(o.size_bytes, 512 << 20))
        limits["memcpy_1t_gbps"] = memcpy_gbps(min(o.size_bytes, 512 << 20), threads=1)
        limits["fresh_memory_gbps"] = fresh_memory_gbps(min(o.size_bytes, 512 << 20))
        tick("limits: memcpy")
        per_size: list[dict[str, Any]] = []
        for size in sizes:
            rig = SyntheticRig(size)
            row: dict[str, Any] = {"state_bytes": rig.state_bytes}
            for name in ENGINES:
                bar.set_postfix_str(f"{name} at {rig.state_bytes / GB:.2f} GB")
                row[name] = measure_engine(name, rig, base / name, repeats=o.repeats, options=options)
                tick()
            # A resumed job has its node to itself: the loads run with this process's
            # gigabytes of rig freed. (Measured: while it still held the 2 GB rig, a
            # fresh process's 2 GB resume took 1.3-3.4 s instead of 1.0 s on the VM.)
            nbytes = rig.state_bytes
            del rig
            gc.collect()
            bar.set_postfix_str(f"cold loads at {nbytes / GB:.2f} GB")
            loads = measure_loads({n: base / n for n in ENGINES}, nbytes, rounds=rounds, rig_bytes=size)
            for name in ENGINES:
                row[name].update(loads[name])
                shutil.rmtree(base / name, ignore_errors=True)
            tick()
            per_size.append(row)
        over = measure_overhead(list(ENGINES), list(INTERVALS), base / "overhead",
                                DemoLoad(steps=o.overhead_steps), options, rounds=rounds, tick=lambda: tick())
    finally:
        bar.close()
        shutil.rmtree(base, ignore_errors=True)
    top = per_size[-1]
    result: dict[str, Any] = {
        "state_bytes": top["state_bytes"],
        "limits": limits,
        "engines": {n: top[n] for n in ENGINES},
        "sizes": per_size,
        **over,
        "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "dir": str(o.dir or tempfile.gettempdir())},
        "options": {"repeats": o.repeats, "quick": o.quick, **options},
    }
    result["targets"] = _targets(top, limits, over)
    return result
