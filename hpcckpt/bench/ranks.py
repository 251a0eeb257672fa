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
  committed manifest (``shared.written_bytes`` / ``shared.state_bytes``);
- ``share_per_rank``: ``bytes_per_rank / state_bytes``;

and per engine ``bytes_vs_state`` (at N ranks) and ``persist_vs_1_rank``
(``persist_s`` at N over ``persist_s`` at 1). The ranks of one machine share its
disk and cores, so the persist ratio measures how the write splits, not how a
parallel file system scales with nodes.

Then the steady-state cost of ``jit=True`` with no failure (``run_jit``): N fresh ranks
train the same small DDP model (``rankproc.JIT_*``, tens of milliseconds a step here)
through ``Checkpointer(dir, engine="concurrent", every_steps=None, jit=False)`` and then
``jit=True``, in the same processes on the same model and data stream, ``jit_rounds``
times (the arm that runs first alternates by round); each arm skips ``jit_warmup``
steps, then times ``jit_steps`` steps with their boundaries. Per round the arm's time
is the slowest rank's and the overhead is ``(on - off) / off``; ``overhead`` is the
median over rounds; ``cpu_overhead`` the median over rounds of the same ratio on the
CPU time the ranks' processes used over the timed steps (every thread, the heartbeat's
included): on a machine whose cores other work shares, wall-clock rounds vary by
several percent and the CPU time is the steadier figure; ``guard_cpu_share`` the median
share of the jit=True arm's CPU time that the guard itself used (its boundary copies,
its heartbeat thread and that thread's gloo group: a direct figure, not a difference); ``step_s_off``/``step_s_on`` the median per-step times, and
``boundary_s`` the median time of the guard's own work at a step boundary
(``JitGuard.at_boundary``, timed around the call) with ``boundary_vs_step`` its share
of a step. The heartbeat thread's cost shows only in the overhead.
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from ..cluster.env import without_slurm
from ..errors import ConfigError, HpcckptError
from .limits import GB

ENGINES = ("sync", "concurrent")
DEFAULT_GB = 0.5  # N ranks each hold the whole state (DDP): N x this in memory
QUICK_GB = 0.016
DEFAULT_ROUNDS = 3
# The JIT overhead: rounds of (jit off, jit on), timed steps per arm, untimed warm-up steps per arm.
JIT_ROUNDS, JIT_STEPS, JIT_WARMUP = 10, 30, 5
QUICK_JIT_ROUNDS, QUICK_JIT_STEPS, QUICK_JIT_WARMUP = 2, 15, 3
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
    jit_rounds: int = JIT_ROUNDS
    jit_steps: int = JIT_STEPS
    jit_warmup: int = JIT_WARMUP

    @staticmethod
    def make(*, ranks: int, size_gb: float | None, dir: Path | None, quick: bool,
             direct: bool | None = None) -> RanksOptions:
        from . import check_size_gb
        if ranks < 2:
            raise ConfigError(f"--ranks {ranks}: give 2 or more ranks (1 rank is always measured as the "
                              "baseline), e.g. --ranks 4")
        size = check_size_gb(size_gb) or (QUICK_GB if quick else DEFAULT_GB)
        return RanksOptions(ranks=ranks, size_bytes=int(size * GB), rounds=1 if quick else DEFAULT_ROUNDS,
                            dir=dir, quick=quick, direct=direct,
                            jit_rounds=QUICK_JIT_ROUNDS if quick else JIT_ROUNDS,
                            jit_steps=QUICK_JIT_STEPS if quick else JIT_STEPS,
                            jit_warmup=QUICK_JIT_WARMUP if quick else JIT_WARMUP)


def check_room(o: RanksOptions, directory: Path) -> None:
    """Refuse a size this file system or this host's memory cannot hold, before starting any rank."""
    from . import require_room
    require_room(directory, o.size_bytes, disk_factor=DISK_FACTOR, option=f" --ranks {o.ranks}",
                 memory_bytes=MEMORY_FACTOR * o.ranks * o.size_bytes,
                 memory_what="every rank's whole state, its gradients and a staging copy",
                 other_fix=" or fewer --ranks")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_env() -> dict[str, str]:
    """This environment without Slurm's variables (local ranks, not a job step), one thread per rank."""
    env = without_slurm(os.environ)
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
                for out in files:
                    out.flush()
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
        for out in files:
            out.close()


def _one_world(o: RanksOptions, engine: str, world: int, base: Path) -> dict[str, Any]:
    """Start ``world`` ranks saving with ``engine``; their figures and the committed manifest's."""
    from ..demo.runtime import module_cmd
    from ..store import catalog, shared

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
    per_rank_map = shared.written_bytes(manifest)
    per_rank = [per_rank_map[r] for r in sorted(per_rank_map)]
    state = shared.state_bytes(manifest)
    total = sum(per_rank)
    persist = statistics.median(slowest)
    shutil.rmtree(out, ignore_errors=True)  # the next run's disk room
    return {"persist_s": persist, "persist_all_s": slowest, "bytes_per_checkpoint": total,
            "bytes_per_rank": per_rank, "share_per_rank": [b / state for b in per_rank], "state_bytes": state,
            "persist_gbps": total / persist / GB if persist > 0 else None,
            "format": manifest.get("format"), "world_size": manifest.get("world_size")}


def run_jit(o: RanksOptions, base: Path) -> dict[str, Any]:
    """The steady-state overhead of ``jit=True`` on ``o.ranks`` ranks (see the module doc)."""
    from ..demo.runtime import module_cmd
    from . import rankproc

    world, out = o.ranks, base / "jit"
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    cmds = [[*module_cmd("hpcckpt.bench.rankproc"), "--rank", str(r), "--world", str(world), "--port", str(port),
             "--dir", str(out / "ckpt"), "--rounds", str(o.jit_rounds), "--jit-steps", str(o.jit_steps),
             "--jit-warmup", str(o.jit_warmup), "--out", str(out / f"result-r{r}.json")] for r in range(world)]
    logs = [out / f"log-r{r}.txt" for r in range(world)]
    env = {k: v for k, v in rank_env().items() if not k.startswith("HPCCKPT_JIT")}  # the bench sets jit itself
    run_procs(cmds, logs, what=f"jit=False against jit=True on {world} ranks", env=env,
              timeout_s=600 + 4 * o.jit_rounds * (o.jit_steps + o.jit_warmup))
    results = [json.loads((out / f"result-r{r}.json").read_text())["jit"] for r in range(world)]
    shutil.rmtree(out, ignore_errors=True)
    per_round = []
    for k in range(o.jit_rounds):
        off = max(res["off_s"][k] for res in results)
        on = max(res["on_s"][k] for res in results)
        cpu_off = sum(res["off_cpu_s"][k] for res in results)
        cpu_on = sum(res["on_cpu_s"][k] for res in results)
        guard = sum(res["guard_cpu_s"][k] for res in results)
        per_round.append({"round": k, "first": "off" if k % 2 == 0 else "on", "off_s": off, "on_s": on,
                          "overhead": (on - off) / off,
                          "cpu_overhead": cpu_on / cpu_off - 1.0 if cpu_off > 0 else None,
                          "guard_cpu_share": guard / cpu_on if cpu_on > 0 else None,
                          "guard_cpu_s_per_step": guard / world / o.jit_steps,
                          "boundary_s": max(res["boundary_s"][k] for res in results),
                          "heartbeats": min(res["heartbeats"][k] for res in results)})
    step_off = statistics.median(r["off_s"] for r in per_round) / o.jit_steps
    step_on = statistics.median(r["on_s"] for r in per_round) / o.jit_steps
    boundary = statistics.median(r["boundary_s"] for r in per_round)
    return {"world": world, "steps": o.jit_steps, "rounds": o.jit_rounds, "warmup": o.jit_warmup,
            "engine": "concurrent", "every_steps": None,
            "model": {"width": rankproc.JIT_WIDTH, "layers": rankproc.JIT_LAYERS, "rows": rankproc.JIT_ROWS},
            "step_s_off": step_off, "step_s_on": step_on,
            "overhead": statistics.median(r["overhead"] for r in per_round),
            "overhead_min": min(r["overhead"] for r in per_round),
            "overhead_max": max(r["overhead"] for r in per_round),
            "cpu_overhead": statistics.median(r["cpu_overhead"] for r in per_round if r["cpu_overhead"] is not None)
            if any(r["cpu_overhead"] is not None for r in per_round) else None,
            "guard_cpu_s_per_step": statistics.median(r["guard_cpu_s_per_step"] for r in per_round),
            "guard_cpu_share": statistics.median(r["guard_cpu_share"] for r in per_round
                                                 if r["guard_cpu_share"] is not None)
            if any(r["guard_cpu_share"] is not None for r in per_round) else None,
            "boundary_s": boundary, "boundary_vs_step": boundary / step_off if step_off > 0 else None,
            "per_round": per_round}


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
        progress(f"[bench --ranks {time.monotonic() - t0:6.1f}s] jit=False against jit=True on {o.ranks} ranks: "
                 f"{o.jit_rounds} rounds of {o.jit_steps} timed steps per arm (after {o.jit_warmup} warm-up steps)")
        jit = run_jit(o, base)
        progress(f"[bench --ranks {time.monotonic() - t0:6.1f}s] jit overhead {100 * jit['overhead']:+.2f}% "
                 f"(median of {o.jit_rounds} rounds; step {1e3 * jit['step_s_off']:.1f} ms off, "
                 f"{1e3 * jit['step_s_on']:.1f} ms on)")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return {
        "ranks": o.ranks,
        "state_bytes": engines["sync"]["1"]["state_bytes"],
        "engines": engines,
        "jit": jit,
        "machine": {"cpus": os.cpu_count(), "dir": str(o.dir or tempfile.gettempdir()), "torch": torch.__version__},
        "options": {"size_bytes": o.size_bytes, "rounds": o.rounds, "quick": o.quick, "direct": o.direct,
                    "jit_rounds": o.jit_rounds, "jit_steps": o.jit_steps, "jit_warmup": o.jit_warmup},
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
    j = res.get("jit")
    if j:
        m = j["model"]
        pct = lambda v: "n/a" if v is None else f"{100 * v:+.2f}%"  # noqa: E731
        lines += [
            f"jit=True against jit=False on {j['world']} ranks, no failure (concurrent engine, every_steps=None; "
            f"DDP MLP {m['layers']}x{m['width']}, {m['rows']} rows a step), {j['rounds']} paired rounds of "
            f"{j['steps']} timed steps per arm after {j['warmup']} warm-up steps:",
            f"  wall-clock overhead {pct(j['overhead'])} (median; rounds {pct(j['overhead_min'])} to "
            f"{pct(j['overhead_max'])}: " + ", ".join(f"{100 * r['overhead']:+.1f}%" for r in j["per_round"])
            + f"); step {1e3 * j['step_s_off']:.2f} ms off, {1e3 * j['step_s_on']:.2f} ms on",
            f"  CPU time of the ranks {pct(j['cpu_overhead'])} (median); the guard's own: boundary copy "
            f"{1e3 * j['boundary_s']:.3f} ms a step ({100 * (j['boundary_vs_step'] or 0):.2f}% of a step), with its "
            f"heartbeat thread and gloo group {1e3 * j['guard_cpu_s_per_step']:.3f} ms a step per rank = "
            + ("n/a" if j["guard_cpu_share"] is None else f"{100 * j['guard_cpu_share']:.2f}%")
            + " of the ranks' CPU time",
        ]
    return "\n".join(lines)
