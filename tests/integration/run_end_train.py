"""A training script shaped like transformers' run_clm_no_trainer.py: an epoch loop whose batch loop
breaks at --max-steps mid-epoch (in the last epoch), an evaluation that sets `perplexity` (used after
the loop), and an export after the loop that writes the model and `perplexity`. In the first
allocation the export is slow (--export-sleep), so that a stop reaches it there. Used by
test_slurm_run_end.py; run without Slurm it makes the uninterrupted reference."""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

from hpcckpt import Checkpointer

PER_EPOCH = 5


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", type=Path, required=True)
    p.add_argument("--max-steps", type=int, default=12)
    p.add_argument("--export-sleep", type=float, default=0.0)
    args = p.parse_args()
    restart = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(PER_EPOCH * 4, 6), torch.randint(0, 3, (PER_EPOCH * 4,)))
    loader = DataLoader(data, batch_size=4, shuffle=True)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    epochs = math.ceil(args.max_steps / PER_EPOCH)
    ckpt = Checkpointer(args.dir / "ckpt", every_steps=5)
    ckpt.register(model=model, optimizer=opt)
    completed_steps = ckpt.step
    for _epoch in ckpt.epochs(epochs):
        model.train()
        for x, y in ckpt.batches(loader):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            completed_steps += 1
            if completed_steps >= args.max_steps:
                break
        model.eval()
        with torch.no_grad():
            perplexity = math.exp(float(torch.nn.functional.cross_entropy(model(data.tensors[0]), data.tensors[1])))
    # The export after the loop: no step boundary here.
    (args.dir / f"export-started-{restart}").write_text(str(time.time()))
    if restart == 0:
        time.sleep(args.export_sleep)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buf)
    (args.dir / "model.pt").write_bytes(buf.getvalue())
    (args.dir / "results.json").write_text(json.dumps({"perplexity": perplexity, "restart": restart,
                                                       "step": ckpt.step}))


if __name__ == "__main__":
    main()
