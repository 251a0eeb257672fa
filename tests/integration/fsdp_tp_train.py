"""One rank of a gloo job on CPU training a small MLP with FSDP2 x tensor parallelism, as
torchtitan-style scripts write it: a ``(dp, tp)`` device mesh, ``parallelize_module`` with a
column-wise then a row-wise plan on the ``tp`` dimension, ``fully_shard`` on ``dp``, AdamW.

Run by tests/integration/test_fsdp_tp.py::

    python -m tests.integration.fsdp_tp_train --rank R --world W --port P --out DIR --mesh DPxTP --phase PHASE

``--mesh 2x2``: FSDP2 x TP (parameters ``(_StridedShard(0), Shard(0))`` and ``(Shard(0),
Shard(1))``, shards uneven: 30 rows over 2 x 2); ``4x1``: FSDP2 alone; ``1x2``: TP alone.
Every rank trains on the same batches (the data are not what is tested).

Phases:
- ``save``: train ``--steps`` steps under a Checkpointer (``--engine``), save, dump the
  full state (``DTensor.full_tensor()``) to ``state-saved-rR.pt``, and the saved
  checkpoint's step.
- ``resume``: a model built with another seed registers (hpcckpt restores it, on this
  mesh whatever mesh saved it), dumps ``state-restored-rR.pt``, trains ``--steps`` more
  steps (``state-end-rR.pt``).
- ``run``: a job as Slurm runs it: from scratch or from the newest checkpoint to
  ``--total``; ``--signal-at K`` has rank 0 send itself SIGUSR2 during step K-1 of a run
  that restored nothing (a preemption: the ranks agree on the stop, save, and leave with
  ``RequeueExit``, recorded as ``requeue_step``). Dumps ``state-end-rR.pt`` at the end.
- ``reference``: the same training without hpcckpt, uninterrupted to ``--total``.
- ``dcp-save``: train ``--steps`` steps without hpcckpt and ``dcp.save`` the state as DCP
  users do (``get_state_dict``; ``{"model", "optim", "step"}``) into ``OUT/dcp``; dump.
- ``dcp-resume``: a fresh model under a Checkpointer with no checkpoint adopts ``OUT/dcp``
  (``hpcckpt.interop.dcp.adopt``), dumps ``state-restored-rR.pt`` and the step, trains
  ``--steps`` more steps and saves (an hpcckpt checkpoint follows the DCP one).

``--app sharded|full`` registers, instead of the model and optimizer, one object as DCP's
tutorials write it (``AppState``): its ``state_dict`` is ``get_state_dict(model, opt,
options=StateDictOptions(...))`` and its ``load_state_dict`` calls ``set_state_dict``;
``sharded``: the default options (DTensors keyed by parameter name), ``full``:
``full_state_dict=True, cpu_offload=True, broadcast_from_rank0=True`` (whole tensors on
rank 0 alone, broadcast on load).

Each rank writes ``result-PHASE-rR.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

IN, HIDDEN, OUT = 128, 1022, 40


def build(dp: int, tp: int, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, OUT))
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    if tp > 1:
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    if dp > 1:
        fully_shard(model, mesh=mesh["dp"])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(8, IN, generator=g), torch.randn(8, OUT, generator=g)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> float:
    x, y = batch(step)
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return float(loss.item())


class AppState:
    """The Stateful wrapper of DCP's tutorials: model and optimizer through get/set_state_dict."""

    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer, mode: str) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions
        self.model, self.opt = model, opt
        self.options = (StateDictOptions() if mode == "sharded" else
                        StateDictOptions(full_state_dict=True, cpu_offload=True, broadcast_from_rank0=True))

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict
        msd, osd = get_state_dict(self.model, self.opt, options=self.options)
        return {"model": msd, "optim": osd}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import (
            set_model_state_dict,
            set_optimizer_state_dict,
            set_state_dict,
        )
        if self.options.broadcast_from_rank0:
            # Not set_state_dict: given the empty dicts the other ranks hold, it takes them for an
            # optimizer-only load and skips the model's broadcast that rank 0 starts (torch 2.13).
            set_model_state_dict(self.model, sd["model"], options=self.options)
            set_optimizer_state_dict(self.model, self.opt, sd["optim"], options=self.options)
        else:
            set_state_dict(self.model, self.opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"],
                           options=self.options)


def full(t: Any) -> torch.Tensor:
    from torch.distributed.tensor import DTensor
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def dump(model: torch.nn.Module, opt: torch.optim.Optimizer, path: Path) -> None:
    """Full parameters and optimizer state, by name and by the optimizer's parameter index."""
    out: dict[str, torch.Tensor] = {f"param/{n}": full(p) for n, p in model.named_parameters()}
    for idx, st in sorted(opt.state_dict()["state"].items()):
        for key, v in sorted(st.items()):
            if isinstance(v, torch.Tensor):
                out[f"optim/{idx}/{key}"] = full(v)
    torch.save(out, path)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--mesh", default="2x2")
    p.add_argument("--phase", choices=("save", "resume", "dcp-save", "dcp-resume", "run", "reference"),
                   required=True)
    p.add_argument("--total", type=int, default=None)
    p.add_argument("--signal-at", type=int, default=None)
    p.add_argument("--app", choices=("sharded", "full"), default=None)
    p.add_argument("--engine", choices=("sync", "concurrent"), default="sync")
    p.add_argument("--steps", type=int, default=3)
    a = p.parse_args()
    dp, tp = (int(x) for x in a.mesh.split("x"))
    assert dp * tp == a.world, (a.mesh, a.world)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.port}", rank=a.rank, world_size=a.world)
    code = 0
    try:
        run(a, dp, tp)
    except BaseException:
        import traceback
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    if code == 0:
        dist.barrier()
        dist.destroy_process_group()
    os._exit(code)  # gloo threads torn down at interpreter exit can abort the process


def run(a: argparse.Namespace, dp: int, tp: int) -> None:
    rank = a.rank
    fresh = a.phase in ("save", "dcp-save")
    model, opt = build(dp, tp, seed=0 if fresh else 1000 + rank)
    result: dict[str, Any] = {"rank": rank, "mesh": a.mesh}
    if a.phase in ("run", "reference"):
        run_job(a, model, opt, result)
        return
    if a.phase == "dcp-save":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict
        for step in range(a.steps):
            train_step(model, opt, step)
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd, "step": a.steps}, checkpoint_id=str(a.out / "dcp"))
        dump(model, opt, a.out / f"state-saved-r{rank}.pt")
        (a.out / f"result-{a.phase}-r{rank}.json").write_text(json.dumps(result))
        return
    from hpcckpt.api import Checkpointer
    ck = Checkpointer(a.out / "ckpt", engine=a.engine, keep=5)
    try:
        if a.app:
            result["restored"] = ck.register(app=AppState(model, opt, a.app))
        else:
            result["restored"] = ck.register(model=model, optimizer=opt)
        if a.phase == "dcp-resume":
            from hpcckpt.interop import dcp as hdcp
            result["adopted"] = hdcp.adopt(ck, a.out / "dcp", keys={"optimizer": "optim"})
        if not fresh:
            result["step_restored"] = ck.step
            dump(model, opt, a.out / f"state-restored-r{rank}.pt")
        start = ck.step
        losses = []
        for step in ck.steps(start + a.steps):
            losses.append(train_step(model, opt, step))
        result["losses"] = losses
        if ck.committed_step != ck.step:
            ck.save(final=True).wait()
        result["committed_step"] = ck.committed_step
    finally:
        ck.close()
    dump(model, opt, a.out / f"state-{'saved' if fresh else 'end'}-r{rank}.pt")
    (a.out / f"result-{a.phase}-r{rank}.json").write_text(json.dumps(result))


def run_job(a: argparse.Namespace, model: torch.nn.Module, opt: torch.optim.Optimizer, result: dict[str, Any]) -> None:
    if a.phase == "reference":
        for step in range(a.total):
            train_step(model, opt, step)
    else:
        import signal

        from hpcckpt.api import Checkpointer, RequeueExit
        ck = Checkpointer(a.out / "ckpt", engine=a.engine, keep=5)
        try:
            result["restored"] = restored = ck.register(model=model, optimizer=opt)
            try:
                for step in ck.steps(a.total):
                    if restored is None and a.rank == 0 and a.signal_at is not None and step == a.signal_at - 1:
                        os.kill(os.getpid(), signal.SIGUSR2)
                    train_step(model, opt, step)
            except RequeueExit as exc:
                for sig in (signal.SIGTERM, signal.SIGUSR2):
                    signal.signal(sig, signal.SIG_IGN)
                result["requeue_step"] = exc.step
            result["committed_step"] = ck.committed_step
        finally:
            ck.close()
    dump(model, opt, a.out / f"state-{a.phase}-r{a.rank}.pt")
    (a.out / f"result-{a.phase}-r{a.rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
