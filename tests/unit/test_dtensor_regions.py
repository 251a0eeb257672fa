"""The geometry of DTensor pieces (store/regions.py) and the manifest's checks of it: a
region piece records its global offsets and lengths (or runs) in every dimension, the
pieces must tile the tensor exactly, and byte-range pieces are cut into boxes so that
either kind restores into either (issue 58). In one process, no torch.distributed.
"""
from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from typing import Any

import pytest
import torch

from hpcckpt.errors import CheckpointFailed
from hpcckpt.store import manifest as manifest_mod
from hpcckpt.store import regions
from hpcckpt.store.manifest import Invalid, validate
from hpcckpt.store.shared import merge_shared, tiling_problem


def _elements(shape: tuple[int, ...], region: regions.Region) -> list[int]:
    """Row-major indices of a region's elements, in the piece's own order."""
    out = []
    for idx in itertools.product(*[[i for s, n in runs for i in range(s, s + n)] for runs in region]):
        f = 0
        for d, i in zip(shape, idx):
            f = f * d + i
        out.append(f)
    return out


@pytest.mark.parametrize("seed", range(4))
def test_a_byte_range_is_cut_into_boxes_in_its_own_order(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(300):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(0, 4)))
        n = 1
        for d in shape:
            n *= d
        a = rng.randint(0, n)
        b = rng.randint(a, n)
        boxes = regions.range_boxes(shape, a, b)
        assert [i for box in boxes for i in _elements(shape, box)] == list(range(a, b)), (shape, a, b, boxes)
        assert len(boxes) <= max(1, 2 * len(shape) - 1)
        assert all(regions.as_range(shape, box) is not None for box in boxes)
        assert regions.tiling_problem(shape, regions.range_boxes(shape, 0, a) + boxes
                                      + regions.range_boxes(shape, b, n)) is None


def test_overlaps_pair_the_same_global_elements() -> None:
    g = torch.arange(6 * 7 * 4).reshape(6, 7, 4)
    src: regions.Region = (((1, 2), (4, 1)), ((0, 7),), ((1, 3),))  # rows 1, 2 and 4 (a strided shard)
    dst = regions.box([2, 3, 0], [4, 3, 4])
    piece = g[[1, 2, 4]][:, :, 1:4]
    out = torch.full((4, 3, 4), -1)
    for s, d in regions.overlaps(src, dst):
        out[d] = piece[s]
    want = g[2:6, 3:6, :]
    held = out != -1
    assert torch.equal(out[held], want[held])
    assert held.sum() == 2 * 3 * 3  # rows 2 and 4, all 3 columns, depth 1..3


def test_tiling_refuses_overlaps_gaps_and_out_of_bounds() -> None:
    shape = (4, 6)
    good = [regions.box([0, 0], [4, 3]), regions.box([0, 3], [2, 3]), regions.box([2, 3], [2, 3])]
    assert regions.tiling_problem(shape, good) is None
    # the same volume, one row of the third box moved up onto the second: an overlap and a gap
    assert "overlap" in (regions.tiling_problem(shape, good[:2] + [regions.box([1, 3], [2, 3])]) or "")
    assert "cover" in (regions.tiling_problem(shape, good[:2]) or "")
    with pytest.raises(ValueError, match="leaves dimension 1"):
        regions.piece_region({"offsets": [0, 4], "lengths": [1, 3]}, shape)
    with pytest.raises(ValueError, match="whole number"):
        regions.piece_region({"offsets": [0, "4"], "lengths": [1, 1]}, shape)
    with pytest.raises(ValueError, match="one number per dimension"):
        regions.piece_region({"offsets": [0], "lengths": [1]}, shape)


def test_a_region_that_is_not_a_byte_range_never_tiles_as_byte_ranges() -> None:
    """What a reader of byte-range pieces only (hpcckpt before regions) makes of a checkpoint
    with a column shard: its tiling check refuses it (never a misread tensor)."""
    shape, itemsize = (4, 6), 4
    pieces = []
    for r, box in enumerate([regions.box([0, 0], [4, 3]), regions.box([0, 3], [4, 3])]):
        pieces.append({"rank": r, "start": regions.first_index(shape, box) * itemsize,
                       "nbytes": regions.volume(box) * itemsize})
    assert tiling_problem({"dtype": "float32", "shape": list(shape), "pieces": pieces}) is not None


def _records(shape: list[int], boxes: list[regions.Region], dtype: str = "float32") -> list[dict[str, Any]]:
    """Commit records of ranks that each hold one box of ``objects/model/w`` as a DTensor shard."""
    records = []
    itemsize = 4
    for r, box in enumerate(boxes):
        nbytes = regions.volume(box) * itemsize
        piece = {"start": regions.first_index(shape, box) * itemsize, **regions.piece_fields(box)}
        records.append({"file": f"rank-{r}.h5", "format": "hdf5",
                        "tensors": {"objects/model/w": {"dtype": dtype, "shape": [nbytes // itemsize],
                                                        "offset": 4096, "nbytes": nbytes, "crc32c": 0}},
                        "file_info": {"bytes": 4096 + nbytes},
                        "meta": {"step": 1, "objects": {}, "refs": [{"__tensor__": "objects/model/w"}]},
                        "pieces": {"objects/model/w": piece},
                        "shared_digest": "", **({"shared": {"objects/model/w": {
                            "dtype": dtype, "shape": shape, "kind": "sharded"}}} if r == 0 else {})})
    from hpcckpt.store.shared import digest
    for rec in records:
        rec["shared_digest"] = digest(records[0]["shared"])
    return records


COLUMNS = [regions.box([0, 0], [5, 6]), regions.box([0, 6], [5, 5])]  # Shard(1) of a (5, 11) tensor


def _manifest(boxes: list[regions.Region] = COLUMNS) -> dict[str, Any]:
    m = manifest_mod.build(step=1, engine="sync", job={}, user={}, records=_records([5, 11], boxes))
    validate(m, step=1)
    return m


def test_region_pieces_commit_with_their_offsets_and_lengths() -> None:
    spec = _manifest()["shared"]["objects/model/w"]
    assert [(p["rank"], p["start"], p["nbytes"], p["offsets"], p["lengths"]) for p in spec["pieces"]] == [
        (0, 0, 120, [0, 0], [5, 6]), (1, 24, 100, [0, 6], [5, 5])]


def test_region_pieces_that_overlap_fail_the_commit() -> None:
    with pytest.raises(CheckpointFailed, match="overlap"):
        merge_shared(_records([5, 11], [regions.box([0, 0], [5, 6]), regions.box([0, 5], [5, 5])]))


def _piece(m: dict[str, Any], i: int) -> dict[str, Any]:
    return dict(m["shared"]["objects/model/w"]["pieces"][i])


CASES: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "out of bounds": (lambda m: m["shared"]["objects/model/w"]["pieces"][1].update(offsets=[0, 7]), "leaves"),
    "not a number": (lambda m: m["shared"]["objects/model/w"]["pieces"][1].update(lengths=[5, None]),
                     "no readable region"),
    "start elsewhere": (lambda m: m["shared"]["objects/model/w"]["pieces"][1].update(start=28), "starts at byte"),
    "region past its bytes": (lambda m: m["shared"]["objects/model/w"]["pieces"][1].update(lengths=[4, 5]),
                              "holds 100 bytes"),
    "bad runs": (lambda m: m["shared"]["objects/model/w"]["pieces"][1].pop("offsets") and
                 m["shared"]["objects/model/w"]["pieces"][1].update(runs=[[[0, 5]]]), "one list per dimension"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_crafted_region_pieces_are_refused_by_name(case: str) -> None:
    m = _manifest()
    change, words = CASES[case]
    change(m)
    with pytest.raises(Invalid, match=words):
        validate(m, step=1)


def test_runs_pieces_validate() -> None:
    strided: list[regions.Region] = [(((0, 1), (2, 1), (4, 1)), ((0, 11),)), (((1, 1), (3, 1)), ((0, 11),))]
    m = _manifest(strided)
    assert [p.get("runs") for p in m["shared"]["objects/model/w"]["pieces"]] == [
        [[[0, 1], [2, 1], [4, 1]], [[0, 11]]], [[[1, 1], [3, 1]], [[0, 11]]]]
    assert _piece(m, 0)["nbytes"] == 3 * 11 * 4
