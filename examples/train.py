"""A complete training script with hpcckpt's Checkpointer: the integration guide's example.

Run it as it is (it checkpoints into HPCCKPT_DIR, or ./ckpt):

    python examples/train.py --epochs 3

Stopped by a signal (USR2 or TERM), a time limit or a preemption, it saves at the next step,
exits 75 ("requeue me"), and the next run resumes at that step: the same batches, in the same
order, with the same random numbers, as if it had never stopped. `hpcckpt check -- python
examples/train.py` proves it for this script: it runs it uninterrupted and stopped and
compares every step.
"""
import argparse
import os
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

from hpcckpt import Checkpointer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--step-sleep-s", type=float, default=0.0)  # stands in for a larger model's step
    args = parser.parse_args()

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(512, 16), torch.randn(512, 1))
    loader = DataLoader(data, batch_size=32, shuffle=True)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)

    ckpt = Checkpointer(os.environ.get("HPCCKPT_DIR", "ckpt"))  # every_steps=..., engine=... as keywords
    ckpt.register(model=model, optimizer=optimizer, scheduler=scheduler)  # restores the newest checkpoint
    for epoch in ckpt.epochs(args.epochs):             # resumes at the epoch in progress
        for x, y in ckpt.batches(loader):              # was: for x, y in loader
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            ckpt.report_loss(loss)                     # optional: hpcckpt check compares the losses too
            time.sleep(args.step_sleep_s)
        scheduler.step()
        print(f"epoch {epoch} step {ckpt.step} loss {loss.item():.6f}", flush=True)


if __name__ == "__main__":
    main()
