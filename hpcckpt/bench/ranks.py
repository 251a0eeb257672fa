"""``hpcckpt bench --ranks N``: bytes written and persist time of a DDP job on 1 and N ranks.

For each engine (sync, concurrent) and each world size (1, then N), ``world`` local
processes (``hpcckpt.bench.rankproc``, gloo over 127.0.0.1) build the same synthetic
model + Adam state (``SyntheticRig``), DDP-wrapped when ``world > 1``, and take
blocking saves with a ``Checkpointer``. Replicated state (DDP parameters and their
Adam moments) is written once, striped over the ranks (manifest ``hpcckpt/2``), so
bytes written per checkpoint stay at the state's size and each rank writes about
``1/N`` of it.

Figures per engine and world size (``run_ranks``):

- ``persist_s``: the median over rounds of the slowest rank's ``save_s`` (from the
  save call until the checkpoint is committed durably);
- ``bytes_per_checkpoint``, ``bytes_per_rank``, ``state_bytes``: read back from the
  committed manifest (``placement.written_bytes`` / ``placement.state_bytes``);
- ``share_per_rank``: ``bytes_per_rank / state_bytes``;

and per engine ``bytes_vs_state`` (at N ranks) and ``persist_vs_1_rank``
(``persist_s`` at N over ``persist_s`` at 1). The ranks of one machine share its
disk and cores, so the persist ratio measures how the write splits, not how a
parallel file system scales with nodes.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Callable

from ..errors import ConfigError, HpcckptError
from .limits import GB

ENGINES = ("sync", "concurrent")
DEFAULT_GB = 0.5  # N ranks each hold the whole state (DDP): N x this in memory
QUICK_GB = 0.016
DEFAULT_ROUNDS = 3
# Bytes on disk at the worst moment, per byte of state: the kept checkpoint and the one
# being committed (each run's directory is removed before the next starts), with room to spare.
DISK_FACTOR = 3
# Host memory per rank, per byte of state: the state itself, DDP's gradients and
# buckets, the concurrent engine's staging copy.
MEMORY_FACTOR = 3
TAIL_LINES = 8


@dataclass(frozen=True, kw_only=True)
class RanksOptions:
    ranks: int
    size_bytes: int = int(DEFAULT_GB * GB)
    rounds: int = DEFAULT_ROUNDS
    dir: Path | None = None
    quick: bool = False
    direct: bool | None = None

    @staticmethod
    def make(*, ranks: int, size_gb: float | None, dir: Path | None, quick: bool,
             direct: bool | None = None) -> RanksOptions:
        from . import check_size_gb
        if ranks < 2:
            raise ConfigError(f"--ranks {ranks}: give 2 or more ranks (1 rank is always measured as the "
                              "baseline), e.g. --ranks 4")
        size = check_size_gb(size_gb) or (QUICK_GB if quick else DEFAULT_GB)
        return RanksOptions(ranks=ranks, size_bytes=int(size * GB), rounds=1 if quick else DEFAULT_ROUNDS,
                            dir=dir, quick=quick, direct=direct)


def check_room(o: RanksOptions, directory: Path) -> None:
    """Refuse a size this file system or this host's memory cannot hold, before starting any rank."""
    free = shutil.disk_usage(directory).free
    need = DISK_FACTOR * o.size_bytes
    gb = o.size_bytes / GB
    if need > free:
        raise ConfigError(
            f"--size-gb {gb:g}: the bench needs about {DISK_FACTOR}x the state on disk ({need / GB:.1f} GB) "
            f"and {directory} has {free / GB:.1f} GB free; give a smaller size "
            f"(e.g. --size-gb {max(0.001, free / DISK_FACTOR / GB / 2):.3g}) or another --dir")
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return
    need = MEMORY_FACTOR * o.ranks * o.size_bytes
    if need > ram:
        raise ConfigError(
            f"--size-gb {gb:g} --ranks {o.ranks}: every rank holds the whole state, its gradients and a "
            f"staging copy (about {need / GB:.1f} GB in all) and this host has {ram / GB:.1f} GB; give a "
            f"smaller size (e.g. --size-gb {max(0.001, ram / MEMORY_FACTOR / o.ranks / GB / 2):.3g}) "
            "or fewer --ranks")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_env() -> dict[str, str]:
    """This environment without Slurm's variables (local ranks, not a job step), one thread per rank."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(OMP_NUM_THREADS="1", HPCCKPT_CLUSTER="local")
    return env


def _tail(path: Path, n: int = TAIL_LINES) -> str:
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "(no output)"
    return "\n".join("  " + ln for ln in lines[-n:]) or "  (no output)"


def _kill(p: subprocess.Popen[bytes]) -> None:
    """SIGKILL the rank's process group (it runs in a session of its own), then reap it."""
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            p.kill()
    p.wait()


def run_procs(cmds: list[list[str]], logs: list[Path], *, what: str, env: dict[str, str] | None = None,
              timeout_s: float = 3600.0, poll_s: float = 0.05) -> None:
    """Run one process per rank; return when all exited 0.

    Each rank runs in a session of its own (a Ctrl-C reaches this process only) with
    stdout and stderr in ``logs[rank]``. The first rank to fail, or a hang past
    ``timeout_s`` (a guard, not a measurement), ends the others; HpcckptError names the
    rank, its exit code and its last output lines. Every process is reaped whatever
    happens (Ctrl-C included).
    """
    procs: list[subprocess.Popen[bytes]] = []
    files: list[IO[bytes]] = []
    try:
        for cmd, log in zip(cmds, logs):
            f = open(log, "wb")
            files.append(f)
            procs.append(subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                                          start_new_session=True))
        deadline = time.monotonic() + timeout_s
        while True:
            codes = [p.poll() for p in procs]
            failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                r = failed[0]
                for p in procs:
                    _kill(p)
                for f in files:
                    f.flush()
                raise HpcckptError(f"bench --ranks: {what}: rank {r} of {len(procs)} exited with code "
                                   f"{codes[r]}; its last output lines ({logs[r]}):\n{_tail(logs[r])}")
            if all(c == 0 for c in codes):
                return
            if time.monotonic() > deadline:
                stuck = [r for r, c in enumerate(codes) if c is None]
                raise HpcckptError(f"bench --ranks: {what}: ranks {stuck} still running after {timeout_s:.0f} s "
                                   f"(a hang; ended them); rank {stuck[0]}'s last output lines:\n{_tail(logs[stuck[0]])}")
            time.sleep(poll_s)
    finally:
        for p in procs:
            _kill(p)
        for f in files:
            f.close()


def _one_world(o: RanksOptions, engine: str, world: int, base: Path) -> dict[str, Any]:
    """Start ``world`` ranks saving with ``engine``; their figures and the committed manifest's."""
    from ..demo.runtime import module_cmd
    from ..store import catalog, placement

    root, out = base / f"{engine}-{world}" / "ckpt", base / f"{engine}-{world}"
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    direct = [] if o.direct is None else ["--direct", "1" if o.direct else "0"]
    cmds = [[*module_cmd("hpcckpt.bench.rankproc"), "--rank", str(r), "--world", str(world), "--port", str(port),
             "--dir", str(root), "--engine", engine, "--size-bytes", str(o.size_bytes), "--rounds", str(o.rounds),
             "--out", str(out / f"result-r{r}.json"), *direct] for r in range(world)]
    logs = [out / f"log-r{r}.txt" for r in range(world)]
    run_procs(cmds, logs, what=f"{engine} engine on {world} rank{'s' if world > 1 else ''}", env=rank_env(),
              timeout_s=600 + 600 * o.size_bytes / GB)
    results = [json.loads((out / f"result-r{r}.json").read_text()) for r in range(world)]
    slowest = [max(res["persist_s"][k] for res in results) for k in range(o.rounds)]
    manifest = catalog.find(root, None).manifest or {}
    per_rank_map = placement.written_bytes(manifest)
    per_rank = [per_rank_map[r] for r in sorted(per_rank_map)]
    state = placement.state_bytes(manifest)
    total = sum(per_rank)
    persist = statistics.median(slowest)
    shutil.rmtree(out, ignore_errors=True)  # the next run's disk room
    return {"persist_s": persist, "persist_all_s": slowest, "bytes_per_checkpoint": total,
            "bytes_per_rank": per_rank, "share_per_rank": [b / state for b in per_rank], "state_bytes": state,
            "persist_gbps": total / persist / GB if persist > 0 else None,
            "format": manifest.get("format"), "world_size": manifest.get("world_size")}


def run_ranks(o: RanksOptions, progress: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Measure each engine at 1 and ``o.ranks`` ranks; return the result tree (see the module doc)."""
    import torch

    base = Path(tempfile.mkdtemp(prefix="hpcckpt-bench-ranks-", dir=o.dir))
    worlds = (1, o.ranks)
    total, done, t0 = len(ENGINES) * len(worlds), 0, time.monotonic()
    progress(f"[bench --ranks] {o.ranks} local ranks (gloo, CPU), state {o.size_bytes / GB:.3f} GB, "
             f"{o.rounds} round{'s' if o.rounds > 1 else ''}, files under {base}")
    engines: dict[str, Any] = {}
    try:
        for engine in ENGINES:
            row: dict[str, Any] = {}
            for world in worlds:
                fig = row[str(world)] = _one_world(o, engine, world, base)
                done += 1
                progress(f"[bench --ranks {time.monotonic() - t0:6.1f}s {done}/{total}] {engine} on {world} "
                         f"rank{'s' if world > 1 else ''}: persist {fig['persist_s']:.3f} s, "
                         f"{fig['bytes_per_checkpoint'] / 1e6:.1f} MB written "
                         f"({', '.join(f'{b / 1e6:.1f}' for b in fig['bytes_per_rank'])} MB per rank)")
            one, many = row["1"], row[str(o.ranks)]
            row["bytes_vs_state"] = many["bytes_per_checkpoint"] / many["state_bytes"]
            row["persist_vs_1_rank"] = many["persist_s"] / one["persist_s"] if one["persist_s"] > 0 else None
            engines[engine] = row
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return {
        "ranks": o.ranks,
        "state_bytes": engines["sync"]["1"]["state_bytes"],
        "engines": engines,
        "machine": {"cpus": os.cpu_count(), "dir": str(o.dir or tempfile.gettempdir()), "torch": torch.__version__},
        "options": {"size_bytes": o.size_bytes, "rounds": o.rounds, "quick": o.quick, "direct": o.direct},
    }


def text(res: dict[str, Any]) -> str:
    """A short table for humans."""
    n = res["ranks"]
    lines = [f"{n} local ranks vs 1 (DDP + Adam, gloo on CPU): state {res['state_bytes'] / 1e6:.1f} MB, "
             f"median of {res['options']['rounds']} round(s) of the slowest rank",
             f"{'engine':<11}{'ranks':>6}{'persist s':>11}{'vs 1 rank':>11}{'written MB':>12}{'vs state':>10}"
             "  per rank MB (share of state)"]
    for name, row in res["engines"].items():
        for world in ("1", str(n)):
            e = row[world]
            vs1 = 1.0 if world == "1" else row["persist_vs_1_rank"]
            shares = ", ".join(f"{b / 1e6:.1f}" for b in e["bytes_per_rank"])
            lo, hi = min(e["share_per_rank"]), max(e["share_per_rank"])
            share = f"{100 * lo:.1f}%" if abs(hi - lo) < 5e-4 else f"{100 * lo:.1f}-{100 * hi:.1f}%"
            lines.append(f"{name:<11}{world:>6}{e['persist_s']:>11.3f}"
                         f"{'n/a' if vs1 is None else format(vs1, '.2f'):>11}"
                         f"{e['bytes_per_checkpoint'] / 1e6:>12.1f}"
                         f"{e['bytes_per_checkpoint'] / e['state_bytes']:>10.2f}  {shares} ({share})")
    lines.append("the ranks share this machine's disk and cores: the persist ratio shows how the write splits, "
                 "not how a parallel file system scales with nodes")
    return "\n".join(lines)
