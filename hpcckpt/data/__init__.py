"""Where the data is: resumable positions inside an epoch, beside the loop API (``Checkpointer.batches``/``loop``).

- ``sampler``: ``ResumableSampler``, a sampler whose position is a few integers (O(1) resume).
- ``position``: ``LoaderPosition``, the pass over any DataLoader, resumed exactly.
- ``loaders``: how a loader is iterated (skipping trained batches, the RNGs a pass draws from).
- ``workers``: the seeds of persistent workers of loaders iterated outside the training loop.
- ``progress``: ``Progress``, the epoch, the loaders' passes and the end of the run, saved together.
"""
from __future__ import annotations

from .loaders import OVER, SKIP_MODES, iterating_loader
from .position import LoaderPosition
from .progress import Progress
from .sampler import ResumableSampler, find_resumable
from .workers import WorkerSeeds

__all__ = ["OVER", "SKIP_MODES", "LoaderPosition", "Progress", "ResumableSampler", "WorkerSeeds", "find_resumable",
           "iterating_loader"]
