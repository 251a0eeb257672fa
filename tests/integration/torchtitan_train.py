"""One rank of a torchtitan-shaped job on CPU (gloo): FSDP2 x TP, torchtitan's train loop and
checkpoint-manager calls, with hpcckpt as the checkpoint manager.

Run by tests/integration/test_torchtitan.py::

    python -m tests.integration.torchtitan_train --rank R --world W --port P --out DIR --mesh DPxTP \\
        --phase run|reference --total N [--signal-at K] [--titan shaped|real] [--engine E]

The loop is torchtitan's ``Trainer.train`` (0.3): ``checkpointer.load(step=-1)``; while
``step < training.steps``: ``step += 1``, ``train_step`` (forward/backward,
``checkpointer.maybe_wait_for_staging()``, ``optimizers.step()``, ``lr_schedulers.step()``),
``checkpointer.save(step, last_step=step == training.steps)``; ``checkpointer.close()``.
The trainer is the ``train_state`` Stateful (step, tokens seen); its dataloader resumes
itself (``state_dict``: the batches it handed out, per data-parallel rank).

``--titan shaped``: containers shaped like torchtitan's (an ``OptimizersContainer``-like
``Optimizer`` holding one AdamW per model part, whose state dict is flat and keyed by
parameter name; an ``LRSchedulersContainer``-like warmup ``LambdaLR`` whose state is
``last_epoch``) and ``hpcckpt.integrations.torchtitan.TitanCheckpoints``. ``--titan real``:
torchtitan's own ``OptimizersContainer`` and ``LRSchedulersContainer`` built from their
configs, and the manager built as the Trainer builds it,
``HpcckptCheckpointManager.Config(...).build(dataloader=, model_parts=, optimizers=,
lr_schedulers=, states=, sd_adapter=, base_folder=)`` (needs torchtitan importable).

``run``: from scratch or from the newest checkpoint to ``--total``; ``--signal-at K``: rank 0
sends itself SIGUSR2 during step K of a run that restored nothing (a preemption): every
rank saves step K and leaves with ``RequeueExit`` (exit 75; recorded here as
``requeue_step``). ``reference``: the same loop with checkpointing disabled. Each rank dumps
its full parameters and optimizer state (``state-PHASE-rR.pt``) and ``result-PHASE-rR.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tests.integration.fsdp_tp_train import full

IN, HIDDEN, OUT, ROWS = 64, 510, 32, 8  # 510 rows over 2 x 2: uneven FSDP shards within each TP half
LR, WARMUP = 1e-2, 3


def build_model(dp: int, tp: int) -> tuple[torch.nn.Module, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, OUT))
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    if tp > 1:
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    if dp > 1:
        fully_shard(model, mesh=mesh["dp"])
    return model, mesh


class Optimizers(torch.optim.Optimizer):
    """Shaped like torchtitan's ``OptimizersContainer``: an ``Optimizer`` over every part's
    parameters that steps one AdamW per model part; its state dict is flat, keyed by name."""

    def __init__(self, model_parts: list[torch.nn.Module]) -> None:
        self.model_parts = model_parts
        self.optimizers = [torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=0.1) for m in model_parts]
        torch.optim.Optimizer.__init__(self, [p for m in model_parts for p in m.parameters()], {})

    def __iter__(self) -> Any:
        return iter(self.optimizers)

    def __len__(self) -> int:
        return len(self.optimizers)

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def _options(self) -> Any:
        from torch.distributed.checkpoint.state_dict import StateDictOptions
        return StateDictOptions(flatten_optimizer_state_dict=True)

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
        out: dict[str, Any] = {}
        for m, o in zip(self.model_parts, self.optimizers):
            out.update(get_optimizer_state_dict(m, o, options=self._options()))
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict
        for m, o in zip(self.model_parts, self.optimizers):
            set_optimizer_state_dict(m, o, state_dict, options=self._options())


class Schedulers:
    """Shaped like torchtitan's ``LRSchedulersContainer``: a warmup ``LambdaLR`` per optimizer;
    its state is ``last_epoch`` (each scheduler recomputes its lr from it)."""

    def __init__(self, optimizers: Optimizers) -> None:
        self.schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: min(1.0, (s + 1) / WARMUP))
                           for o in optimizers]

    def step(self) -> None:
        for s in self.schedulers:
            s.step()

    def state_dict(self) -> dict[str, Any]:
        return {"last_epoch": self.schedulers[0].last_epoch}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for s in self.schedulers:
            s.last_epoch = state_dict["last_epoch"]
            lrs = [base * s.lr_lambdas[i](s.last_epoch) for i, base in enumerate(s.base_lrs)]
            for group, lr in zip(s.optimizer.param_groups, lrs):
                group["lr"] = lr
            s._last_lr = lrs


class Loader:
    """A dataloader that resumes itself, as torchtitan's do: the batches of this data-parallel
    rank, in order; ``state_dict`` is how many it handed out (under its rank's key)."""

    def __init__(self, dp_rank: int) -> None:
        self.dp_rank, self.pos = dp_rank, 0

    def __iter__(self) -> Loader:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(7919 * self.pos + self.dp_rank)
        self.pos += 1
        return torch.randn(ROWS, IN, generator=g), torch.randn(ROWS, OUT, generator=g)

    def state_dict(self) -> dict[str, Any]:
        return {f"dp_rank_{self.dp_rank}": self.pos}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.pos = int(state_dict[f"dp_rank_{self.dp_rank}"])


class Trainer:
    """torchtitan's ``Trainer`` loop, reduced to what touches the checkpointer."""

    def __init__(self, a: argparse.Namespace, dp: int, tp: int) -> None:
        self.a = a
        self.model, mesh = build_model(dp, tp)
        self.model_parts = [self.model]
        self.dataloader = Loader(mesh["dp"].get_local_rank())
        self.step = 0
        self.ntokens_seen = 0
        if a.titan == "real":
            self.optimizers, self.lr_schedulers = real_containers(self.model_parts, a.total)
        else:
            self.optimizers = Optimizers(self.model_parts)
            self.lr_schedulers = Schedulers(self.optimizers)
        self.checkpointer = self.build_checkpointer(enable=a.phase == "run")

    def build_checkpointer(self, *, enable: bool) -> Any:
        a = self.a
        if a.titan == "real":
            from hpcckpt.integrations.torchtitan import HpcckptCheckpointManager
            config = HpcckptCheckpointManager.Config(enable=enable, interval=a.interval, folder="ckpt",
                                                     engine=a.engine, total_steps=a.total, keep_latest_k=3)
            return config.build(dataloader=self.dataloader, model_parts=self.model_parts,
                                optimizers=self.optimizers, lr_schedulers=self.lr_schedulers,
                                states={"train_state": self}, sd_adapter=None, base_folder=str(a.out))
        if not enable:
            return None
        from hpcckpt.integrations.torchtitan import TitanCheckpoints
        return TitanCheckpoints(folder=a.out / "ckpt", interval=a.interval, total_steps=a.total, keep_latest_k=3,
                                engine=a.engine, model_parts=self.model_parts, optimizers=self.optimizers,
                                lr_schedulers=self.lr_schedulers, dataloader=self.dataloader,
                                states={"train_state": self})

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = state_dict["step"]
        self.ntokens_seen = state_dict["ntokens_seen"]

    def train_step(self, data_iterator: Any) -> float:
        x, y = next(data_iterator)
        self.ntokens_seen += x.numel()
        self.optimizers.zero_grad()
        loss = torch.nn.functional.mse_loss(self.model(x), y)
        loss.backward()
        if self.checkpointer is not None:
            self.checkpointer.maybe_wait_for_staging()
        self.optimizers.step()
        self.lr_schedulers.step()
        return float(loss.item())

    def train(self, result: dict[str, Any]) -> None:
        ck = self.checkpointer
        if ck is not None:
            result["loaded"] = ck.load(step=-1)
        result["start_step"] = self.step
        data_iterator = iter(self.dataloader)
        first = self.step
        while self.step < self.a.total:
            self.step += 1
            if first == 0 and self.a.rank == 0 and self.a.signal_at == self.step:
                os.kill(os.getpid(), signal.SIGUSR2)  # a preemption notice, mid-step
            result.setdefault("losses", []).append(self.train_step(data_iterator))
            if ck is not None:
                ck.save(self.step, last_step=self.step == self.a.total)


def real_containers(model_parts: list[torch.nn.Module], total: int) -> tuple[Any, Any]:
    """torchtitan's own OptimizersContainer (AdamW, for-loop) and LRSchedulersContainer (warmup)."""
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig
    opts = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW",
                                       optimizer_kwargs={"lr": LR, "weight_decay": 0.1})],
        implementation="for-loop").build(model_parts=model_parts)
    scheds = LRSchedulersContainer.Config(warmup_steps=WARMUP).build(optimizers=opts, training_steps=total)
    return opts, scheds


def dump(model: torch.nn.Module, optimizers: Any, path: Path) -> None:
    """Full parameters and every AdamW's state, by parameter name."""
    out: dict[str, torch.Tensor] = {f"param/{n}": full(p) for n, p in model.named_parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    for o in optimizers:
        for p, st in o.state.items():
            for key, v in sorted(st.items()):
                if isinstance(v, torch.Tensor):
                    out[f"optim/{names[id(p)]}/{key}"] = full(v)
        out["lr"] = torch.tensor([g["lr"] for g in o.param_groups])
    torch.save(out, path)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--mesh", default="2x2")
    p.add_argument("--phase", choices=("run", "reference"), required=True)
    p.add_argument("--total", type=int, required=True)
    p.add_argument("--interval", type=int, default=2)
    p.add_argument("--signal-at", type=int, default=None)
    p.add_argument("--titan", choices=("shaped", "real"), default="shaped")
    p.add_argument("--engine", choices=("sync", "concurrent"), default="concurrent")
    a = p.parse_args()
    dp, tp = (int(x) for x in a.mesh.split("x"))
    assert dp * tp == a.world, (a.mesh, a.world)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.port}", rank=a.rank, world_size=a.world)
    result: dict[str, Any] = {"rank": a.rank}
    code = 0
    trainer: Trainer | None = None
    try:
        trainer = Trainer(a, dp, tp)
        try:
            trainer.train(result)
        except SystemExit as exc:  # RequeueExit: the final checkpoint is durable, exit 75 asked
            for sig in (signal.SIGTERM, signal.SIGUSR2):
                signal.signal(sig, signal.SIG_IGN)
            result["requeue_step"] = getattr(exc, "step", None)
            result["exit_code"] = exc.code
        if trainer.checkpointer is not None:
            trainer.checkpointer.close()
        result["step"] = trainer.step
        dump(trainer.model, trainer.optimizers, a.out / f"state-{a.phase}-r{a.rank}.pt")
        (a.out / f"result-{a.phase}-r{a.rank}.json").write_text(json.dumps(result))
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
    os._exit(code)


if __name__ == "__main__":
    main()
