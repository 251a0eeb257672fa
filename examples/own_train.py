"""A script that keeps its own checkpoints: the own-checkpoints guide's example.

It saves and resumes by itself (``torch.save`` to ``--ckpt``, loaded at start when it
exists), as most training scripts do. The two hpcckpt lines ask whether the stop's notice
came and record the save; everything else is the script's own. Run it under the supervisor
(``hpcckpt template own``, or ``hpcckpt run --mode own``) or alone: outside the supervisor
``should_stop()`` is True once a TERM arrives.

    python examples/own_train.py --steps 200 --ckpt run/checkpoint.pt
"""
import argparse
import os
import sys
import time

import torch

import hpcckpt.own as own


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--ckpt", default="checkpoint.pt")
    parser.add_argument("--step-sleep-s", type=float, default=0.0)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    start = 0
    if os.path.exists(args.ckpt):                           # the script's own resume
        saved = torch.load(args.ckpt, weights_only=True)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        start = saved["step"]
        print(f"resumed at step {start}", flush=True)

    def save(step: int) -> None:                            # the script's own save
        os.makedirs(os.path.dirname(args.ckpt) or ".", exist_ok=True)
        tmp = args.ckpt + ".tmp"
        torch.save({"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict()}, tmp)
        os.replace(tmp, args.ckpt)

    for step in range(start, args.steps):
        g = torch.Generator().manual_seed(step)             # each step's data from its number
        x = torch.randn(32, 8, generator=g)
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"step {step + 1} loss {loss.item():.6f}", flush=True)
        time.sleep(args.step_sleep_s)
        if own.should_stop():                               # hpcckpt: the notice came
            save(step + 1)
            own.saved(step + 1, args.ckpt)                  # hpcckpt: history counts lost work from here
            return 75                                       # "requeue me"
    save(args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
