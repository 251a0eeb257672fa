"""How the test training scripts leave once a distributed run has written everything.

Trainers (Lightning's DDP strategy, the Hugging Face Trainer) make the process group and leave
it to the interpreter's exit, where torch 2.13's gloo backend races with itself: its worker
thread, still destroying a finished collective's work, waits for the GIL to drop a Python
tensor, while the main thread, holding the GIL, destroys the DDP reducer -> ProcessGroupGloo,
whose destructor joins that worker. That deadlocks (py-spy: MainThread in ~ProcessGroupGloo /
std::thread::join, the gloo thread in ~AsyncAllgatherWork / gil_scoped_acquire; 1 run in 5
with a CPU-bound process beside it) or aborts a rank ("terminate called without an active
exception", exit -6: the Lightning reference run failed so in a fresh-clone CI run).
"""
from __future__ import annotations

import os
import sys

import torch


def leave() -> None:
    """Once a run is complete: if a process group is up, every rank meets at a barrier (all
    have written their results), then leaves without the interpreter's teardown, so nothing of
    the group is destroyed while its threads still work. Without a group, returns."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    torch.distributed.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
