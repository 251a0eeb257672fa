"""A small state saved at every step: the per-save fixed cost of each engine.

A ~3 MB model + AdamW (``PeerRig``) whose step is brought to ~6 ms by the batch's rows
(calibrated here, one torch thread; the step actually measured is ``step_s``), trained
``steps`` steps without checkpoints and ``steps`` with a checkpoint at every step, per
engine, in alternating blocks of ``BLOCK_STEPS`` steps with the engine alive throughout
(``_blocks``), ``rounds`` times, in one child process (``isolate``). Each save is
admitted by the engine itself, as in a user's loop (``run_steps(own_admission=True)``). Per engine:
``overhead`` (median over rounds of the steps with checkpoints / the steps without - 1;
each block with checkpoints counts until its last save is durable), ``per_save_ms`` (the
extra time per save: what a save costs beyond its bytes, since at this size the bytes
cost almost nothing), ``blocked_per_save_ms`` (time the training thread itself was
blocked per save), ``drain_s`` (closing the engine), and where the time went in CPU time, which
the machine's other load moves far less than wall time: ``cpu_per_save_ms`` (this process's CPU,
all its threads, in the steps with checkpoints beyond those without, per save) and of it
``training_cpu_per_save_ms`` (the training thread's own: capture, ``save()``, the pre-hook;
the rest is the engine's threads: copies, checksums, writes, the commit). On a CPU, ``floor`` is measured the
same way beside them (``bench.floor``: the state copied on the training thread, written and
fdatasynced by another process, nothing else): what a save at every step costs here at
the least, so that an engine's figure reads against this machine rather than against zero.
"""
from __future__ import annotations

import resource
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from .floor import Floor
from .methods import HPCCKPT, make_method
from .peers import _train, run_steps
from .synthetic import PeerRig

SMALL_BYTES = 3_000_000
STEP_S = 0.006
MAX_ROWS = {"cpu": 1 << 16, "cuda": 1 << 20}  # a GPU needs far more rows for the same step time
ROUNDS = 3
BLOCK_STEPS = 50  # steps without and with checkpoints alternate in blocks of this many


def _step_s(rig: PeerRig, n: int = 3) -> float:
    rig.step()
    t0 = time.perf_counter()
    for _ in range(n):
        rig.step()
    rig.sync()
    return (time.perf_counter() - t0) / n


CALIBRATE_STEPS = 15  # steps per timing while calibrating (3 landed 4.3-7.4 ms for a 6 ms target)


def calibrate(rig: PeerRig, target_s: float) -> float:
    """Double the batch's rows until a step takes ``target_s``, then interpolate between the
    last two (a doubling overshoots by up to 2x) and correct twice more between the nearest
    timings on either side; returns the step time reached."""
    took = _step_s(rig)
    below = (rig.rows, took)
    while took < target_s and rig.rows < MAX_ROWS[rig.device]:
        below = (rig.rows, took)
        rig.rows *= 2
        took = _step_s(rig)
    if took <= target_s:
        return took
    above = (rig.rows, took)
    for _ in range(3):
        (lo_rows, lo_s), (hi_rows, hi_s) = below, above
        if hi_rows - lo_rows <= 1 or hi_s <= lo_s:
            break
        rig.rows = min(hi_rows - 1, max(lo_rows + 1, round(lo_rows + (hi_rows - lo_rows) * (target_s - lo_s)
                                                             / (hi_s - lo_s))))
        took = _step_s(rig, CALIBRATE_STEPS)
        if abs(took / target_s - 1) < 0.05:
            break
        if took < target_s:
            below = (rig.rows, took)
        else:
            above = (rig.rows, took)
    return took


def _process_cpu_s() -> float:
    """User + system CPU seconds of this process, all its threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _blocks(rig: PeerRig, name: str, steps: int, block: int, root: Path,
            options: dict[str, Any], cpu: dict[str, float] | None = None) -> tuple[float, float, float, float]:
    """``steps`` steps without checkpoints and ``steps`` with one at every step, in blocks of
    ``block`` steps taken in turn (ABBA: neither kind always goes first), one engine alive
    throughout; returns (seconds without, seconds with, seconds of them blocked, final drain).
    A block with checkpoints ends when its last save is durable (counted in it), so the
    next block starts with the engine idle. Host noise that lasts a second or two (the
    2-core VM's baseline varied 0.8-1.9 s for the same 200 steps from round to round)
    then falls on both kinds alike. ``cpu`` (if given) gets the process's and the training
    thread's CPU seconds in the blocks with checkpoints and in those without added
    (``process_with``, ``process_without``, ``training_with``, ``training_without``)."""
    m = Floor(root, rig) if name == "floor" else make_method(name, root, rig, options)
    without = with_ = blocked = 0.0
    try:
        for b in range(-(-steps // block)):
            first, last = b * block + 1, min((b + 1) * block, steps)
            for saving in ((False, True) if b % 2 == 0 else (True, False)):
                p0, t0 = _process_cpu_s(), time.thread_time()
                took, waited, pending = run_steps(rig, m if saving else None, first, last, 1, own_admission=True)
                if pending is not None:
                    t1 = time.perf_counter()
                    m.persist_s(pending)
                    waited += time.perf_counter() - t1
                    took += time.perf_counter() - t1
                if cpu is not None:
                    kind = "with" if saving else "without"
                    cpu[f"process_{kind}"] = cpu.get(f"process_{kind}", 0.0) + _process_cpu_s() - p0
                    cpu[f"training_{kind}"] = cpu.get(f"training_{kind}", 0.0) + time.thread_time() - t0
                blocked += waited
                if saving:
                    with_ += took
                else:
                    without += took
        t1 = time.perf_counter()
        blocked += m.hook_wait_s()
    finally:
        m.close()
        shutil.rmtree(root, ignore_errors=True)
    return without, with_, blocked, time.perf_counter() - t1


def child_small_state(names: list[str], steps: int, rounds: int, state_bytes: int, target_step_s: float,
                      root: str, options: dict[str, Any], device: str = "cpu") -> dict[str, Any]:
    # One intra-op thread: for a model this small, a second OpenMP thread spins more than it
    # helps (as for the quick overhead model), and the engine's own threads need the cores.
    torch.set_num_threads(1)
    rig = PeerRig(state_bytes, device=device)
    calibrate(rig, target_step_s)
    got: dict[str, dict[str, list[float]]] = {n: {"base": [], "wall": [], "blocked": [], "drain": [], "cpu": [],
                                                  "training_cpu": []} for n in names}
    _train(rig, names[-1], 1, min(steps, 5), Path(root) / "warm", options)  # warm-up, untimed
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            cpu: dict[str, float] = {}
            base, wall, blocked, drain = _blocks(rig, name, steps, BLOCK_STEPS, Path(root) / name, options, cpu)
            for key, value in (("base", base), ("wall", wall), ("blocked", blocked), ("drain", drain),
                               ("cpu", cpu["process_with"] - cpu["process_without"]),
                               ("training_cpu", cpu["training_with"] - cpu["training_without"])):
                got[name][key].append(value)
    engines = {}
    for name, g in got.items():
        engines[HPCCKPT.get(name, name)] = {
            "overhead": statistics.median(w / b - 1 for w, b in zip(g["wall"], g["base"])),
            "per_save_ms": 1e3 * statistics.median((w - b) / steps for w, b in zip(g["wall"], g["base"])),
            "blocked_per_save_ms": 1e3 * statistics.median(x / steps for x in g["blocked"]),
            "drain_s": statistics.median(g["drain"]), "wall_all_s": g["wall"], "baseline_all_s": g["base"],
            "cpu_per_save_ms": 1e3 * statistics.median(x / steps for x in g["cpu"]),
            "training_cpu_per_save_ms": 1e3 * statistics.median(x / steps for x in g["training_cpu"])}
    base_all = [b for g in got.values() for b in g["base"]]
    return {"state_bytes": rig.state_bytes, "device": device, "target_step_s": target_step_s,
            "step_s": statistics.median(base_all) / steps, "rows": rig.rows,
            "torch_threads": 1, "steps": steps, "every": 1, "rounds": rounds, "block_steps": BLOCK_STEPS,
            "baseline_all_s": base_all, "engines": engines}


def measure_small_state(root: Path, options: dict[str, Any], *, quick: bool, device: str = "cpu",
                        state_bytes: int = SMALL_BYTES, step_s: float = STEP_S) -> dict[str, Any]:
    """``child_small_state`` for both engines (and the floor, on a CPU) in a child of its own;
    the state on ``device``."""
    from .isolate import run_isolated
    names = (["floor"] if device == "cpu" else []) + ["hpcckpt_sync", "hpcckpt_concurrent"]
    return run_isolated(child_small_state, names, 30 if quick else 200, 1 if quick else ROUNDS, state_bytes, step_s,
                        str(root), options, device)


def summary(small: dict[str, Any]) -> str:
    """One line of ``child_small_state``'s result (the CLI's text and the bench's progress)."""
    return (f"small state {small['state_bytes'] / 1e6:.1f} MB on {small.get('device', 'cpu')}, "
            f"{1e3 * small['step_s']:.1f} ms steps, saved every step: "
            + ", ".join(f"{n} +{100 * e['overhead']:.0f}% ({e['per_save_ms']:.1f} ms per save, "
                        f"blocked {e['blocked_per_save_ms']:.1f} ms, CPU {e['cpu_per_save_ms']:.1f} ms of which "
                        f"training thread {e['training_cpu_per_save_ms']:.1f})" for n, e in small["engines"].items()))


def parse_small(raw: str) -> tuple[int, float]:
    """``--small-state MB,MS``: the state's size in MB and the step time in ms (both above zero)."""
    from ..errors import ConfigError
    parts = [x.strip() for x in raw.split(",")]
    try:
        mb, ms = (float(x) for x in parts)
    except ValueError:
        raise ConfigError(f"--small-state {raw!r}: give the state in MB and the step in ms, e.g. "
                          "--small-state 1.4,19 (or no value: 3 MB, 6 ms)") from None
    if not (0.01 <= mb <= 1000) or not (0.1 <= ms <= 10_000):
        raise ConfigError(f"--small-state {raw!r}: the state must be 0.01-1000 MB and the step 0.1-10000 ms "
                          "(e.g. --small-state 1.4,19)")
    return int(mb * 1e6), ms / 1e3
