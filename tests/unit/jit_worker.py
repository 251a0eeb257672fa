"""One rank of a gloo DDP job (tiny MLP, no dropout) with ``Checkpointer(jit=True)``.

Run by tests/unit/test_jit.py: ``python -m tests.unit.jit_worker RANK PORT ROOT CONFIG_JSON``;
under srun (tests/integration/test_slurm_jit.py) RANK is ``slurm`` and PORT is ignored: the
rank, the world and the rendezvous come from Slurm's and the batch script's environment,
and a requeued run (SLURM_RESTART_COUNT > 0) injects no fault.
CONFIG: world, total (steps), timeout (jit_timeout_s), every (periodic saves or null),
and optionally a fault on ``victim`` at step ``at``: ``how`` = "kill" (SIGKILL after the
forward pass, before the gradient all-reduce), "stop" (SIGSTOP there), "kill_boundary"
(SIGKILL at the start of the step), "raise" (an exception after the forward pass: the
rank leaves through the guard's close); ``kill_writer_in_save``: the rank that writes the
JIT checkpoint is killed after writing its file, before the commit; ``sched_first``: the
scheduler steps first in each step (before the forward pass and the optimizer), so a failure that interrupts
the step leaves the live learning rate one step ahead of the last completed step; ``engine`` (default "sync");
``width``/``depth``: ``depth`` hidden layers of ``width`` units instead of the tiny MLP (a model
of realistic size: many tensors, tens of MB). The victim writes
ROOT/fault-time.json just before the fault. A rank that finishes writes
ROOT/final-RANK.pt (model and optimizer state) and ROOT/result-RANK.json.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

from hpcckpt.api import Checkpointer
from hpcckpt.data import ResumableSampler


def fault(rank: int, step: int, cfg: dict, where: str, root: Path) -> None:
    how = cfg.get("how")
    if how is None or rank != cfg.get("victim") or step != cfg.get("at"):
        return
    if (where == "boundary") != (how == "kill_boundary"):
        return
    (root / "fault-time.json").write_text(json.dumps({"time": time.time(), "rank": rank, "step": step}))
    if how == "raise":
        raise RuntimeError(f"injected failure on rank {rank} at step {step}")
    os.kill(os.getpid(), signal.SIGSTOP if how == "stop" else signal.SIGKILL)


def main() -> None:
    root, cfg = Path(sys.argv[3]), json.loads(sys.argv[4])
    if sys.argv[1] == "slurm":  # one Slurm task: MASTER_ADDR/MASTER_PORT from the batch script
        rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
        if int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0) > 0:
            cfg = {k: v for k, v in cfg.items() if k not in ("how", "victim", "at")}  # the requeued run
        dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world)
    else:
        rank, world = int(sys.argv[1]), int(cfg["world"])
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[2]}", rank=rank, world_size=world)
    if cfg.get("kill_writer_in_save"):
        import hpcckpt.jit.writer as jw
        real = jw.write_file

        def write_then_die(tmp, tensors):  # type: ignore[no-untyped-def]
            rec = real(tmp, tensors)
            (root / "writer-killed.json").write_text(json.dumps({"rank": rank, "tmp": str(tmp)}))
            os.kill(os.getpid(), signal.SIGKILL)
            return rec

        jw.write_file = write_then_die
    # sched_first calls the scheduler before the first optimizer step on purpose
    warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")
    torch.manual_seed(0)  # the same on every rank: RNG states stay alike (DDP broadcasts the weights anyway)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(256, 8, generator=g), torch.randint(0, 4, (256,), generator=g))
    sampler = ResumableSampler(len(data), seed=2, num_replicas=world, rank=rank)
    loader = DataLoader(data, batch_size=8, sampler=sampler)
    # find_unused_parameters=True keeps DDP from rebuilding its gradient buckets after its first
    # step: a resumed run's first step then sums gradients in the same order as the uninterrupted run.
    width, depth = int(cfg.get("width", 16)), int(cfg.get("depth", 0))
    layers: list[torch.nn.Module] = [torch.nn.Linear(8, width), torch.nn.ReLU()]
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = DDP(torch.nn.Sequential(*layers, torch.nn.Linear(width, 4)), find_unused_parameters=True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.9)
    active = False
    with Checkpointer(root / "ckpt", engine=cfg.get("engine", "sync"), every_steps=cfg.get("every"), keep=10, jit=True,
                      jit_timeout_s=float(cfg["timeout"])) as ck:
        resumed = ck.register(model=model, optimizer=opt, scheduler=sched, sampler=sampler)
        for step, (x, y) in ck.loop(loader, int(cfg["total"])):
            active = active or bool(ck._jit is not None and ck._jit.active)
            fault(rank, step, cfg, "boundary", root)
            if cfg.get("sched_first"):
                sched.step()
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            fault(rank, step, cfg, "forward", root)
            loss.backward()
            opt.step()
            if not cfg.get("sched_first"):
                sched.step()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, root / f"final-{rank}.pt")
    (root / f"result-{rank}.json").write_text(json.dumps({"resumed": resumed, "jit_active": active}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
