"""One rank of an N-rank gloo job on CPU, training a tiny MLP with hpcckpt as users do.

Run by tests/unit/test_distributed_state.py (and tests/integration/test_slurm_elastic.py)::

    python -m tests.unit.dist_worker --rank R --world W --port P --out DIR --phase PHASE [options]

The model is a DDP-wrapped MLP (``--mode ddp``) or an FSDP2 ``fully_shard``-ed one
(``--mode fsdp``), with Adam; the data are ``--items`` deterministic samples read through
a DataLoader whose sampler is a registered ``hpcckpt.data.ResumableSampler``.

Phases:
- ``save``: train from scratch to ``--stop-at K`` (periodic checkpoints every
  ``--every`` steps), then stop: ``--stop final`` takes ``ckpt.save(final=True)`` and
  closes, ``--stop signal`` has rank 0 send itself SIGUSR2 during step K-1 (the stop
  is agreed at the boundary, the final checkpoint is taken, ``RequeueExit``).
  The state at K is dumped to ``state-saved-rRANK.pt``.
- ``resume``: a new world (of any size) registers fresh objects (other initial
  values), so hpcckpt restores them; the restored state is dumped to
  ``state-restored-rRANK.pt``, then training goes on to ``--total T`` and the final
  state is dumped to ``state-end-rRANK.pt``.
- ``run``: a job as users run it under Slurm: from scratch or from the newest
  checkpoint, to ``--total T``; a stop (preemption) dumps ``state-stopped-runN-rRANK.pt``,
  a resumed run ``state-restored-runN-rRANK.pt`` (N: ``$SLURM_RESTART_COUNT``), the end
  ``state-end-rRANK.pt``; its items and results are labelled ``runN``.
- ``reference``: the same training without hpcckpt, uninterrupted to T; dumps at
  ``--stop-at K`` (``state-saved-...``) and at T (``state-end-...``).

Every rank appends one JSON line per trained step to ``items-PHASE-rRANK.jsonl``
(step, epoch, the dataset indices of its batch, its loss) and writes
``result-PHASE-rRANK.json`` (restored step, committed step, evaluation losses, the
state's flat tensor names). Dumps hold full tensors (``DTensor.full_tensor()`` for
FSDP2), parameters under ``param/NAME`` and optimizer state under ``optim/IDX/KEY``.

Slurm: without ``--rank/--world/--port`` the rank comes from ``$SLURM_PROCID`` and the
rendezvous from ``$MASTER_ADDR:$MASTER_PORT`` (the ``ddp`` template exports them);
``--only-first-run`` makes a requeued run end at once, so that the test can resume
the checkpoint on another number of nodes by a new submission.

Faults: ``--kill-rank R --kill-step S`` kills rank R with SIGKILL inside the save of
step S, after its share of the bytes is written and before the commit exchange
(``Ranks.gather_json`` of the save's record).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

IN, HIDDEN, OUT = 32, 480, 8


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, default=None, help="default: $RANK or $SLURM_PROCID")
    p.add_argument("--world", type=int, default=None, help="default: $WORLD_SIZE or $SLURM_NTASKS")
    p.add_argument("--port", type=int, default=None, help="TCP port on 127.0.0.1 (default: env:// rendezvous)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--ckpt", type=Path, default=None, help="checkpoint directory (default: OUT/ckpt)")
    p.add_argument("--phase", choices=("save", "resume", "reference", "run"), required=True)
    p.add_argument("--mode", choices=("ddp", "fsdp"), default="ddp")
    p.add_argument("--engine", choices=("sync", "concurrent"), default="sync")
    p.add_argument("--items", type=int, default=96)
    p.add_argument("--batch", type=int, default=4, help="per-rank batch size")
    p.add_argument("--stop-at", type=int, default=None)
    p.add_argument("--total", type=int, default=None)
    p.add_argument("--every", type=int, default=None)
    p.add_argument("--keep", type=int, default=10)
    p.add_argument("--stop", choices=("final", "signal"), default="final")
    p.add_argument("--dump-at", type=int, action="append", default=[],
                   help="reference: also dump the state after this many steps to state-at-N-rRANK.pt")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep in each step (Slurm tests)")
    p.add_argument("--hold-at", type=int, default=None,
                   help="before step N, wait until this rank has received a stop signal (a preemption lands "
                        "while the job is held there, whenever it comes)")
    p.add_argument("--hold-first-run-only", action="store_true", help="--hold-at applies to run0 only")
    p.add_argument("--only-first-run", action="store_true",
                   help="exit 0 at once in a requeued Slurm run ($SLURM_RESTART_COUNT >= 1): the test resubmits")
    p.add_argument("--local-every", type=int, default=None, help="node-local level every N steps (levels)")
    p.add_argument("--local-dir", default=None, help="node-local level directory (%%n: the node)")
    p.add_argument("--ranks-per-node", type=int, default=None,
                   help="ranks per simulated node (sets GROUP_RANK as torchrun does)")
    p.add_argument("--crash-at", type=int, default=None,
                   help="at step S (its checkpoint committed), dump the state as 'saved' and exit at once, "
                        "without a final save or close(), as a crash would")
    p.add_argument("--kill-rank", type=int, default=None)
    p.add_argument("--kill-step", type=int, default=None)
    return p.parse_args()


class Items(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """D deterministic regression samples from a fixed linear teacher; item i is (i, x_i, y_i)."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(12345)
        self.x = torch.randn(n, IN, generator=g)
        teacher = torch.randn(IN, OUT, generator=g) / IN ** 0.5
        self.y = self.x @ teacher

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return i, self.x[i], self.y[i]


def build(mode: str, world: int, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, HIDDEN),
                                torch.nn.ReLU(), torch.nn.Linear(HIDDEN, OUT))
    if mode == "ddp":
        # As hpcckpt's demo and Lightning callback do: find_unused_parameters=True keeps DDP
        # from rebuilding its gradient buckets after a process's first iteration, so a resumed
        # run all-reduces its first step in the summation order of the uninterrupted run (with
        # 3 or more ranks a plain DDP(model) differs there by a rounding).
        wrapped: torch.nn.Module = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (world,))
        for m in model:
            if isinstance(m, torch.nn.Linear):
                fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
        wrapped = model
    opt = torch.optim.Adam(wrapped.parameters(), lr=1e-3)
    return wrapped, opt


def full(t: Any) -> torch.Tensor:
    from torch.distributed.tensor import DTensor
    if isinstance(t, DTensor):
        return t.full_tensor().detach().clone()
    return t.detach().clone()


def dump(model: torch.nn.Module, opt: torch.optim.Optimizer, path: Path) -> None:
    """Full parameters and optimizer state (collective for FSDP2: every rank calls it)."""
    inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    out: dict[str, torch.Tensor] = {}
    for name, p in inner.named_parameters():
        out[f"param/{name}"] = full(p)
    sd = opt.state_dict()
    for idx, st in sorted(sd["state"].items()):
        for key, v in sorted(st.items()):
            if isinstance(v, torch.Tensor):
                out[f"optim/{idx}/{key}"] = full(v)
    torch.save(out, path)


def flat_names(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[str]:
    """The flat names of the registered model's and optimizer's tensors (hpcckpt.state's naming)."""
    from hpcckpt.state import flatten
    out: dict[str, torch.Tensor] = {}
    flatten(model.state_dict(), "objects/model", out)
    flatten(opt.state_dict(), "objects/optimizer", out)
    return sorted(out)


def eval_loss(model: torch.nn.Module, data: Items) -> float:
    inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(inner(data.x), data.y).item())


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: Any) -> float:
    _, x, y = batch
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return float(loss.item())


def install_kill(rank: int, kill_rank: int | None, kill_step: int | None) -> None:
    """SIGKILL this rank when it hands in its record of the save of ``kill_step`` (bytes written, not committed)."""
    if kill_rank is None or rank != kill_rank:
        return
    from hpcckpt.ranks import Ranks
    real = Ranks.gather_json

    def gather_json(self: Ranks, obj: Any) -> list[Any]:
        if isinstance(obj, dict) and obj.get("step") == kill_step and "record" in obj:
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, obj)

    Ranks.gather_json = gather_json  # type: ignore[method-assign]


def main() -> None:
    a = parse()
    if a.only_first_run and int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0) >= 1:
        os._exit(0)
    rank = a.rank if a.rank is not None else int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
    world = a.world if a.world is not None else int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1")))
    torch.set_num_threads(1)
    if a.port is not None:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.port}", rank=rank, world_size=world)
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    a.out.mkdir(parents=True, exist_ok=True)
    code = 0
    try:
        code = run(a, rank, world)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    dist.barrier()
    dist.destroy_process_group()
    # Skip interpreter finalization: gloo threads torn down there can abort the process.
    os._exit(code)


def run(a: argparse.Namespace, rank: int, world: int) -> int:
    from hpcckpt.data import ResumableSampler
    data = Items(a.items)
    phase = a.phase
    model, opt = build(a.mode, world, seed=0 if phase != "resume" else 1000 + rank)
    if phase == "run":  # one label per run of a requeued Slurm job: run0, run1...
        phase = f"run{int(os.environ.get('SLURM_RESTART_COUNT', '0') or 0)}"
    sampler = ResumableSampler(len(data), seed=7, shuffle=True, num_replicas=world, rank=rank)
    loader = torch.utils.data.DataLoader(data, batch_size=a.batch, sampler=sampler, num_workers=0)
    log = open(a.out / f"items-{phase}-r{rank}.jsonl", "a")
    result: dict[str, Any] = {"rank": rank, "world": world}

    def record(step: int, batch: Any, loss: float) -> None:
        log.write(json.dumps({"step": step, "epoch": sampler.epoch, "items": batch[0].tolist(), "loss": loss}) + "\n")
        log.flush()

    if phase == "reference":
        total, stop_at = a.total, a.stop_at
        result["eval_start"] = eval_loss(model, data)
        step = 0
        while step < total:
            for batch in loader:
                if step == stop_at:
                    dump(model, opt, a.out / f"state-saved-r{rank}.pt")
                if step in a.dump_at:
                    dump(model, opt, a.out / f"state-at-{step}-r{rank}.pt")
                record(step, batch, train_step(model, opt, batch))
                step += 1
                if step == total:
                    break
            else:
                sampler.set_epoch(sampler.epoch + 1)
        if stop_at == total:
            dump(model, opt, a.out / f"state-saved-r{rank}.pt")
        dump(model, opt, a.out / f"state-end-r{rank}.pt")
        result["eval_end"] = eval_loss(model, data)
        (a.out / f"result-{phase}-r{rank}.json").write_text(json.dumps(result))
        return 0

    from hpcckpt.api import Checkpointer, RequeueExit
    install_kill(rank, a.kill_rank, a.kill_step)
    (a.out / f"pid-r{rank}.json").write_text(json.dumps({"pid": os.getpid(),
                                                         "node": os.environ.get("SLURMD_NODENAME")}))
    root = a.ckpt or a.out / "ckpt"
    if a.ranks_per_node:
        os.environ["GROUP_RANK"] = str(rank // a.ranks_per_node)
    levels = {"local_every_steps": a.local_every, "local_dir": a.local_dir} if a.local_every else {}
    ck = Checkpointer(root, engine=a.engine, every_steps=a.every, keep=a.keep, **levels)  # stop signals: USR2, TERM
    code = 0
    try:
        restored = ck.register(model=model, optimizer=opt, sampler=sampler)
        result["restored"] = restored
        result["level"] = ck.restored_level
        result["sampler"] = sampler.state_dict()
        if phase == "resume":
            dump(model, opt, a.out / f"state-restored-r{rank}.pt")
            result["eval_restored"] = eval_loss(model, data)
            total = a.total
        elif phase.startswith("run"):
            if restored is not None:
                dump(model, opt, a.out / f"state-restored-{phase}-r{rank}.pt")
            total = a.total
        else:
            result["eval_start"] = eval_loss(model, data)
            total = a.stop_at
        try:
            for step, batch in ck.loop(loader, total):
                if step == a.crash_at:
                    for handle in ck.engine.pending():
                        handle.wait()
                    dump(model, opt, a.out / f"state-saved-r{rank}.pt")
                    log.close()
                    os._exit(0)
                if phase == "save" and a.stop == "signal" and rank == 0 and step == a.stop_at - 1:
                    os.kill(os.getpid(), signal.SIGUSR2)
                if (a.hold_at is not None and step == a.hold_at and ck.signals.first() is None
                        and not (a.hold_first_run_only and phase != "run0")):
                    # Held: every checkpoint before this step has returned from its save (a test
                    # that kills the job without a final checkpoint waits for this file).
                    (a.out / f"holding-{phase}-r{rank}").write_text(str(step))
                    while ck.signals.first() is None:
                        time.sleep(0.05)
                record(step, batch, train_step(model, opt, batch))
                if a.step_sleep:
                    time.sleep(a.step_sleep)
            if phase == "save":
                if a.stop == "signal":
                    raise SystemExit(f"rank {rank}: the signal did not stop training at step {a.stop_at}")
                if ck.committed_step != ck.step:
                    ck.save(final=True)
        except RequeueExit as exc:
            _ignore_stop_signals()
            result["requeue_step"] = exc.step
            code = int(exc.code) if isinstance(exc.code, int) else 75
        result["committed_step"] = ck.committed_step
        result["names_end"] = flat_names(model, opt)
        result["step"] = ck.step
    finally:
        ck.close()  # gives the stop signals back their handlers from before the Checkpointer
        if "requeue_step" in result:
            _ignore_stop_signals()
        log.close()
    if phase.startswith("run"):
        name = f"stopped-{phase}" if "requeue_step" in result else "end"
    else:
        name = "saved" if phase == "save" else "end"
    dump(model, opt, a.out / f"state-{name}-r{rank}.pt")
    result["eval_end"] = eval_loss(model, data)
    (a.out / f"result-{phase}-r{rank}.json").write_text(json.dumps(result))
    return code


def _ignore_stop_signals() -> None:
    """The job is being requeued, and Slurm ends this allocation with a TERM to every process:
    ignored from here, so that it cannot cut short the dumps after the stop, which the tests
    compare (a rank killed in the middle of a gather left the others' dumps unwritten, seen once
    on a loaded machine); the cluster's KillWait still bounds them."""
    for sig in (signal.SIGTERM, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)


if __name__ == "__main__":
    main()
