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
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hpcckpt.bench.rankproc")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--dir", type=Path, required=True)
    p.add_argument("--engine", choices=("sync", "concurrent"), required=True)
    p.add_argument("--size-bytes", type=int, required=True)
    p.add_argument("--rounds", type=int, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--direct", choices=("0", "1"), default=None)
    return p.parse_args(argv)


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


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if a.world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.port}", rank=a.rank, world_size=a.world)
    result = bench(a)
    tmp = a.out.with_name(a.out.name + ".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, a.out)
    sys.stdout.flush()
    sys.stderr.flush()
    if a.world > 1:
        dist.barrier()
        dist.destroy_process_group()
        # Skip interpreter finalization: gloo threads torn down there can abort the process.
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
