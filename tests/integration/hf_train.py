"""A small Hugging Face Trainer job for the integration tests (nothing downloaded).

    python tests/integration/hf_train.py --dir RUN [--steps N] [--mode hpcckpt|plain] [--stop-at S] [--hold-at S]

A tiny GPT-2 built from a config (dropout on), AdamW, cosine LR, the Trainer's own
shuffled sampler. Each trained step appends its loss (exact float hex) to
RUN/trace.jsonl (process 0); the end writes RUN/result.json with a parameter digest.
``--stop-at S`` sends SIGUSR2 to itself during step S of the first run; ``--hold-at S``
waits in step S of the first run until a signal arrives (a test preempts it there).
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
from typing import Any

import group_exit  # beside this script
import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

VOCAB, SEQ, SAMPLES = 32, 8, 64


class Tokens(Dataset):  # type: ignore[type-arg]
    def __init__(self) -> None:
        self.data = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=torch.Generator().manual_seed(1234))

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.data[i], "labels": self.data[i]}


class TracingTrainer(Trainer):
    """Records each step's exact loss and stops/holds at a chosen step (test instrumentation)."""

    def __init__(self, *a: Any, run: argparse.Namespace, first_run: bool, **k: Any) -> None:
        super().__init__(*a, **k)
        self.run, self.first_run = run, first_run

    def compute_loss(self, model: Any, inputs: Any, *a: Any, **k: Any) -> Any:
        loss = super().compute_loss(model, inputs, *a, **k)
        if not model.training:
            return loss  # evaluation
        step = int(self.state.global_step)
        time.sleep(self.run.step_sleep)
        if self.args.process_index == 0:
            with (self.run.dir / "trace.jsonl").open("a") as f:
                f.write(json.dumps({"step": step, "loss": float(loss.detach()).hex()}) + "\n")
        if self.first_run and step == self.run.stop_at:
            os.kill(os.getpid(), signal.SIGUSR2)
        if self.first_run and step == self.run.hold_at:
            print(f"holding at step {step} until a signal arrives", flush=True)
            cb = next(c for c in self.callback_handler.callbacks if hasattr(c, "resume_point"))
            while cb.ckpt.signals.first() is None:
                time.sleep(0.05)
        return loss


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--dir", required=True, type=Path)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--mode", default="hpcckpt", choices=["hpcckpt", "plain", "own"],
                   help="own: the Trainer's own checkpoints, with hpcckpt.own.hf_callback() (under hpcckpt run --mode own)")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds each training step sleeps (a slower job)")
    p.add_argument("--stop-at", type=int, default=None)
    p.add_argument("--hold-at", type=int, default=None)
    p.add_argument("--every", type=int, default=None, help="periodic checkpoint interval (default: none)")
    p.add_argument("--eval-every", type=int, default=None, help="evaluate every N steps (default: never)")
    run = p.parse_args(argv)
    run.dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    first_run = restarts == 0 and not (run.dir / "ckpt" / "LATEST").exists()
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=1, n_head=2,
                        bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    args = TrainingArguments(
        output_dir=str(run.dir / "hf-out"), max_steps=run.steps, per_device_train_batch_size=8,
        learning_rate=3e-3, weight_decay=0.01, lr_scheduler_type="cosine", optim="adamw_torch",
        save_strategy="no", report_to=[], logging_strategy="no", seed=0, data_seed=7,
        dataloader_num_workers=0, use_cpu=True, disable_tqdm=True,
        eval_strategy="steps" if run.eval_every else "no", eval_steps=run.eval_every)
    callbacks: list[Any] = []
    resume = None
    if run.mode == "hpcckpt":
        from hpcckpt.integrations.hf import HpcckptTrainerCallback
        cb = HpcckptTrainerCallback(dir=run.dir / "ckpt", every_steps=run.every)
        callbacks.append(cb)
    if run.mode == "own":
        from transformers.trainer_utils import get_last_checkpoint

        import hpcckpt.own as own

        callbacks.append(own.hf_callback())
        resume = get_last_checkpoint(str(run.dir / "hf-out")) if (run.dir / "hf-out").exists() else None
    trainer = TracingTrainer(model=model, args=args, train_dataset=Tokens(), callbacks=callbacks,
                             eval_dataset=Tokens() if run.eval_every else None,
                             run=run, first_run=first_run)
    if callbacks and run.mode == "hpcckpt":
        resume = callbacks[0].resume_point(trainer)
    trainer.train(resume_from_checkpoint=resume)
    if args.process_index == 0:
        result = {"param_digest": digest(model), "global_step": int(trainer.state.global_step),
                  "world_size": int(args.world_size)}
        (run.dir / "result.json").write_text(json.dumps(result))
    group_exit.leave()  # the Trainer left its process group to the interpreter's exit
    return 0


if __name__ == "__main__":
    sys.exit(main())
