"""Save checkpoints and SIGKILL ourselves at the N-th call of a commit-protocol primitive.

usage: python -m tests.fault.kill_at_call DIR ENGINE FUNC N
FUNC is one of os.fsync, os.replace, os.write, os.pwrite, os.rename: the process dies just
before that call, the N-th time it happens, wherever in the protocol it is.
"""
from __future__ import annotations

import os
import signal
import sys

import torch

from hpcckpt.api import Checkpointer


def arm(func: str, n: int) -> None:
    name = func.split(".")[1]
    real = getattr(os, name)
    count = [0]

    def wrapper(*a: object, **k: object) -> object:
        count[0] += 1
        if count[0] == n:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*a, **k)

    setattr(os, name, wrapper)


def main() -> None:
    root, engine, func, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.Adam(model.parameters())
    with Checkpointer(root, engine=engine, every_steps=1, keep=2) as ck:
        ck.register(model=model, optimizer=opt)
        arm(func, n)
        for _ in ck.steps(ck.step + 6):
            model(torch.randn(4, 64)).sum().backward()
            opt.step()
    print("finished", flush=True)


if __name__ == "__main__":
    main()
