"""The demo training run: ``python -m hpcckpt.demo.train --dir DIR --steps N``.

A @preemptible train function (or, with ``--no-checkpoint``, the same loop with no
hpcckpt in it, as the reference). Appends one line per step to ``--trace`` (the loss
as an exact float hex), and at the end writes ``--out-json`` with the parameter
digest and ``final.pt`` with the parameters. Under srun with several tasks it joins
a gloo process group from the SLURM_* environment and trains with DDP.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from ..cluster.env import JobEnv
from ..data import ResumableSampler
from .model import MarkovTokens, ModelConfig, TinyLM, param_digest

if TYPE_CHECKING:
    from ..api import Checkpointer


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hpcckpt.demo.train", description=__doc__)
    p.add_argument("--dir", required=True, help="checkpoint directory (also where results go)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine", default=None, help="sync | concurrent (default: HPCCKPT_ENGINE or concurrent)")
    p.add_argument("--every", type=int, default=10, help="periodic checkpoint interval in steps")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--samples", type=int, default=512)
    p.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per step (to slow the demo)")
    p.add_argument("--trace", default=None, help="append per-step losses here (default DIR/trace.jsonl)")
    p.add_argument("--out-json", default=None, help="final result JSON (default DIR/result.json)")
    p.add_argument("--no-checkpoint", action="store_true", help="reference run without hpcckpt")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the model trains (default cpu)")
    return p.parse_args(argv)


def init_distributed() -> tuple[int, int]:
    """Join a gloo group when launched as several Slurm tasks (or torchrun)."""
    job = JobEnv()
    world = int(os.environ.get("WORLD_SIZE", job.world_size))
    if world <= 1 or dist.is_initialized():
        return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    rank = int(os.environ.get("RANK", job.global_rank))
    if "MASTER_ADDR" not in os.environ:
        nodes = job.hostnames
        os.environ["MASTER_ADDR"] = nodes[0] if nodes else "127.0.0.1"
    os.environ.setdefault("MASTER_PORT", str(20000 + int(job.raw_job_id or 0) % 20000))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    return rank, world


def deterministic(device: str) -> None:
    """Bit-for-bit repeatable training on ``device`` (CUDA: the parent sets
    CUBLAS_WORKSPACE_CONFIG; attention runs on the math kernel, whose backward is
    deterministic, instead of the fused ones)."""
    torch.use_deterministic_algorithms(True)
    if device == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        for name in ("enable_flash_sdp", "enable_mem_efficient_sdp", "enable_cudnn_sdp"):
            if hasattr(torch.backends.cuda, name):
                getattr(torch.backends.cuda, name)(False)


def build(args: argparse.Namespace, rank: int, world: int) -> tuple[Any, ...]:
    torch.manual_seed(args.seed)
    deterministic(args.device)
    cfg = ModelConfig(d_model=args.d_model, n_layers=args.layers)
    data = MarkovTokens(args.samples, cfg.seq_len, cfg.vocab, seed=1234 + args.seed)
    model = TinyLM(cfg).to(args.device)
    net: torch.nn.Module = model
    if world > 1:
        # find_unused_parameters=True keeps DDP from rebuilding its gradient buckets after
        # the first iteration: a resumed run would otherwise all-reduce its first step with
        # another bucket layout (another summation order) than the uninterrupted run.
        net = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
    sampler = ResumableSampler(len(data), seed=args.seed, num_replicas=world, rank=rank)
    loader = DataLoader(data, batch_size=args.batch, sampler=sampler, drop_last=False)
    return model, net, opt, sched, sampler, loader


def step_fn(net: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any, batch: torch.Tensor,
            device: str = "cpu") -> float:
    batch = batch.to(device)
    x, y = batch[:, :-1], batch[:, 1:]
    logits = net(x)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    sched.step()
    return float(loss.item())


def plain_loop(loader: DataLoader[Any], sampler: ResumableSampler, steps: int) -> Iterator[tuple[int, Any]]:
    step = 0
    while True:
        for batch in loader:
            if step >= steps:
                return
            yield step, batch
            step += 1
        sampler.set_epoch(sampler.epoch + 1)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    rank, world = init_distributed()
    trace = Path(args.trace or root / "trace.jsonl")
    model, net, opt, sched, sampler, loader = build(args, rank, world)

    def record(step: int, loss: float) -> None:
        if rank == 0:
            with open(trace, "a") as f:
                f.write(json.dumps({"step": step, "loss": float.hex(loss)}) + "\n")
        if args.step_sleep:
            import time
            time.sleep(args.step_sleep)

    if args.no_checkpoint:
        for step, batch in plain_loop(loader, sampler, args.steps):
            record(step, step_fn(net, opt, sched, batch, args.device))
    else:
        from ..api import preemptible

        # The inner model is registered (its names carry no "module." prefix), so the setup
        # declares it replicated: each rank writes 1/world of the parameters and Adam state.
        @preemptible(dir=str(root / "ckpt"), engine=args.engine, every_steps=args.every, replicated="models")
        def train(ckpt: Checkpointer) -> None:
            ckpt.register(model=model, optimizer=opt, scheduler=sched, sampler=sampler)
            for step, batch in ckpt.loop(loader, args.steps):
                record(step, step_fn(net, opt, sched, batch, args.device))

        train()

    if rank == 0:
        torch.save({n: p.detach().cpu().clone() for n, p in model.state_dict().items()}, root / "final.pt")
        out = {"steps": args.steps, "param_digest": param_digest(model), "world_size": world, "device": args.device}
        Path(args.out_json or root / "result.json").write_text(json.dumps(out, indent=1) + "\n")
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


def run(argv: list[str] | None = None) -> int:
    """``main`` that always leaves torch.distributed: a requeue exits through SystemExit(75),
    and a gloo group alive at interpreter exit can abort the process during finalization."""
    try:
        return main(argv)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(run())
