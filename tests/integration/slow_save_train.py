"""A training loop whose checkpoint is slow: a registered object's state_dict() sleeps
``--save-sleep`` seconds (as a large state gathered to the host would take). No periodic
saves: only the stop's final checkpoint is taken. Used by test_slurm_slow_save.py."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch

from hpcckpt.api import preemptible


class SlowState:
    """A counter whose state_dict() takes ``sleep_s`` seconds."""

    def __init__(self, sleep_s: float) -> None:
        self.sleep_s = sleep_s
        self.count = torch.zeros(1)

    def state_dict(self) -> dict[str, Any]:
        time.sleep(self.sleep_s)
        return {"count": self.count.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count = state["count"].clone()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--step-sleep", type=float, default=0.5)
    p.add_argument("--save-sleep", type=float, default=20.0)
    args = p.parse_args()
    slow = SlowState(args.save_sleep)

    @preemptible(dir=args.dir, every_steps=1_000_000)
    def train(ckpt: Any) -> None:
        ckpt.register(slow=slow)
        for _ in ckpt.steps(args.steps):
            slow.count += 1
            time.sleep(args.step_sleep)

    train()
    return 0


if __name__ == "__main__":
    sys.exit(main())
