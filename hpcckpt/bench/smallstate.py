"""A small state saved at every step: the per-save fixed cost of each engine.

A ~3 MB model + AdamW (``PeerRig``) whose step is brought to ~6 ms by the batch's rows
(calibrated here, one torch thread; the step actually measured is ``step_s``), trained
``steps`` steps without checkpoints and with a checkpoint at every step, per engine,
interleaved, ``rounds`` times, in one child process (``isolate``). Per engine:
``overhead`` (median over rounds of steps time / that round's baseline - 1, the final
drain apart in ``drain_s``), ``per_save_ms`` (the extra time per save: what a save
costs beyond its bytes, since at this size the bytes cost almost nothing) and
``blocked_per_save_ms`` (time the training thread itself was blocked per save).
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch

from .methods import HPCCKPT
from .peers import _train
from .synthetic import PeerRig

SMALL_BYTES = 3_000_000
STEP_S = 0.006
MAX_ROWS = 1 << 16


def _step_s(rig: PeerRig, n: int = 3) -> float:
    rig.step()
    t0 = time.perf_counter()
    for _ in range(n):
        rig.step()
    rig.sync()
    return (time.perf_counter() - t0) / n


def calibrate(rig: PeerRig, target_s: float) -> float:
    """Double the batch's rows until a step takes ``target_s``, then interpolate between the
    last two (a doubling overshoots by up to 2x); returns the step time reached."""
    took = _step_s(rig)
    below = (rig.rows, took)
    while took < target_s and rig.rows < MAX_ROWS:
        below = (rig.rows, took)
        rig.rows *= 2
        took = _step_s(rig)
    rows, low = below
    if took > target_s > low and rig.rows > rows:
        rig.rows = max(rows, round(rows + (rig.rows - rows) * (target_s - low) / (took - low)))
        took = _step_s(rig)
    return took


def child_small_state(names: list[str], steps: int, rounds: int, state_bytes: int, target_step_s: float,
                      root: str, options: dict[str, Any]) -> dict[str, Any]:
    # One intra-op thread: for a model this small, a second OpenMP thread spins more than it
    # helps (as for the quick overhead model), and the engine's own threads need the cores.
    torch.set_num_threads(1)
    rig = PeerRig(state_bytes)
    calibrate(rig, target_step_s)
    base: list[float] = []
    got: dict[str, dict[str, list[float]]] = {n: {"wall": [], "blocked": [], "drain": []} for n in names}
    _train(rig, names[-1], 1, min(steps, 5), Path(root) / "warm", options)  # warm-up, untimed
    for r in range(rounds):
        base.append(_train(rig, None, 1, steps, Path(root), options)[0])
        for name in names[r % len(names):] + names[:r % len(names)]:
            wall, blocked, drain = _train(rig, name, 1, steps, Path(root) / name, options)
            got[name]["wall"].append(wall)
            got[name]["blocked"].append(blocked)
            got[name]["drain"].append(drain)
    engines = {}
    for name, g in got.items():
        engines[HPCCKPT[name]] = {
            "overhead": statistics.median(w / b - 1 for w, b in zip(g["wall"], base)),
            "per_save_ms": 1e3 * statistics.median((w - b) / steps for w, b in zip(g["wall"], base)),
            "blocked_per_save_ms": 1e3 * statistics.median(x / steps for x in g["blocked"]),
            "drain_s": statistics.median(g["drain"]), "wall_all_s": g["wall"]}
    return {"state_bytes": rig.state_bytes, "step_s": statistics.median(base) / steps, "rows": rig.rows,
            "torch_threads": 1,
            "steps": steps, "every": 1, "rounds": rounds, "baseline_all_s": base, "engines": engines}


def measure_small_state(root: Path, options: dict[str, Any], *, quick: bool) -> dict[str, Any]:
    """``child_small_state`` for both engines in a child of its own."""
    from .isolate import run_isolated
    names = ["hpcckpt_sync", "hpcckpt_concurrent"]
    return run_isolated(child_small_state, names, 30 if quick else 200, 1 if quick else 3, SMALL_BYTES, STEP_S,
                        str(root), options)
