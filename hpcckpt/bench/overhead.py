"""Training-step overhead on the demo model at several checkpoint intervals.

Each run trains the demo's TinyLM (a larger configuration than ``hpcckpt demo``
uses, so a step does real work) for the same number of steps from the same seed;
the time includes waiting for the last checkpoint to be durable. The overhead is
``time / time_without_checkpoints - 1`` (see ``measure_overhead`` for how noise
from a shared machine is handled).

Arms are engine names, or a level arm of ``LEVEL_ARMS``: ``concurrent_local`` is the
concurrent engine with multi-level checkpoints on (``hpcckpt.levels``), a node-local
checkpoint at each interval (``local_every_steps=interval``, ``every_steps=None``: the
shared level is never drained during the run) in the directory ``measure_overhead``'s
``local`` names; one process, so no partner copy.
"""
from __future__ import annotations

import os
import shutil
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from ..config import engine_options
from ..demo.model import MarkovTokens, ModelConfig, TinyLM
from ..engines import Engine, SaveContext, SaveHandle, make_engine
from ..levels import Levels, Topology
from ..ranks import Ranks
from ..state import TrainState


@dataclass(frozen=True, kw_only=True)
class DemoLoad:
    d_model: int = 256
    n_layers: int = 4
    batch: int = 16
    samples: int = 512
    steps: int = 100
    seq_len: int = 64
    device: str = "cpu"
    threads: int = 0  # torch intra-op threads for the loop; 0: leave torch's setting

    @staticmethod
    def for_device(device: str, *, steps: int, quick: bool) -> DemoLoad:
        """The demo model at a size that gives each device real work per step.

        CUDA: d_model 1024 x 8 layers, batch 32 x 256 tokens (1.2 GB of fp32 + AdamW
        state, on the order of 100 ms per step on an H100): every 10 steps is about a
        second of compute, time enough for a disk of 1-2 GB/s to absorb one checkpoint; ``quick``: the demo's own small model, so
        that every interval still saves within seconds (this checks the path, not speed).
        """
        if quick:
            # One thread: on a loaded 2-core machine, two OpenMP threads on a model this
            # small ran 10-20x slower than one (spinning workers preempted), not faster.
            # Batch 8 x 32 tokens: a fifth of the CPU of 16 x 64 per step (0.6 s vs 3.0 s for
            # 50 steps), and the quick run's 7 x 50 steps were its largest phase.
            return DemoLoad(d_model=64, n_layers=2, batch=8, seq_len=32, steps=steps, device=device, threads=1)
        if device == "cuda":
            return DemoLoad(d_model=1024, n_layers=8, seq_len=256, batch=32, steps=steps, device=device)
        # Batch 8 x 64 tokens: about 90 ms a step on the 2-core VM (16 x 64: 170 ms), the same
        # 38 MB of state; a 10-step interval is still close to a second of training.
        return DemoLoad(batch=8, steps=steps)

    def state_bytes(self) -> int:
        """Parameters + AdamW's two moments, fp32 (counted on the meta device: no memory)."""
        cfg = ModelConfig(d_model=self.d_model, n_layers=self.n_layers, seq_len=self.seq_len)
        with torch.device("meta"):
            model = TinyLM(cfg)
        return 3 * sum(p.numel() * p.element_size() for p in model.parameters())


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


#: level arm -> its engine: node-local checkpoints at each interval (see the module doc)
LEVEL_ARMS = {"concurrent_local": "concurrent"}


def _node_local(shared: Path, local: Path, interval: int) -> Levels:
    """One rank on one node: node-local checkpoints every ``interval`` steps in ``local``,
    the shared level ``shared`` only at a stop (none in a bench run), no partner."""
    local.mkdir(mode=0o700, parents=True, exist_ok=True)
    return Levels(shared=shared, local=local, topo=Topology(0, ("bench",)), shared_every=None, keep=2,
                  local_keep=2, partner=False)


def _arm(engine_name: str, root: Path, options: dict[str, Any], local: Path | None,
         interval: int) -> tuple[Engine, Levels | None]:
    """The engine of an arm on a fresh ``root`` (a level arm: with its node-local level)."""
    shutil.rmtree(root, ignore_errors=True)
    kind = LEVEL_ARMS.get(engine_name, engine_name)
    levels: Levels | None = None
    if engine_name in LEVEL_ARMS:
        if local is None:
            raise ValueError(f"the level arm {engine_name!r} needs a node-local directory (local=...)")
        levels = _node_local(root, local / engine_name, interval)
    engine = make_engine(kind, SaveContext(root=levels.local if levels else root, keep=2, job={}, user={},
                                           levels=levels), Ranks(),
                         engine_options(**options) if kind == "concurrent" else None)
    return engine, levels


def _loop(load: DemoLoad, engine_name: str | None, interval: int, root: Path,
          options: dict[str, Any], local: Path | None = None) -> tuple[float, float, float]:
    """(seconds for the training steps, seconds of them training was blocked by
    checkpointing, seconds spent after the last step waiting for saves to be durable).

    The last wait is a one-off at the end of a job, not a per-step cost, so it is
    reported apart from the steady-state step time. ``local``: the node-local directory
    of a level arm (``LEVEL_ARMS``).
    """
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=load.d_model, n_layers=load.n_layers, seq_len=load.seq_len)
    data = MarkovTokens(load.samples, cfg.seq_len, cfg.vocab, seed=1)
    model = TinyLM(cfg).to(load.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = TrainState()
    state.register("model", model)
    state.register("optimizer", opt)
    engine, levels = (None, None) if engine_name is None else _arm(engine_name, root, options, local, interval)
    if engine is not None:
        engine.bind(state)
    loader = DataLoader(data, batch_size=load.batch, shuffle=True, drop_last=True)
    handles: list[SaveHandle] = []
    blocked = 0.0
    it = iter(loader)
    _sync(load.device)
    t0 = time.perf_counter()
    for step in range(1, load.steps + 1):
        try:
            batch = next(it)
        except StopIteration:
            it = iter(loader)
            batch = next(it)
        batch = batch.to(load.device, non_blocking=True)
        logits = model(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if engine is not None and step % interval == 0:
            t1 = time.perf_counter()
            handles.append(engine.save(state.capture(step=step), step))
            blocked += time.perf_counter() - t1
            handles = [h for h in handles if not h.wait(0)]
    _sync(load.device)
    t1 = time.perf_counter()
    for h in handles:
        h.wait()
    drain = time.perf_counter() - t1
    if engine is not None:
        blocked += float(getattr(getattr(engine, "stats", None), "hook_wait_s", 0.0))
        engine.close()
        shutil.rmtree(root, ignore_errors=True)
        if levels is not None:
            shutil.rmtree(levels.local, ignore_errors=True)
    return t1 - t0, blocked, drain


def measure_overhead(engines: list[str], intervals: list[int], root: Path, load: DemoLoad,
                     options: dict[str, Any], *, rounds: int = 5, tick: Any = lambda: None,
                     local: Path | None = None, rotate: bool = False) -> dict[str, Any]:
    """Interleaved runs (baseline, then every engine x interval), ``rounds`` times.

    ``engines`` may name level arms (``LEVEL_ARMS``; their node-local directories go
    under ``local``). ``rotate``: the engines' order turns by one each round, so that no
    arm always runs right after the same other one.

    ``overhead`` is the median over rounds of (steps time / that round's baseline - 1):
    each ratio compares runs a minute apart, so slow phases of a shared machine cancel
    out instead of landing on one configuration. ``overhead_min`` compares fastest with
    fastest. ``overhead_blocked`` is the time training itself was blocked (save() calls,
    the optimizer pre-hook) over the baseline: the part that does not depend on
    neighbours' load. ``drain_s``: the one-off wait for the last save after the last step.
    """
    os.sync()  # earlier benchmark phases must not leave writeback running into these runs
    before = torch.get_num_threads()
    if load.threads:
        torch.set_num_threads(load.threads)
    try:
        return _measure(engines, intervals, root, load, options, rounds=rounds, tick=tick, local=local,
                        rotate=rotate)
    finally:
        torch.set_num_threads(before)


def _measure(engines: list[str], intervals: list[int], root: Path, load: DemoLoad,
             options: dict[str, Any], *, rounds: int, tick: Any, local: Path | None = None,
             rotate: bool = False) -> dict[str, Any]:
    _loop(DemoLoad(**{**load.__dict__, "steps": min(load.steps, 5)}), None, 1, root, options)  # warm-up
    base: list[float] = []
    keys = [str(i) for i in intervals]
    times: dict[str, dict[str, list[float]]] = {n: {k: [] for k in keys} for n in engines}
    blocked: dict[str, dict[str, list[float]]] = {n: {k: [] for k in keys} for n in engines}
    drain: dict[str, dict[str, list[float]]] = {n: {k: [] for k in keys} for n in engines}
    # A checkpoint at every step costs the same at each step (on the GPU model it is disk-bound
    # by construction, 1.2 GB per ~0.1 s step): 20 steps show it as well as 50 and keep the
    # 2 GB run within minutes; such runs are compared with the baseline's time for as many steps.
    every_step = min(load.steps, 20)
    steps = {str(i): every_step if i == 1 else load.steps for i in intervals}
    scale = {k: n / max(1, load.steps) for k, n in steps.items()}
    for r in range(rounds):
        base.append(_loop(load, None, 1, root, options)[0])
        tick()
        k = r % len(engines) if rotate and engines else 0
        for name in engines[k:] + engines[:k]:
            for interval in intervals:
                wall, stuck, last = _loop(DemoLoad(**{**load.__dict__, "steps": steps[str(interval)]}), name,
                                          interval, root, options, local)
                times[name][str(interval)].append(wall)
                blocked[name][str(interval)].append(stuck)
                drain[name][str(interval)].append(last)
                tick()
    return {
        "overhead": {n: {k: statistics.median(t / (b * scale[k]) - 1.0 for t, b in zip(ts, base))
                         for k, ts in per.items()} for n, per in times.items()},
        "overhead_min": {n: {k: min(ts) / (min(base) * scale[k]) - 1.0 for k, ts in per.items()}
                         for n, per in times.items()},
        "overhead_blocked": {n: {k: statistics.median(b / (s * scale[k]) for b, s in zip(bs, base))
                                 for k, bs in per.items()} for n, per in blocked.items()},
        "overhead_detail": {"baseline_runs_s": base, "run_s": times, "blocked_s": blocked, "drain_s": drain,
                            "rounds": rounds, "steps": load.steps, "steps_by_interval": steps,
                            "state_bytes": load.state_bytes(),
                            "step_s": statistics.median(base) / max(1, load.steps),
                            "model": {"d_model": load.d_model, "n_layers": load.n_layers, "batch": load.batch,
                                      "seq_len": load.seq_len, "device": load.device,
                                      "torch_threads": torch.get_num_threads()}},
    }
