"""A training script that keeps its own checkpoints and never imports hpcckpt.

It is the common shape of a script with its own save and resume (pytorch/examples
imagenet, timm, Lightning, Accelerate): it saves ``torch.save`` every ``--every`` steps,
resumes from its newest file at start, and on TERM (its own handler) saves at the next
step boundary and exits 75 ("requeue me"). Each step's data comes from a generator seeded
by the step number, so a run resumed from any save trains exactly what an uninterrupted
run trains. The end writes ``--out`` (the losses and a SHA-256 of every parameter and
optimizer tensor). One line per step on stdout ("step N loss L").

usage: python own_save_train.py --steps N --dir CKPT_DIR --out FILE [--every K] [--step-sleep-s T]
       [--save-sleep-s T] [--ignore-term] [--hold-file F]

``--hold-file F`` (as criu_train.py's): while F, a symlink whose target is a step number S,
exists, the script parks after printing step S or any later step, until its TERM comes or F
names a later step or is removed. A test's stop lands there by construction, however slowly
the scheduler acts; a run restored from an image reads F again.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
from criu_train import held_at  # beside this script: the same --hold-file
from torch import nn

STOP = {"asked": False}


def digest(model: nn.Module, opt: torch.optim.Optimizer) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().numpy().tobytes())
    for state in opt.state_dict()["state"].values():
        for key in sorted(state):
            value = state[key]
            if torch.is_tensor(value):
                h.update(value.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def save(ckpt_dir: Path, step: int, model: nn.Module, opt: torch.optim.Optimizer, losses: list[str],
         sleep_s: float) -> None:
    tmp = ckpt_dir / f".ckpt-{step:07d}.pt.tmp"
    torch.save({"step": step, "model": model.state_dict(), "opt": opt.state_dict(), "losses": losses}, tmp)
    time.sleep(sleep_s)  # a slower disk: the save takes this long
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, ckpt_dir / f"ckpt-{step:07d}.pt")
    print(f"saved step {step}", flush=True)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--dir", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--step-sleep-s", type=float, default=0.0)
    p.add_argument("--save-sleep-s", type=float, default=0.0)
    p.add_argument("--ignore-term", action="store_true", help="no TERM handler: save only every --every steps")
    p.add_argument("--hold-file", help="park after the step this symlink names (see the module docstring)")
    a = p.parse_args()
    if not a.ignore_term:
        signal.signal(signal.SIGTERM, lambda s, f: STOP.update(asked=True))
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    a.dir.mkdir(parents=True, exist_ok=True)
    start, losses = 0, []
    saved = sorted(a.dir.glob("ckpt-*.pt"))
    if saved:
        state = torch.load(saved[-1], weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start, losses = state["step"], state["losses"]
        print(f"resumed from {saved[-1].name} at step {start}", flush=True)
    for step in range(start + 1, a.steps + 1):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(32, 16, generator=g), torch.randn(32, 4, generator=g)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss).hex())
        print(f"step {step} loss {float(loss):.6f}", flush=True)
        time.sleep(a.step_sleep_s)
        while not STOP["asked"] and (limit := held_at(a.hold_file)) is not None and step >= limit:
            time.sleep(0.01)
        if STOP["asked"] and step < a.steps:
            save(a.dir, step, model, opt, losses, a.save_sleep_s)
            print(f"stopping at step {step} for a requeue", flush=True)
            return 75
        if step % a.every == 0:
            save(a.dir, step, model, opt, losses, a.save_sleep_s)
    a.out.write_text(json.dumps({"losses": losses, "digest": digest(model, opt)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
