"""A plain PyTorch script with no checkpoint code at all: the CRIU guide's example.

CRIU mode keeps it alive unchanged: ``hpcckpt run --mode criu --dir run -- python
examples/plain_train.py`` dumps the whole process on the stop signal and restores it on the
next run, at the instruction where it stopped.
"""
import argparse
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--step-sleep-s", type=float, default=0.05)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(args.steps):
        x = torch.randn(32, 8)
        y = x.sum(1, keepdim=True) + 0.1 * torch.randn(32, 1)
        loss = (model(x) - y).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"step {step + 1} loss {loss.item():.6f}", flush=True)
        time.sleep(args.step_sleep_s)


if __name__ == "__main__":
    main()
