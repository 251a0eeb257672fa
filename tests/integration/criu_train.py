"""A plain PyTorch CPU training job with no checkpoint code at all.

It is what CRIU mode promises to keep alive unchanged: a small transformer LM with
dropout, a shuffling DataLoader over synthetic tokens, AdamW, a cosine LR schedule.
It prints one line per step and writes a JSON summary (loss trace + a SHA-256 of
every parameter and optimizer tensor) at the end, so an interrupted-and-restored
run can be compared bit for bit with an uninterrupted one.

With ``--device cuda`` the model, optimizer state and every step run on the GPU, with
deterministic kernels (``deterministic_cuda``), so a CUDA run restored from CRIU images
can be compared bit for bit too.

``--hold-file F`` makes a test's signal land deterministically: while F (a symlink whose
target is a step number S) exists, the job parks after printing step S (it cannot run to its end before the
signal arrives, however slow the test's own process is); a restored job reads F again,
so writing a later step (or removing F) lets it go on. Absent F: no effect.

usage: python criu_train.py --steps N --out FILE [--seed S] [--step-sleep-s T] [--device cpu|cuda]
       [--hold-file F]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 64, heads: int = 4, layers: int = 2, ctx: int = 32) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(1, ctx, dim))
        layer = nn.TransformerEncoderLayer(dim, heads, dim_feedforward=4 * dim, dropout=0.1, batch_first=True)
        self.body = nn.TransformerEncoder(layer, layers)
        self.head = nn.Linear(dim, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(ctx), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) + self.pos[:, : x.shape[1]]
        h = self.body(h, mask=self.mask[: x.shape[1], : x.shape[1]], is_causal=True)
        return self.head(h)


def held_at(hold_file: str | None) -> int | None:
    """The step ``hold_file`` says to park after (None: absent). It is a symlink whose target
    is the step, read without opening a file: a dump that freezes the job here must not find
    the hold file open, or the restore would need that file as it was."""
    if not hold_file:
        return None
    try:
        return int(os.readlink(hold_file))
    except (OSError, ValueError):
        return None


def park(hold_file: str | None, step: int) -> None:
    """Wait here while the hold file names this step or a later one."""
    while (limit := held_at(hold_file)) is not None and step >= limit:
        time.sleep(0.01)


def digest(model: nn.Module, opt: torch.optim.Optimizer) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    for state in opt.state.values():
        for key, v in sorted(state.items()):
            if torch.is_tensor(v):
                h.update(key.encode())
                h.update(v.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def deterministic_cuda() -> None:
    """Bit-for-bit repeatable CUDA steps: deterministic kernels, fixed cuBLAS workspace,
    no TF32, attention on the math kernel (the fused ones' backward is not deterministic)."""
    import os

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    for name in ("enable_flash_sdp", "enable_mem_efficient_sdp", "enable_cudnn_sdp"):
        if hasattr(torch.backends.cuda, name):
            getattr(torch.backends.cuda, name)(False)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--step-sleep-s", type=float, default=0.0)
    ap.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--hold-file", help="park after the step this file names (see the module docstring)")
    args = ap.parse_args()

    if args.device == "cuda":
        deterministic_cuda()
    torch.manual_seed(args.seed)
    ctx, vocab = 32, 256
    data = torch.randint(0, vocab, (512, ctx + 1), generator=torch.Generator().manual_seed(args.seed))
    loader = DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=16, shuffle=True, drop_last=True,
                        num_workers=args.workers, persistent_workers=args.workers > 0)
    model = TinyLM(vocab=vocab, ctx=ctx).to(args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))
    losses: list[float] = []
    step = 0
    while step < args.steps:
        for x, y in loader:
            x, y = x.to(args.device), y.to(args.device)
            loss = nn.functional.cross_entropy(model(x).reshape(-1, vocab), y.reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            losses.append(loss.item())
            print(f"step {step} loss {loss.item():.6f}", flush=True)
            park(args.hold_file, step)
            if args.step_sleep_s:
                time.sleep(args.step_sleep_s)
            if step >= args.steps:
                break
    with open(args.out, "w") as f:
        json.dump({"steps": step, "losses": losses, "digest": digest(model, opt)}, f)
    print(f"done {step}", flush=True)


if __name__ == "__main__":
    main()
