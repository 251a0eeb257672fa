"""``hpcckpt bench --levels``: each checkpoint level on this machine, and a checkpoint at every
step at the node-local level against one at every step to the shared directory.

Bandwidth, side by side in one run, of a checkpoint-sized file set (``FILES`` rank files,
``size_bytes`` in all), ``rounds`` times with the levels interleaved (the order turns by
round):

- ``node_local``: the directory the levels use on this node (``hpcckpt.levels.local_root``:
  ``--local-dir``, else ``$HPCCKPT_LOCAL_DIR``, else the job's prolog-made staging directory,
  else ``/dev/shm``), and ``shared``: the bench's directory (``--dir``, default the system
  temp dir). ``write_mbps``: the set written by the native writer pool the engines use
  (O_DIRECT where the file system takes it unless ``--buffered``; each file fdatasync'ed,
  the directory fsynced), bytes / seconds; ``read_mbps``: the set read back after its
  pages were dropped from the cache (``cold_cache``: ``drop_caches`` as root, else
  ``fadvise``; a tmpfs keeps its pages: they are its storage).
- ``partner``: the levels' partner copy (``Ranks.exchange_files``) between the 2 ranks of
  a real gloo process group (``hpcckpt.bench.levelproc``), from and into node-local
  directories: ``one_way_mbps`` (rank 0 sends the set to rank 1) and ``both_ways_mbps``
  (each rank sends its own file to the other at once, as 2 nodes' partner copies do), the
  bytes moved over the slower rank's seconds. Both ranks run on this machine: the figure
  is gloo's TCP over loopback plus the copies and fsyncs, not a network between nodes.

Then the training overhead (``bench.overhead``, the default bench's own measurement, on its
demo model) of a checkpoint at every step with the concurrent engine: ``shared``
(``every_steps=1`` to the shared directory, today's every-step cost) and ``node_local``
(``local_every_steps=1``, ``every_steps=None``: node-local only, one rank, no partner),
paired with a run without checkpoints in each of ``overhead_rounds`` rounds (the arms'
order turns by round). On the CPU the model trains on one torch thread (two OpenMP threads
on a busy 2-core machine ran 5x slower than one, and the engine's threads need a core);
each run has as many steps as fill ``RUN_S`` seconds of plain training (``MIN_STEPS`` to
``overhead_steps``; the JSON's ``steps``), so a busy machine still ends the run in minutes.
``node_local_vs_shared``: the overhead ratio (None when the shared overhead is not above
zero: the machine's noise); ``time_ratio``: the median over rounds of the node-local run's
time over the shared run's.
"""
from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from .._core import native
from ..errors import ConfigError
from .limits import GB, drop_caches, parallel_read_bps

FILES = 2  # one rank file per rank of the partner copy's 2-rank group
DEFAULT_GB, QUICK_GB = 0.5, 0.016
DEFAULT_ROUNDS, DEFAULT_OVERHEAD_ROUNDS = 3, 3
# Steps per overhead run: as many as fill RUN_S seconds of plain training (measured first),
# between MIN_STEPS and the most (50, --quick 20): a bounded run on a busy machine too.
DEFAULT_STEPS, QUICK_STEPS, MIN_STEPS, RUN_S = 50, 20, 8, 5.0
MB = 1e6
ARMS = {"shared": "concurrent", "node_local": "concurrent_local"}  # overhead arm -> bench.overhead's name
Tick = Callable[[str], None]


@dataclass(frozen=True, kw_only=True)
class LevelsOptions:
    size_bytes: int = int(DEFAULT_GB * GB)
    dir: Path | None = None
    local_dir: str | None = None  # --local-dir; None: $HPCCKPT_LOCAL_DIR, staging, /dev/shm
    quick: bool = False
    rounds: int = DEFAULT_ROUNDS
    overhead_rounds: int = DEFAULT_OVERHEAD_ROUNDS
    overhead_steps: int = DEFAULT_STEPS
    direct: bool | None = None
    device: str = "cpu"

    @staticmethod
    def make(*, size_gb: float | None, dir: Path | None, local_dir: str | None, quick: bool,
             direct: bool | None = None, device: str = "cpu") -> LevelsOptions:
        from . import check_size_gb
        size = check_size_gb(size_gb) or (QUICK_GB if quick else DEFAULT_GB)
        if quick:
            return LevelsOptions(size_bytes=int(size * GB), dir=dir, local_dir=local_dir, quick=True, rounds=1,
                                 overhead_rounds=1, overhead_steps=QUICK_STEPS, direct=direct, device=device)
        return LevelsOptions(size_bytes=int(size * GB), dir=dir, local_dir=local_dir, direct=direct, device=device)

    def engine_options(self) -> dict[str, Any]:
        return {"direct": self.direct} if self.direct is not None else {}


# -- where the node-local level is --------------------------------------------------

def local_base(local_dir: str | None) -> str | None:
    """The node-local directory the levels would be given: ``--local-dir``, else ``$HPCCKPT_LOCAL_DIR``."""
    if local_dir is not None:
        return local_dir
    env = os.environ.get("HPCCKPT_LOCAL_DIR", "").strip()
    return env or None


def node_local_root(shared: Path, local_dir: str | None) -> Path:
    """This node's node-local root for ``shared``, resolved as a Checkpointer with levels resolves
    it (``hpcckpt.levels.local_root``); a ConfigError naming ``--local-dir`` where it cannot be made."""
    from ..cluster.env import JobEnv
    from ..levels import local_root
    from ..lifecycle import identity

    try:
        return local_root(shared, local_base(local_dir), identity.current().node, JobEnv(environ=os.environ).staging_dir())
    except ConfigError as exc:
        raise ConfigError(f"{exc} (hpcckpt bench --levels: or give --local-dir DIR)") from None


def fs_type(path: Path) -> str:
    """The file system type of ``path`` (the longest mount point above it in /proc/mounts)."""
    best, kind = "", "unknown"
    try:
        real = os.path.realpath(path)
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mount = parts[1].replace("\\040", " ")
                inside = real == mount or real.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) > len(best):
                    best, kind = mount, parts[2]
    except OSError:
        pass
    return kind


def check_room(o: LevelsOptions, shared: Path, local: Path, state_bytes: int) -> None:
    """Refuse a size either level cannot hold, before writing anything: the shared level holds the
    set, or the overhead arm's checkpoints; the node-local one the set, a partner's copy of it and
    that arm's checkpoints."""
    from . import require_room
    require_room(shared, max(o.size_bytes, 3 * state_bytes), disk_factor=1, memory_bytes=0, memory_what="",
                 option=" --levels")
    free = shutil.disk_usage(local).free
    need = 2 * o.size_bytes + 3 * state_bytes
    if need > free:
        raise ConfigError(
            f"--size-gb {o.size_bytes / GB:g} --levels: the node-local level {local} needs about {need / GB:.2f} GB "
            f"(the file set and a partner's copy of it) and has {free / GB:.2f} GB free; give a smaller size "
            f"(e.g. --size-gb {max(0.001, (free - 3 * state_bytes) / 2 / GB / 2):.3g}) or another --local-dir")


# -- write and read of a file set ---------------------------------------------------

def file_sizes(total: int, files: int = FILES) -> list[int]:
    """``files`` sizes in whole 4 KiB pages, together about ``total`` (at least a page each)."""
    each = max(4096, total // files // 4096 * 4096)
    return [each] * files


def write_set(directory: Path, sizes: list[int], *, direct: bool, block: int = 16 << 20) -> tuple[list[Path], float]:
    """Write ``sizes`` bytes to new files ``rank-<i>.bin`` in a new ``directory`` with the native writer
    pool (``direct``: O_DIRECT where taken), each fdatasync'ed, then fsync the directory; (paths, seconds)."""
    from ..store.commit import fsync_path
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(mode=0o700, parents=True)
    block = min(block, max(sizes))
    buf = native().aligned_buffer(min(sum(sizes), 16 * block), 4096, True)
    np.frombuffer(buf, dtype=np.uint8)[:] = 0xA5
    paths = [directory / f"rank-{i}.bin" for i in range(len(sizes))]
    pool = native().WriterPool(0, block)
    try:
        batch = native().Batch(pool, direct)
        k = 0
        for path, size in zip(paths, sizes):
            for off in range(0, size, block):
                n = min(block, size - off)
                start = (k * block) % len(buf)
                if start + n > len(buf):
                    start = 0
                batch.add(str(path), off, memoryview(buf)[start:start + n])
                k += 1
        t0 = time.perf_counter()
        batch.start()
        batch.wait()
        fsync_path(directory)
        took = time.perf_counter() - t0
    finally:
        pool.close()
    return paths, took


def read_set(paths: list[Path]) -> float:
    """Seconds to read every file of the set (the bench's raw parallel reader, one file after another)."""
    return sum(p.stat().st_size / parallel_read_bps(p) for p in paths)


def _level_round(directory: Path, sizes: list[int], direct: bool) -> dict[str, Any]:
    paths, write_s = write_set(directory, sizes, direct=direct)
    cold = drop_caches(paths)
    read_s = read_set(paths)
    return {"write_s": write_s, "read_s": read_s, "cold_cache": cold, "paths": paths}


def _bandwidth(samples: list[dict[str, Any]], nbytes: int) -> dict[str, Any]:
    w = [nbytes / s["write_s"] / MB for s in samples]
    r = [nbytes / s["read_s"] / MB for s in samples]
    return {"write_mbps": statistics.median(w), "read_mbps": statistics.median(r), "write_all_mbps": w,
            "read_all_mbps": r, "write_s": statistics.median(s["write_s"] for s in samples),
            "read_s": statistics.median(s["read_s"] for s in samples)}


# -- the partner copy between 2 ranks ------------------------------------------------

def partner_copy(files: list[Path], into: list[Path], work: Path, rounds: int) -> dict[str, Any]:
    """``levelproc`` on 2 local gloo ranks: the partner copy's MB/s one way and both ways at once."""
    import json

    from ..demo.runtime import module_cmd
    from .ranks import free_port, rank_env, run_procs

    work.mkdir(parents=True, exist_ok=True)
    spec = work / "spec.json"
    spec.write_text(json.dumps({"files": [[str(p), p.stat().st_size] for p in files],
                                "into": [str(d) for d in into], "rounds": rounds}))
    port = free_port()
    cmds = [[*module_cmd("hpcckpt.bench.levelproc"), "--rank", str(r), "--port", str(port), "--spec", str(spec),
             "--out", str(work / f"result-r{r}.json")] for r in range(2)]
    logs = [work / f"log-r{r}.txt" for r in range(2)]
    total = sum(p.stat().st_size for p in files)
    run_procs(cmds, logs, what="the partner copy between 2 gloo ranks", env=rank_env(),
              timeout_s=300 + 60 * rounds * total / GB)
    got = json.loads((work / "result-r0.json").read_text())
    out: dict[str, Any] = {"ranks": 2, "transport": "gloo, TCP over 127.0.0.1 (both ranks on this machine)",
                           "chunk_bytes": 64 << 20, "rounds": rounds}
    for kind in ("one_way", "both_ways"):
        rates = [got["bytes"][kind] / s / MB for s in got[f"{kind}_s"]]
        out[f"{kind}_mbps"] = statistics.median(rates)
        out[f"{kind}_all_mbps"] = rates
        out[f"{kind}_bytes"] = got["bytes"][kind]
        out[f"{kind}_s"] = statistics.median(got[f"{kind}_s"])
    return out


# -- the run -------------------------------------------------------------------------

def _overhead(over: dict[str, Any]) -> dict[str, Any]:
    """The two arms at interval 1, named by level, and their ratios."""
    d = over["overhead_detail"]
    base, steps = d["baseline_runs_s"], d["steps_by_interval"]["1"]
    scale = steps / max(1, d["steps"])
    out: dict[str, Any] = {}
    for level, arm in ARMS.items():
        runs = d["run_s"][arm]["1"]
        out[level] = {"overhead": over["overhead"][arm]["1"], "overhead_min": over["overhead_min"][arm]["1"],
                      "overhead_blocked": over["overhead_blocked"][arm]["1"],
                      "per_save_ms": 1e3 * statistics.median((w - b * scale) / steps for w, b in zip(runs, base)),
                      "blocked_per_save_ms": 1e3 * statistics.median(x / steps for x in d["blocked_s"][arm]["1"]),
                      "drain_s": statistics.median(d["drain_s"][arm]["1"]), "run_s": runs}
    shared, local = out["shared"]["overhead"], out["node_local"]["overhead"]
    out["node_local_vs_shared"] = local / shared if shared > 0 else None
    out["time_ratio"] = statistics.median(a / b for a, b in zip(d["run_s"][ARMS["node_local"]]["1"],
                                                                   d["run_s"][ARMS["shared"]]["1"]))
    out["node_local_within_shared"] = local <= shared
    out.update({"every_steps": 1, "engine": "concurrent", "baseline_runs_s": base, "steps": steps,
                "rounds": d["rounds"], "step_s": d["step_s"], "state_bytes": d["state_bytes"], "model": d["model"]})
    return out


def overhead_steps(load: Any, root: Path, most: int) -> int:
    """Steps that fill ``RUN_S`` seconds of plain training of ``load`` (timed over a few
    steps here, on its threads), from ``MIN_STEPS`` to ``most``."""
    import torch

    from .overhead import _loop
    before = torch.get_num_threads()
    if load.threads:
        torch.set_num_threads(load.threads)
    try:
        n = 3
        step_s = _loop(replace(load, steps=n), None, 1, root, {})[0] / n
    finally:
        torch.set_num_threads(before)
    return max(min(MIN_STEPS, most), min(most, round(RUN_S / max(step_s, 1e-6))))


def run_levels(o: LevelsOptions, progress: Tick = lambda s: None) -> dict[str, Any]:
    """Measure every level and the two every-step arms; the result tree (see the module doc)."""
    import torch

    from .overhead import DemoLoad, measure_overhead
    from .peers import Ticker

    load = DemoLoad.for_device(o.device, steps=o.overhead_steps, quick=o.quick)
    if o.device == "cpu":
        load = replace(load, threads=1)
    base = Path(tempfile.mkdtemp(prefix="hpcckpt-bench-levels-", dir=o.dir))
    shm = Path("/dev/shm") / f"hpcckpt-{os.getuid()}"  # the levels' default base: removed after if made here
    shm_existed = shm.exists()
    local: Path | None = None
    tick = Ticker("levels", progress)
    try:
        local = node_local_root(base, o.local_dir)
        check_room(o, base, local, load.state_bytes())
        sizes = file_sizes(o.size_bytes)
        direct = True if o.direct is None else o.direct
        progress(f"[levels] file set {len(sizes)} x {sizes[0] / MB:.1f} MB; node-local {local} ({fs_type(local)}), "
                 f"shared {base} ({fs_type(base)}); {o.rounds} round{'s' if o.rounds > 1 else ''}")
        levels, cold_cache = _bandwidths(o, base, local, sizes, direct, tick)
        load = replace(load, steps=overhead_steps(load, base / "overhead", o.overhead_steps))
        over = measure_overhead(list(ARMS.values()), [1], base / "overhead", load, o.engine_options(),
                                rounds=o.overhead_rounds, local=local, rotate=True)
        overhead = _overhead(over)
        tick(f"a checkpoint at every step ({overhead['state_bytes'] / MB:.1f} MB, "
             f"{1e3 * overhead['step_s']:.1f} ms steps): shared {100 * overhead['shared']['overhead']:+.1f}%, "
             f"node-local {100 * overhead['node_local']['overhead']:+.1f}%")
    finally:
        _remove(base, local, None if shm_existed else shm)
    shared = levels["shared"]
    vs_shared = {"node_local_write": levels["node_local"]["write_mbps"] / shared["write_mbps"],
                 "node_local_read": levels["node_local"]["read_mbps"] / shared["read_mbps"],
                 "partner_one_way_vs_write": levels["partner"]["one_way_mbps"] / shared["write_mbps"],
                 "partner_both_ways_vs_write": levels["partner"]["both_ways_mbps"] / shared["write_mbps"]}
    return {
        "kind": "levels", "device": o.device, "set_bytes": sum(sizes), "files": len(sizes),
        "levels": levels, "vs_shared": vs_shared, "overhead": overhead, "cold_cache": cold_cache,
        "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "dir": str(o.dir or tempfile.gettempdir())},
        "options": {"size_bytes": o.size_bytes, "quick": o.quick, "rounds": o.rounds,
                    "overhead_rounds": o.overhead_rounds, "overhead_steps": o.overhead_steps, "direct": direct,
                    "local_dir": o.local_dir},
        "wall_s": tick.elapsed_s(),
    }


def _bandwidths(o: LevelsOptions, base: Path, local: Path, sizes: list[int], direct: bool,
                tick: Tick) -> tuple[dict[str, Any], Any]:
    """Write+fsync and cold read of the file set at each level, rounds alternating which goes
    first, then the partner copy: (figures by level, how the cache was dropped)."""
    nbytes = sum(sizes)
    dirs = {"node_local": local / "set", "shared": base / "set"}
    samples: dict[str, list[dict[str, Any]]] = {k: [] for k in dirs}
    for r in range(o.rounds):
        for level in (list(dirs) if r % 2 == 0 else list(dirs)[::-1]):
            got = _level_round(dirs[level], sizes, direct)
            samples[level].append(got)
            tick(f"{level}: write+fsync {nbytes / got['write_s'] / MB:.0f} MB/s, "
                 f"read {nbytes / got['read_s'] / MB:.0f} MB/s")
    shutil.rmtree(dirs["shared"], ignore_errors=True)
    # where each level is: the node-local base (its per-directory subdirectory is this run's), --dir
    where = {"node_local": local.parent, "shared": base.parent}
    levels: dict[str, Any] = {level: {"dir": str(where[level]), "fs": fs_type(d.parent),
                                      **_bandwidth(samples[level], nbytes)} for level, d in dirs.items()}
    partner = partner_copy(samples["node_local"][-1]["paths"], [local / "partner-r0", local / "partner-r1"],
                           base / "partner", o.rounds)
    levels["partner"] = {"dir": str(local.parent), "fs": fs_type(local), **partner}
    tick(f"partner copy (2 gloo ranks): one way {partner['one_way_mbps']:.0f} MB/s, "
         f"both ways {partner['both_ways_mbps']:.0f} MB/s")
    shutil.rmtree(dirs["node_local"], ignore_errors=True)
    return levels, samples["shared"][0]["cold_cache"]


def _remove(base: Path, local: Path | None, made: Path | None) -> None:
    """Remove what the run made: its directory under --dir, its node-local one, and ``made``
    (the levels' default base in /dev/shm) when this run made it and it is empty."""
    shutil.rmtree(base, ignore_errors=True)
    if local is None:
        return
    shutil.rmtree(local, ignore_errors=True)
    if made is not None and local.parent == made:
        try:
            made.rmdir()
        except OSError:
            pass


def text(res: dict[str, Any]) -> str:
    """The result as a table (``--json`` prints the tree instead)."""
    lv, ov = res["levels"], res["overhead"]
    lines = [f"levels: file set {res['files']} files, {res['set_bytes'] / MB:.1f} MB; median of "
             f"{res['options']['rounds']} round(s); cold cache by {res['cold_cache']}",
             f"{'level':<12}{'fs':>8}{'write MB/s':>12}{'read MB/s':>11}  dir"]
    for level in ("node_local", "shared"):
        e = lv[level]
        lines.append(f"{level:<12}{e['fs']:>8}{e['write_mbps']:>12.0f}{e['read_mbps']:>11.0f}  {e['dir']}")
    p = lv["partner"]
    lines.append(f"{'partner':<12}{p['fs']:>8}{p['one_way_mbps']:>12.0f}{'':>11}  one way; both ways at once "
                 f"{p['both_ways_mbps']:.0f} MB/s ({p['transport']})")
    vs = res["vs_shared"]
    lines.append(f"node-local vs shared: write {vs['node_local_write']:.2f}x, read {vs['node_local_read']:.2f}x; "
                 f"partner one way vs shared write {vs['partner_one_way_vs_write']:.2f}x")
    ratio = ov["node_local_vs_shared"]
    lines.append(f"a checkpoint at every step, concurrent engine ({ov['state_bytes'] / MB:.1f} MB state, "
                 f"{1e3 * ov['step_s']:.1f} ms steps, {ov['rounds']} paired round(s) of {ov['steps']} steps):")
    for level in ("shared", "node_local"):
        e = ov[level]
        lines.append(f"  {level:<11} overhead {100 * e['overhead']:+.1f}% ({e['per_save_ms']:.1f} ms per save, "
                     f"blocked {e['blocked_per_save_ms']:.2f} ms)")
    lines.append(f"  node-local / shared overhead {'n/a' if ratio is None else format(ratio, '.2f')}; "
                 f"run time ratio {ov['time_ratio']:.3f}")
    return "\n".join(lines)
