"""A process that checkpoints as fast as it can until it is killed (for kill -9 tests).

usage: python -m tests.fault.kill_target DIR ENGINE MB
"""
from __future__ import annotations

import sys

import torch

from hpcckpt.api import Checkpointer


def main() -> None:
    root, engine, mb = sys.argv[1], sys.argv[2], int(sys.argv[3])
    model = torch.nn.Linear(1024, mb * 256)  # ~mb MiB of fp32 weights
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Checkpointer(root, engine=engine, every_steps=1, keep=3) as ck:
        ck.register(model=model, optimizer=opt)
        print("ready", flush=True)
        for _ in ck.steps(10**9):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)


if __name__ == "__main__":
    main()
