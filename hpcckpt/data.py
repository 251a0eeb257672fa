"""A resumable data position: O(1) resume inside an epoch.

The order of epoch ``e`` is a permutation drawn from ``(seed, e)`` alone, so the
position is two integers: the epoch and how many samples of it were consumed. A
resumed epoch yields exactly the remaining samples, each once, without replaying
the consumed batches. ``Checkpointer.loop`` counts consumed samples as the batches
reach the training code (a DataLoader may prefetch ahead of that).
"""
from __future__ import annotations

from typing import Any, Iterator, Mapping

import torch
from torch.utils.data import Sampler

from .errors import ConfigError


class ResumableSampler(Sampler[int]):
    """Shuffling (or sequential) sampler whose position survives a restart.

    With ``num_replicas > 1`` each rank takes a strided share of the permutation
    (padded like DistributedSampler so that every rank sees the same count).
    """

    def __init__(self, dataset_len: int, *, seed: int = 0, shuffle: bool = True,
                 num_replicas: int = 1, rank: int = 0) -> None:
        if dataset_len <= 0:
            raise ConfigError(f"ResumableSampler needs a non-empty dataset, got length {dataset_len}")
        if not 0 <= rank < num_replicas:
            raise ConfigError(f"rank {rank} is outside 0..{num_replicas - 1}")
        self.dataset_len = dataset_len
        self.seed = seed
        self.shuffle = shuffle
        self.num_replicas = num_replicas
        self.rank = rank
        self.epoch = 0
        self.consumed = 0  # samples of this rank's share already consumed in `epoch`
        self._start = 0    # where the next __iter__ starts

    @property
    def per_rank(self) -> int:
        return -(-self.dataset_len // self.num_replicas)

    def __len__(self) -> int:
        return self.per_rank - self._start

    def order(self, epoch: int) -> torch.Tensor:
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed * 1_000_003 + epoch)
            perm = torch.randperm(self.dataset_len, generator=g)
        else:
            perm = torch.arange(self.dataset_len)
        total = self.per_rank * self.num_replicas
        if total > self.dataset_len:
            perm = torch.cat([perm, perm[: total - self.dataset_len]])
        return perm[self.rank::self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        mine = self.order(self.epoch)
        start = self._start
        self._start = 0
        return iter(mine[start:].tolist())

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch = epoch
            self.consumed = 0
            self._start = 0

    def advance(self, n_samples: int) -> None:
        """Record that ``n_samples`` more samples reached the training code."""
        self.consumed += n_samples

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "consumed": self.consumed, "seed": self.seed,
                "dataset_len": self.dataset_len, "num_replicas": self.num_replicas}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for key in ("seed", "dataset_len", "num_replicas"):
            if state[key] != getattr(self, key):
                raise ConfigError(
                    f"sampler {key} was {state[key]} when the checkpoint was saved and is "
                    f"{getattr(self, key)} now; resume with the same data and world size")
        self.epoch = int(state["epoch"])
        self.consumed = int(state["consumed"])
        self._start = self.consumed
