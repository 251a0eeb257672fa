"""One rank of ``hpcckpt bench --ranks N``: timed blocking saves of a DDP-replicated state.

Started by ``hpcckpt.bench.ranks`` (``world`` local processes, gloo over 127.0.0.1)::

    python -m hpcckpt.bench.rankproc --rank R --world W --port P --dir ROOT \\
        --engine sync|concurrent --size-bytes B --rounds K --out RESULT.json [--direct 0|1]

Every rank builds the same ``SyntheticRig`` model (same seed), wraps it in
``DistributedDataParallel`` when ``W > 1`` (so its parameters and Adam state are
declared replicated and written once, striped over the ranks), warms Adam with one
step, registers model and optimizer with a ``Checkpointer`` (``every_steps=None``,
``keep=1``) and takes ``K`` saves with ``save(block=True)``, one training step between
them. ``RESULT.json`` gets ``{"rank", "world", "persist_s": [save_s per round], "step"}``:
``save_s`` runs from the save call until the checkpoint is committed durably.

With ``--jit-steps S`` (``--world`` 2 or more; ``--engine`` and ``--size-bytes`` are
then unused) the rank measures the steady-state cost of ``jit=True`` instead: the same
DDP training loop (``JIT_WIDTH`` x ``JIT_LAYERS`` MLP, ``JIT_ROWS`` rows a batch, Adam),
through ``Checkpointer(dir, engine="concurrent", every_steps=None, jit=False)`` and then
``jit=True``, in the same process and on the same model, ``--rounds`` times (the arm that
goes first alternates by round). Each arm runs ``--jit-warmup`` steps that are not
timed, then times ``S`` steps, each with its step boundary (``Checkpointer.steps``).
``RESULT.json`` gets ``{"rank", "world", "jit": {"off_s": [...], "on_s": [...],
"off_cpu_s": [...], "on_cpu_s": [...], "boundary_s": [...], "heartbeats": [...]}}`` per
round: the arms' wall-clock times for the ``S`` steps, this process's CPU time over
them (every thread: the heartbeat's and gloo's too), the guard's own CPU time over them
(its ``at_boundary`` calls, plus the threads that appeared when it started: the
heartbeat's and its gloo group's, from ``/proc/self/task/*/schedstat``), the median time of the JIT guard's work at a boundary (``at_boundary``, timed
around the call) and the heartbeat rounds the guard ran during the arm.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

# The JIT overhead's training step: tens of milliseconds on one CPU thread per rank.
JIT_WIDTH = 512
JIT_LAYERS = 4
JIT_ROWS = 256
JIT_WARMUP = 5


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hpcckpt.bench.rankproc")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--dir", type=Path, required=True)
    p.add_argument("--engine", choices=("sync", "concurrent"), default="concurrent")
    p.add_argument("--size-bytes", type=int, default=0)
    p.add_argument("--rounds", type=int, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--direct", choices=("0", "1"), default=None)
    p.add_argument("--jit-steps", type=int, default=0, help="measure jit=False against jit=True over this many steps")
    p.add_argument("--jit-warmup", type=int, default=JIT_WARMUP)
    a = p.parse_args(argv)
    if a.jit_steps < 0 or a.jit_warmup < 0 or a.rounds < 1:
        p.error("--jit-steps and --jit-warmup: 0 or more; --rounds: 1 or more")
    if a.jit_steps and a.world < 2:
        p.error("--jit-steps needs --world 2 or more (JIT refuses a single rank)")
    if not a.jit_steps and a.size_bytes <= 0:
        p.error("--size-bytes: give the state size in bytes (or --jit-steps)")
    return a


def bench(a: argparse.Namespace) -> dict[str, object]:
    import torch

    from ..api import Checkpointer
    from .synthetic import SyntheticRig

    rig = SyntheticRig(a.size_bytes, seed=0, warm=False)  # the same parameters on every rank
    model: torch.nn.Module = rig.model
    if a.world > 1:
        model = torch.nn.parallel.DistributedDataParallel(rig.model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)

    def train_step() -> None:
        x = torch.randn(rig.rows, rig.width)
        loss = model(x).square().mean()
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()

    train_step()  # Adam's moments exist: the state has its full size
    extra = {} if a.direct is None else {"direct": a.direct == "1"}
    ckpt = Checkpointer(a.dir, engine=a.engine, every_steps=None, keep=1, **extra)
    persist: list[float] = []
    try:
        ckpt.register(model=model, optimizer=opt)
        for k in range(a.rounds):
            if k:
                train_step()
            ckpt.step = k + 1
            handle = ckpt.save(block=True)
            if handle.save_s is None:
                raise RuntimeError(f"the save of step {k + 1} reported no persist time")
            persist.append(float(handle.save_s))
    finally:
        ckpt.close()
    return {"rank": a.rank, "world": a.world, "engine": a.engine, "persist_s": persist, "step": a.rounds}


def _threads() -> set[int]:
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:  # not Linux: no per-thread figures
        return set()


def _cpu_ns(tids: set[int]) -> int:
    """CPU time the threads ``tids`` of this process have used (ns, /proc schedstat); gone threads count 0."""
    total = 0
    for t in tids:
        try:
            total += int(Path(f"/proc/self/task/{t}/schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return total


def _jit_arm(a: argparse.Namespace, model: Any, opt: Any, train_step: Any, jit: bool, root: Path) -> dict[str, Any]:
    """One arm: a fresh Checkpointer (``jit`` on or off), warm-up steps, then ``a.jit_steps`` timed steps."""
    from ..api import Checkpointer

    ckpt = Checkpointer(root, engine="concurrent", every_steps=None, keep=1, jit=jit)
    calls: list[float] = []
    guard: Any = None
    t0 = t1 = c0 = c1 = 0.0
    g0 = g1 = 0
    try:
        ckpt.register(model=model, optimizer=opt)
        first = a.jit_warmup
        before = _threads()
        new: set[int] = set()
        for s in ckpt.steps(first + a.jit_steps + 1):
            if s == 0:
                new = _threads() - before  # the guard's: its heartbeat thread and its gloo group's
            if s == 0 and jit:
                guard = ckpt._jit  # started by the first step's setup; time its boundary work
                if guard is None or not guard.active:
                    raise RuntimeError(f"jit=True did not start the JIT guard ({getattr(guard, 'problem', None)})")
                inner = guard.at_boundary

                def timed(step: int, inner: Any = inner) -> None:
                    c = time.perf_counter()
                    inner(step)
                    calls.append(time.perf_counter() - c)
                guard.at_boundary = timed
            if s == first:
                t0, c0, g0 = time.perf_counter(), time.process_time(), _cpu_ns(new)
                calls.clear()
                beats0 = guard.heartbeat.rounds if guard is not None else 0
            if s == first + a.jit_steps:  # S steps and their boundaries done
                t1, c1, g1 = time.perf_counter(), time.process_time(), _cpu_ns(new)
                beats = (guard.heartbeat.rounds - beats0) if guard is not None else 0
                break
            train_step()
    finally:
        ckpt.close()
    return {"s": t1 - t0, "cpu_s": c1 - c0, "guard_cpu_s": sum(calls) + (g1 - g0) / 1e9,
            "boundaries_s": sum(calls), "threads_cpu_s": (g1 - g0) / 1e9,
            "boundary_s": statistics.median(calls) if calls else 0.0, "heartbeats": beats}


def bench_jit(a: argparse.Namespace) -> dict[str, object]:
    """``--jit-steps``: the same DDP loop with ``jit=False`` and ``jit=True``, alternating by round."""
    import shutil

    import torch

    torch.manual_seed(0)  # the same parameters on every rank
    net = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(JIT_WIDTH, JIT_WIDTH), torch.nn.ReLU())
                                for _ in range(JIT_LAYERS)])
    model = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1 + a.rank)  # each rank its own data, as in data parallel training

    def train_step() -> None:
        x = torch.randn(JIT_ROWS, JIT_WIDTH, generator=gen)
        loss = model(x).square().mean()
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()

    train_step()  # Adam's moments exist
    out: dict[str, list[Any]] = {"off_s": [], "on_s": [], "off_cpu_s": [], "on_cpu_s": [], "guard_cpu_s": [], "boundary_s": [],
                                 "boundaries_s": [], "threads_cpu_s": [], "off_threads_cpu_s": [],
                                 "heartbeats": []}
    for k in range(a.rounds):
        for jit in ((False, True) if k % 2 == 0 else (True, False)):
            root = a.dir / f"r{k}-{'on' if jit else 'off'}"  # a fresh directory: nothing to restore
            arm = _jit_arm(a, model, opt, train_step, jit, root)
            shutil.rmtree(root, ignore_errors=True)
            if jit:
                out["on_s"].append(arm["s"])
                out["on_cpu_s"].append(arm["cpu_s"])
                out["guard_cpu_s"].append(arm["guard_cpu_s"])
                out["boundaries_s"].append(arm["boundaries_s"])
                out["threads_cpu_s"].append(arm["threads_cpu_s"])
                out["boundary_s"].append(arm["boundary_s"])
                out["heartbeats"].append(arm["heartbeats"])
            else:
                out["off_s"].append(arm["s"])
                out["off_cpu_s"].append(arm["cpu_s"])
                out["off_threads_cpu_s"].append(arm["threads_cpu_s"])  # threads new at the first step: none expected
    return {"rank": a.rank, "world": a.world, "jit": out, "steps": a.jit_steps, "warmup": a.jit_warmup,
            "rounds": a.rounds, "model": {"width": JIT_WIDTH, "layers": JIT_LAYERS, "rows": JIT_ROWS}}


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if a.world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.port}", rank=a.rank, world_size=a.world)
    leave(a.out, bench_jit(a) if a.jit_steps else bench(a), grouped=a.world > 1)
    return 0


def leave(out: Path, result: dict[str, Any], *, grouped: bool = True) -> None:
    """A bench rank's end: its result written whole (temp file, rename), its output flushed;
    in a gloo group, a barrier once every rank has written, then an exit that skips the
    interpreter's finalization (gloo threads torn down there can abort the process)."""
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, out)
    sys.stdout.flush()
    sys.stderr.flush()
    if grouped:
        import torch.distributed as dist
        dist.barrier()
        dist.destroy_process_group()
        os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
