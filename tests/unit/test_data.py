from __future__ import annotations

from collections import Counter

import pytest

from hpcckpt.data import ResumableSampler
from hpcckpt.errors import ConfigError


def consume(s: ResumableSampler, n: int) -> list[int]:
    it = iter(s)
    out = [next(it) for _ in range(n)]
    s.advance(n)
    return out


def test_resume_mid_epoch_yields_exactly_the_rest() -> None:
    a = ResumableSampler(100, seed=3)
    first = consume(a, 37)
    state = a.state_dict()
    b = ResumableSampler(100, seed=3)
    b.load_state_dict(state)
    rest = list(iter(b))
    assert len(rest) == 63
    assert sorted(first + rest) == list(range(100))  # each item once per epoch
    assert first + rest == list(iter(ResumableSampler(100, seed=3)))  # same order as uninterrupted


def test_epochs_differ_and_are_reproducible() -> None:
    s = ResumableSampler(50, seed=1)
    e0 = list(iter(s))
    s.set_epoch(1)
    e1 = list(iter(s))
    assert e0 != e1 and sorted(e1) == list(range(50))
    t = ResumableSampler(50, seed=1)
    t.set_epoch(1)
    assert list(iter(t)) == e1


def test_replicas_partition_the_epoch() -> None:
    shares = [list(iter(ResumableSampler(10, seed=0, num_replicas=3, rank=r))) for r in range(3)]
    assert all(len(s) == 4 for s in shares)
    c = Counter(i for s in shares for i in s)
    assert set(c) == set(range(10)) and sum(c.values()) == 12  # padded like DistributedSampler


def test_resume_with_other_world_size_is_refused() -> None:
    a = ResumableSampler(10, num_replicas=2, rank=0)
    b = ResumableSampler(10, num_replicas=1, rank=0)
    with pytest.raises(ConfigError, match="num_replicas"):
        b.load_state_dict(a.state_dict())
