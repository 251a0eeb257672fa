from __future__ import annotations

import json
from collections import Counter

import pytest

from hpcckpt.data import ResumableSampler
from hpcckpt.errors import CheckpointCorrupt, ConfigError


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
    assert len(b) == 100  # len() is the whole epoch's, wherever the position is
    assert list(iter(b)) == list(iter(ResumableSampler(100, seed=3)))  # a peek sees the whole epoch
    b.resume_next_iter()  # the training iterator of the resumed epoch (Checkpointer.loop/batches)
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


def test_tiny_dataset_still_gives_every_rank_the_same_count() -> None:
    shares = [list(iter(ResumableSampler(1, num_replicas=4, rank=r))) for r in range(4)]
    assert shares == [[0]] * 4


# --- resume on another world size -------------------------------------------------

def world(n: int, replicas: int, state: dict | None, *, seed: int = 5) -> list[ResumableSampler]:
    """The samplers of all ranks of a job; each loads the state saved by the previous job."""
    ranks = [ResumableSampler(n, seed=seed, num_replicas=replicas, rank=r) for r in range(replicas)]
    if state is not None:
        for s in ranks:
            s.load_state_dict(json.loads(json.dumps(state)))  # the state travels as JSON metadata
            s.resume_next_iter()
    return ranks


def step_all(ranks: list[ResumableSampler], per_rank: int | None) -> list[int]:
    """Every rank consumes ``per_rank`` samples (None: the rest of its share)."""
    seen: list[int] = []
    for s in ranks:
        k = s.per_rank - s.consumed if per_rank is None else per_rank
        seen += consume(s, k)
    return seen


def padding(n: int, start: int, replicas: int) -> int:
    return -(n - start) % replicas


@pytest.mark.parametrize("n, plan", [
    (100, [(4, 7), (2, None)]),            # 4 -> 2
    (100, [(2, 10), (4, None)]),           # 2 -> 4
    (100, [(4, 5), (1, None)]),            # 4 -> 1
    (99, [(3, 11), (2, None)]),            # 3 -> 2
    (120, [(4, 5), (2, 10), (3, None)]),   # 4 -> 2 -> 3, twice in one epoch
    (101, [(3, 10), (2, None)]),           # 3 -> 2, not divisible
    (103, [(4, 6), (2, 9), (3, None)]),    # 4 -> 2 -> 3, not divisible
    (10, [(4, 3), (2, None)]),             # interrupted at the epoch's end, inside the padding
    (10, [(3, 4), (4, None)]),             # ditto
    (5, [(4, 1), (2, None)]),              # remainder smaller than the new world
])
def test_resume_on_another_world_size_sees_each_item_of_the_epoch_once(n: int, plan: list) -> None:
    seen: list[int] = []
    state = None
    start = 0
    pad_total = 0
    for replicas, per_rank in plan:
        ranks = world(n, replicas, state)
        assert {json.dumps(s.state_dict()) for s in ranks} == {json.dumps(ranks[0].state_dict())}
        assert all(s.consumed == 0 and s.start == start and s.epoch == 0 for s in ranks)
        assert all(s.per_rank == -(-(n - start) // replicas) and len(s) == -(-n // replicas) for s in ranks)
        pad_total += padding(n, start, replicas)
        seen += step_all(ranks, per_rank)
        state = ranks[0].state_dict()
        assert all(isinstance(v, int) for v in state.values())
        start = min(n, start + ranks[0].consumed * replicas)
    c = Counter(seen)
    assert set(c) == set(range(n))  # every item of the epoch, none lost
    extra = sum(c.values()) - n
    if pad_total == 0:
        assert extra == 0 and max(c.values()) == 1  # exactly once
    else:
        assert 0 <= extra <= pad_total


def test_repartition_covers_exactly_the_rest_of_the_permutation() -> None:
    n = 100
    perm = ResumableSampler(n, seed=5).permutation(0).tolist()
    old = world(n, 4, None)
    before = step_all(old, 7)
    assert sorted(before) == sorted(perm[:28])
    new = world(n, 2, old[0].state_dict())
    shares = [list(iter(s)) for s in new]
    assert shares == [perm[28::2], perm[29::2]]


def test_end_of_epoch_resume_on_another_world_then_next_epoch_is_whole() -> None:
    old = world(10, 4, None)
    step_all(old, None)  # 3 per rank, 2 of them padding
    new = world(10, 2, old[0].state_dict())
    assert [s.per_rank - s.consumed for s in new] == [0, 0] and [list(iter(s)) for s in new] == [[], []]
    for s in new:
        s.set_epoch(1)
    shares = [list(iter(s)) for s in new]
    assert [len(x) for x in shares] == [5, 5] and sorted(shares[0] + shares[1]) == list(range(10))
    fresh = world(10, 2, None)
    for s in fresh:
        s.set_epoch(1)
    assert shares == [list(iter(s)) for s in fresh]  # later epochs are whole partitions


def test_same_world_resume_after_a_repartition_keeps_the_order() -> None:
    old = world(100, 4, None)
    step_all(old, 6)
    mid = world(100, 2, old[0].state_dict())
    step_all(mid, 9)
    uninterrupted = [list(iter(s))[9:] for s in world(100, 2, old[0].state_dict())]
    again = world(100, 2, mid[0].state_dict())
    assert [list(iter(s)) for s in again] == uninterrupted
    assert [s.consumed for s in again] == [9, 9]


def test_same_world_resume_keeps_each_ranks_order() -> None:
    a = world(10, 3, None)
    step_all(a, 2)
    b = world(10, 3, a[0].state_dict())
    assert [list(iter(s)) for s in b] == [list(iter(s))[2:] for s in world(10, 3, None)]


def test_old_format_state_without_start_loads() -> None:
    a = ResumableSampler(100, seed=3, num_replicas=2, rank=1)
    first = consume(a, 20)
    old = {"epoch": 0, "consumed": 20, "seed": 3, "dataset_len": 100, "num_replicas": 2}
    b = ResumableSampler(100, seed=3, num_replicas=2, rank=1)
    b.load_state_dict(old)
    b.resume_next_iter()
    assert first + list(iter(b)) == list(iter(ResumableSampler(100, seed=3, num_replicas=2, rank=1)))
    c = ResumableSampler(100, seed=3, num_replicas=4, rank=0)
    c.load_state_dict(old)
    assert c.start == 40 and c.consumed == 0 and c.per_rank == 15 and len(c) == 25


@pytest.mark.parametrize("key, value", [("seed", 4), ("dataset_len", 11)])
def test_other_data_is_refused(key: str, value: int) -> None:
    a = ResumableSampler(10, seed=3, num_replicas=2, rank=0)
    state = a.state_dict() | {key: value}
    b = ResumableSampler(10, seed=3, num_replicas=1, rank=0)
    with pytest.raises(ConfigError, match=key):
        b.load_state_dict(state)


def test_damaged_state_is_refused() -> None:
    b = ResumableSampler(10)
    with pytest.raises(CheckpointCorrupt, match="lacks"):
        b.load_state_dict({"epoch": 0})
    with pytest.raises(CheckpointCorrupt, match="inconsistent"):
        b.load_state_dict(b.state_dict() | {"start": 11})
