"""A training script with code after its training loop: an evaluation of the trained model
that writes its result. In the first allocation the evaluation is slow (``--eval-sleep``),
so that a stop reaches it there; a resumed run evaluates at once. Used by
test_slurm_after_run.py."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from hpcckpt import Checkpointer


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", type=Path, required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--eval-sleep", type=float, default=0.0)
    args = p.parse_args()
    restart = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.randn(args.steps, 16, 8)
    with Checkpointer(args.dir / "ckpt", every_steps=5) as ck:
        ck.register(model=model, optimizer=opt)
        for step in ck.steps(args.steps):
            loss = model(data[step]).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    # The evaluation after training: no step boundary here.
    (args.dir / f"eval-started-{restart}").write_text(str(time.time()))
    if restart == 0:
        time.sleep(args.eval_sleep)
    with torch.no_grad():
        score = float(model(torch.ones(1, 8)).sum())
    (args.dir / "eval.json").write_text(json.dumps({"score": score, "restart": restart}))


if __name__ == "__main__":
    main()
