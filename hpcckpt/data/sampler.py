"""A resumable data position: O(1) resume inside an epoch.

The order of epoch ``e`` is a permutation drawn from ``(seed, e)`` alone, so the
position is a few integers: the epoch, where the current partition of it starts and
how many samples of it were consumed. A resumed epoch yields exactly the remaining
samples, each once, without replaying the consumed batches. ``Checkpointer.loop``
counts consumed samples as the batches reach the training code (a DataLoader may
prefetch ahead of that).
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import Sampler

from ..errors import CheckpointCorrupt, ConfigError


class ResumableSampler(Sampler[int]):
    """Shuffling (or sequential) sampler whose position survives a restart.

    With ``num_replicas > 1`` each rank takes a strided share of the permutation
    (padded like DistributedSampler, by wrapping to the beginning, so that every rank
    sees the same count).

    The position inside epoch ``e`` is ``(start, consumed)``: the current partition
    covers ``perm[start:]`` (``perm`` is the epoch's permutation of the dataset),
    strided over the ``num_replicas`` ranks and padded, and each rank has consumed
    ``consumed`` samples of its share. A new epoch starts at ``start = 0``.

    Resume on the same number of ranks is exact: every rank yields exactly the samples
    it would have yielded without the interruption, in the same order.

    Resume on another number of ranks re-partitions the *remaining* samples of the
    interrupted epoch: the consumed samples of a strided partition are exactly its
    first ``consumed * old_replicas`` positions, so the new partition starts there
    and strides ``perm[start:]`` over the new ranks. The *set* of samples seen in the
    epoch does not change: each sample is seen once (plus the few padding duplicates
    that keep every rank at the same count, when the remaining samples do not divide
    evenly over the ranks). What changes is which rank sees which of the remaining
    samples, and in what order across ranks, so batch composition (and so the
    floating-point result of a step) differs from the uninterrupted run until the
    epoch ends. Later epochs are again whole partitions of their permutation over
    the new ranks.
    """

    def __init__(self, dataset_len: int, *, seed: int = 0, shuffle: bool = True,
                 num_replicas: int = 1, rank: int = 0) -> None:
        if dataset_len <= 0:
            raise ConfigError(f"ResumableSampler needs a non-empty dataset, got length {dataset_len}")
        if num_replicas < 1:
            raise ConfigError(f"ResumableSampler needs num_replicas >= 1, got {num_replicas}")
        if not 0 <= rank < num_replicas:
            raise ConfigError(f"rank {rank} is outside 0..{num_replicas - 1}")
        self.dataset_len = dataset_len
        self.seed = seed
        self.shuffle = shuffle
        self.num_replicas = num_replicas
        self.rank = rank
        self.epoch = 0
        self.consumed = 0  # samples of this rank's share of the current partition already consumed
        self._base = 0     # the current partition of `epoch` covers perm[_base:]
        self._skip = 0     # how many samples of this rank's share the next __iter__ skips

    @property
    def start(self) -> int:
        """Where the current partition of this epoch starts in the epoch's permutation."""
        return self._base

    @property
    def per_rank(self) -> int:
        """Samples per rank in the current partition (padding included)."""
        return -(-(self.dataset_len - self._base) // self.num_replicas)

    def __len__(self) -> int:
        """The length of a whole epoch on this rank, wherever the position is (``len(loader)``
        written after ``register()`` gives the same total as in the uninterrupted run)."""
        return -(-self.dataset_len // self.num_replicas)

    @property
    def exhausted(self) -> bool:
        """Every sample of this rank's share of the current epoch was consumed."""
        return self.consumed >= self.per_rank

    def resume_next_iter(self) -> None:
        """Make the next ``__iter__`` (only that one) start at the consumed position.

        The training iterator of a resumed epoch is the only one that skips: other
        iterators (a ``next(iter(loader))`` peek, an evaluation pass) see the whole
        epoch, as they did in the uninterrupted run. ``Checkpointer.loop``/``batches``
        call this; use it yourself only when you iterate the loader without them.
        """
        self._skip = self.consumed

    def permutation(self, epoch: int) -> torch.Tensor:
        """The order of the whole dataset in ``epoch`` (unpadded, independent of ranks)."""
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed * 1_000_003 + epoch)
            return torch.randperm(self.dataset_len, generator=g)
        return torch.arange(self.dataset_len)

    def order(self, epoch: int) -> torch.Tensor:
        """This rank's share of ``epoch``: of the current partition for the current
        epoch (the remaining samples after a re-partition), of the whole epoch otherwise."""
        base = self._base if epoch == self.epoch else 0
        rest = self.permutation(epoch)[base:]
        if len(rest) == 0:
            return rest
        per_rank = -(-len(rest) // self.num_replicas)
        total = per_rank * self.num_replicas
        if total > len(rest):  # pad by wrapping to the beginning of the remainder
            reps = -(-total // len(rest))
            rest = rest.repeat(reps)[:total]
        return rest[self.rank::self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        mine = self.order(self.epoch)
        skip = self._skip
        self._skip = 0
        return iter(mine[skip:].tolist())

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` (a no-op for the current epoch, so a resumed position survives
        the ``sampler.set_epoch(epoch)`` at the top of an epoch loop)."""
        if epoch != self.epoch:
            self.epoch = epoch
            self.consumed = 0
            self._base = 0
            self._skip = 0

    def advance(self, n_samples: int) -> None:
        """Record that ``n_samples`` more samples reached the training code."""
        self.consumed += n_samples

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "consumed": self.consumed, "start": self._base, "seed": self.seed,
                "dataset_len": self.dataset_len, "num_replicas": self.num_replicas}

    @staticmethod
    def check_state(state: Any) -> None:
        """Raise CheckpointCorrupt unless ``state`` is a well-formed saved sampler state."""
        if not isinstance(state, Mapping):
            raise CheckpointCorrupt(f"sampler state is a {type(state).__name__}, not a mapping")
        missing = [k for k in ("epoch", "consumed", "seed", "dataset_len", "num_replicas") if k not in state]
        if missing:
            raise CheckpointCorrupt(f"sampler state lacks {missing}; it was not saved by "
                                    "ResumableSampler.state_dict")
        bad = [k for k in ("epoch", "consumed", "start", "seed", "dataset_len", "num_replicas")
               if k in state and not _is_int(state[k])]
        if bad:
            raise CheckpointCorrupt(f"sampler state has non-integer {bad}")

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.check_state(state)
        for key in ("seed", "dataset_len"):
            if state[key] != getattr(self, key):
                raise ConfigError(
                    f"sampler {key} was {state[key]} when the checkpoint was saved and is "
                    f"{getattr(self, key)} now; resume with the same {key} (the position in the "
                    f"epoch only means something for the same data order)")
        epoch, consumed = int(state["epoch"]), int(state["consumed"])
        start = int(state.get("start", 0))  # states saved before re-partitioning existed start at 0
        replicas = int(state["num_replicas"])
        if epoch < 0 or consumed < 0 or replicas < 1 or not 0 <= start <= self.dataset_len:
            raise CheckpointCorrupt(
                f"sampler state is inconsistent (epoch={epoch}, consumed={consumed}, start={start}, "
                f"num_replicas={replicas}, dataset_len={self.dataset_len}): the checkpoint's sampler "
                "state is damaged")
        self.epoch = epoch
        if replicas == self.num_replicas:
            # Same world size: the exact position, so every rank yields what it would have.
            self._base = start
            self.consumed = consumed
        else:
            # Another world size: the consumed samples of a strided partition are its first
            # consumed * replicas positions (past the remainder's length they are padding
            # duplicates); the rest of the epoch is partitioned over the new ranks.
            self._base = min(self.dataset_len, start + consumed * replicas)
            self.consumed = 0
            self._skip = 0


# --- any DataLoader: the position of its training pass, replayed exactly ----------------------


def find_resumable(loader: Any) -> ResumableSampler | None:
    """The ResumableSampler that drives ``loader`` (its sampler, or its batch sampler's)."""
    for candidate in (getattr(loader, "sampler", None),
                      getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        if isinstance(candidate, ResumableSampler):
            return candidate
    return None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
