"""``hpcckpt demo``: train once uninterrupted, once with preemptions; compare bit for bit.

The preempted run goes through the real path: a SIGUSR2 sent from outside at a
random step, the recording handler, the final checkpoint at the next boundary,
exit 75, a restart by the local supervisor (or Slurm), restore, resume.
"""
from __future__ import annotations

import json
import random
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import DEFAULT_ENGINE
from ..errors import ConfigError, HpcckptError
from ..lifecycle.ledger import Ledger
from ..lifecycle.restart import LocalSupervisor
from .runtime import child_env, module_cmd, work_dir


@dataclass(frozen=True, kw_only=True)
class DemoOptions:
    engine: str = DEFAULT_ENGINE
    seed: int = 0
    steps: int = 60
    preemptions: int = 1
    preempt_at: tuple[int, ...] = ()
    every: int = 10
    dir: Path | None = None
    plot: bool = True
    step_sleep: float = 0.02
    device: str = "cpu"

    def __post_init__(self) -> None:
        """Refuse options that would make the demo prove nothing (see ``check_options``)."""
        check_options(self)


def check_options(o: DemoOptions) -> None:
    """Every preemption must land inside the run and leave steps to resume."""
    if o.steps < 1:
        raise ConfigError(f"--steps {o.steps}: the demo needs at least one step (e.g. --steps 60)")
    if o.every < 1:
        raise ConfigError(f"--every {o.every}: the checkpoint interval is at least 1 step (e.g. --every 10)")
    if o.preemptions < 1:
        raise ConfigError(f"--preemptions {o.preemptions}: the demo preempts at least once (e.g. --preemptions 1)")
    if o.engine not in ("sync", "concurrent"):
        raise ConfigError(f"--engine {o.engine!r}: use sync or concurrent (e.g. --engine concurrent)")
    if o.device not in ("cpu", "cuda"):
        raise ConfigError(f"--device {o.device!r}: use cpu or cuda (e.g. --device cpu)")
    bad = [s for s in o.preempt_at if not 1 <= s < o.steps]
    if bad:
        raise ConfigError(f"--preempt-at {','.join(map(str, bad))}: each step must lie in 1..{o.steps - 1} "
                          f"(the run has --steps {o.steps}); e.g. --preempt-at {max(1, o.steps // 2)}")
    if not o.preempt_at:
        room = _random_range(o.steps)
        if len(room) < o.preemptions:
            raise ConfigError(f"--preemptions {o.preemptions} at random steps needs --steps of at least "
                              f"{o.preemptions + 5} (got --steps {o.steps}); e.g. --steps 60 --preemptions "
                              f"{o.preemptions}, or pick the steps with --preempt-at")


def read_trace(path: Path) -> dict[int, str]:
    out: dict[int, str] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line being written right now
            out[int(rec["step"])] = rec["loss"]
    return out


def train_cmd(run_dir: Path, o: DemoOptions, *extra: str) -> list[str]:
    """The training child; the working directory is not on its import path (``module_cmd``)."""
    return [*module_cmd("hpcckpt.demo.train"), "--dir", str(run_dir), "--steps", str(o.steps),
            "--seed", str(o.seed), "--engine", o.engine, "--every", str(o.every),
            "--step-sleep", str(o.step_sleep), "--device", o.device, *extra]


def _random_range(steps: int) -> range:
    """Steps a random preemption may target: never the first two or the last three."""
    return range(2, steps - 3)


def pick_preempt_steps(o: DemoOptions) -> list[int]:
    if o.preempt_at:
        return sorted(set(o.preempt_at))
    rng = random.Random(o.seed * 7919 + 17)
    return sorted(rng.sample(_random_range(o.steps), k=o.preemptions))


def run_preempted(run_dir: Path, o: DemoOptions, targets: list[int],
                  progress: Callable[[str], None]) -> tuple[int, list[int]]:
    """Run under the local supervisor, signalling when the trace reaches each target."""
    trace = run_dir / "trace.jsonl"
    sent: list[int] = []
    sup = LocalSupervisor(train_cmd(run_dir, o), max_restarts=len(targets) + 2, env=child_env(o.device))
    done = threading.Event()

    def watcher() -> None:
        pending = list(targets)
        while pending and not done.is_set():
            have = read_trace(trace)
            if have and max(have) + 1 >= pending[0] and sup.signal(signal.SIGUSR2):
                sent.append(max(have) + 1)
                progress(f"sent SIGUSR2 at step {max(have) + 1}")
                pending.pop(0)
                # wait for the restart before aiming at the next target
                restarts = sup.restarts
                while not done.is_set() and sup.restarts == restarts:
                    time.sleep(0.02)
            time.sleep(0.01)

    t = threading.Thread(target=watcher, daemon=True)
    t.start()
    code = sup.run()
    done.set()
    t.join()
    return code, sent


def compare_params(a: Path, b: Path) -> float:
    import torch
    pa = torch.load(a, weights_only=True)
    pb = torch.load(b, weights_only=True)
    if pa.keys() != pb.keys():
        return float("inf")
    return max((float((pa[k].double() - pb[k].double()).abs().max()) if pa[k].numel() else 0.0) for k in pa)


def plot(path: Path, ref: dict[int, str], got: dict[int, str], resumed: list[int]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = sorted(ref)
    ax.plot(xs, [float.fromhex(ref[s]) for s in xs], label="uninterrupted", lw=3, alpha=0.5)
    ys = sorted(got)
    ax.plot(ys, [float.fromhex(got[s]) for s in ys], label="preempted + resumed", lw=1, ls="--")
    for r in resumed:
        ax.axvline(r, color="red", lw=0.8, alpha=0.6)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("hpcckpt demo: loss curves (red: resumed from checkpoint)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


class DemoFailed(HpcckptError):
    """A demo child failed before there was anything to compare."""


def run_demo(o: DemoOptions, progress: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    base = work_dir(Path(o.dir)) if o.dir else Path(tempfile.mkdtemp(prefix="hpcckpt-demo-"))
    ref_dir, run_dir = base / "reference", base / "preempted"
    for d in (ref_dir, run_dir):
        shutil.rmtree(d, ignore_errors=True)
    progress(f"reference run: {o.steps} steps on {o.device} without interruption")
    ref_code = subprocess.run(train_cmd(ref_dir, o, "--no-checkpoint"), env=child_env(o.device),
                              check=False).returncode
    if ref_code != 0:
        raise DemoFailed(f"the reference run in {ref_dir} exited with status {ref_code} (its error is above)")
    targets = pick_preempt_steps(o)
    progress(f"preempted run: {o.engine} engine on {o.device}, SIGUSR2 at steps {targets}")
    code, sent = run_preempted(run_dir, o, targets, progress)
    ref, got = read_trace(ref_dir / "trace.jsonl"), read_trace(run_dir / "trace.jsonl")
    events = Ledger(run_dir / "ckpt").read()
    resumed = [e["resumed_from"] for e in events if e["event"] == "start" and e.get("resumed_from") is not None]
    stops = [e["step"] for e in events if e["event"] == "stop" and e.get("requeue")]
    ref_res = json.loads((ref_dir / "result.json").read_text())
    got_res = json.loads((run_dir / "result.json").read_text()) if (run_dir / "result.json").exists() else {}
    diff = compare_params(ref_dir / "final.pt", run_dir / "final.pt") if got_res else float("inf")
    # Identical means something only if every preemption really happened and was resumed.
    identical = (code == 0 and ref == got and len(ref) == o.steps and len(stops) == len(targets)
                 and resumed == stops and got_res.get("param_digest") == ref_res["param_digest"] and diff == 0.0)
    result = {
        "identical": identical, "steps": o.steps, "engine": o.engine, "seed": o.seed, "device": o.device,
        "preempted_at": stops, "signalled_at": sent, "resumed_from": resumed,
        "max_abs_param_diff": diff, "losses_equal": ref == got,
        "param_digest": got_res.get("param_digest"), "reference_digest": ref_res["param_digest"],
        "exit_code": code, "dir": str(base), "preemptions_requested": len(targets),
    }
    if len(stops) < len(targets):
        result["note"] = (f"only {len(stops)} of {len(targets)} preemptions stopped the run before it ended, so "
                          "nothing was proven for the others; pick earlier steps with --preempt-at")
    if o.plot:
        plot(base / "loss.png", ref, got, resumed)
        result["plot"] = str(base / "loss.png")
    return result
