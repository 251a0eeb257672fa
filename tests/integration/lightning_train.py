"""A small Lightning training job for the integration tests and the Lightning bench.

    python tests/integration/lightning_train.py --dir RUN [--steps N] [--mode hpcckpt|plain|lightning-requeue]
        [--stop-at S] [--hold-at S] [--devices N]

A tiny transformer language model (dropout, AdamW, cosine LR) on a shuffled token data
set (``ResumableSampler``). ``--mode plain`` is the uninterrupted reference without
hpcckpt; ``hpcckpt`` adds ``HpcckptCallback``. Each trained step appends its loss (exact
float hex) to RUN/trace.jsonl (rank 0); the end writes RUN/result.json with a digest of
the parameters. A stop at a step the job reaches by construction (never by timing):
``--stop-at S`` sends SIGUSR2 to itself during step S of the first run; ``--hold-at S``
waits in step S of the first run until a signal arrives (a test preempts it there).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any

import group_exit  # beside this script
import lightning.pytorch as pl
import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hpcckpt import ResumableSampler

VOCAB, SEQ, SAMPLES, BATCH = 32, 8, 64, 8


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--dir", required=True, type=Path)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--mode", default="hpcckpt", choices=["hpcckpt", "plain"])
    p.add_argument("--stop-at", type=int, default=None)
    p.add_argument("--hold-at", type=int, default=None)
    p.add_argument("--every", type=int, default=None, help="periodic checkpoint interval (default: none)")
    p.add_argument("--devices", type=int, default=1, help="DDP processes on this node (torchrun sets them)")
    p.add_argument("--num-nodes", type=int, default=1)
    p.add_argument("--accumulate", type=int, default=1, help="Trainer(accumulate_grad_batches=...)")
    p.add_argument("--val", action="store_true", help="validate at every epoch's end (a shuffled val loader)")
    return p.parse_args(argv)


class TinyLM(pl.LightningModule):
    def __init__(self, trace: Path | None, first_run: bool, args: argparse.Namespace) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.block = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.1, batch_first=True)
        self.head = nn.Linear(16, VOCAB)
        self.trace = trace
        self.first_run = first_run
        self.args = args

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens, = batch
        logits = self.head(self.block(self.embed(tokens[:, :-1])))
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        step = int(self.trainer.global_step)
        if self.trace is not None:
            with self.trace.open("a") as f:
                f.write(json.dumps({"step": step, "loss": loss.item().hex()}) + "\n")
        self._interrupt(step)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        tokens, = batch
        logits = self.head(self.block(self.embed(tokens[:, :-1])))
        self.log("val_loss", nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)))

    def _interrupt(self, step: int) -> None:
        if not self.first_run:
            return
        if step == self.args.stop_at:
            os.kill(os.getpid(), signal.SIGUSR2)
        if step == self.args.hold_at:
            print(f"holding at step {step} until a signal arrives", flush=True)
            recorder = next(cb for cb in self.trainer.callbacks if hasattr(cb, "ckpt")).ckpt.signals
            while recorder.first() is None:
                time.sleep(0.05)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.args.steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def data(rank: int, world: int) -> DataLoader:
    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, VOCAB, (SAMPLES, SEQ + 1), generator=g)
    sampler = ResumableSampler(SAMPLES, seed=7, num_replicas=world, rank=rank)
    return DataLoader(TensorDataset(tokens), batch_size=BATCH, sampler=sampler)


def digest(module: nn.Module) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    args.dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
    world = int(os.environ.get("WORLD_SIZE", "1")) if "LOCAL_RANK" in os.environ else args.devices * args.num_nodes
    restarts = int(os.environ.get("SLURM_RESTART_COUNT", os.environ.get("HPCCKPT_RESTART_COUNT", "0")))
    first_run = restarts == 0 and not (args.dir / "ckpt" / "LATEST").exists()
    model = TinyLM(args.dir / "trace.jsonl" if rank == 0 else None, first_run, args)
    callbacks: list[Any] = []
    if args.mode == "hpcckpt":
        from hpcckpt.integrations.lightning import HpcckptCallback
        callbacks.append(HpcckptCallback(dir=args.dir / "ckpt", every_steps=args.every))
    # DDP as a user would write it; the callback keeps its gradient buckets fixed across a
    # resume (find_unused_parameters=True), so the plain reference names that setting itself.
    ddp_strategy = "ddp" if args.mode == "hpcckpt" else "ddp_find_unused_parameters_true"
    trainer = pl.Trainer(
        max_steps=args.steps, accelerator="cpu", devices=args.devices, num_nodes=args.num_nodes,
        strategy=ddp_strategy if world > 1 else "auto", use_distributed_sampler=False, callbacks=callbacks,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        deterministic=True, accumulate_grad_batches=args.accumulate)
    val = None
    if args.val:  # shuffle=True: each validation draws its order from the global RNG
        val = DataLoader(TensorDataset(torch.randint(0, VOCAB, (16, SEQ + 1), generator=torch.Generator().manual_seed(5))),
                         batch_size=8, shuffle=True)
    trainer.fit(model, data(trainer.global_rank, world), val)
    if trainer.global_rank == 0:
        result = {"param_digest": digest(model), "global_step": int(trainer.global_step),
                  "epoch": int(trainer.current_epoch), "world_size": world}
        (args.dir / "result.json").write_text(json.dumps(result))
    group_exit.leave()  # Lightning's DDP strategy left its process group to the interpreter's exit
    return 0


if __name__ == "__main__":
    sys.exit(main())
