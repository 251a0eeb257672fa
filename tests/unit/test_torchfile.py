"""The sync engine's archive read without ``torch.load``: ``torchfile._index`` reads the
archive's pickle with a restricted C unpickler (nothing built, nothing called but what
torch.save writes for a dict of tensors), every tensor is read from its record by the
parallel reader and checked, and anything else goes through ``torch.load(weights_only=True)``."""
from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch

from hpcckpt.errors import CheckpointCorrupt
from hpcckpt.store import torchfile
from hpcckpt.store.entry import dtype_name
from hpcckpt.store.tensortable import TensorTable

pytestmark = pytest.mark.native

TENSORS = {
    "objects/model/w": torch.randn(7, 5),
    "objects/model/b": torch.arange(5, dtype=torch.bfloat16),
    "objects/model/empty": torch.empty(0, 3),
    "rng/torch": torch.randint(0, 255, (16,), dtype=torch.uint8),
    "rng/numpy/1": torch.arange(624, dtype=torch.int64).to(torch.uint32),  # a dtype torch.save writes with _rebuild_tensor_v3
    "step": torch.tensor(3.0),
}


def _written(tmp_path: Path, tensors: dict[str, torch.Tensor] = TENSORS) -> tuple[Path, dict[str, object]]:
    path = tmp_path / "rank-0.pt"
    rec = torchfile.write(path, tensors)
    return path, rec


def _without_offsets(rec: dict[str, object]) -> dict[str, object]:
    """``rec`` as a manifest written before the sync format recorded offsets has it."""
    t = rec["tensors"]
    assert isinstance(t, TensorTable)
    return {**rec, "tensors": TensorTable(t.names, t.dtypes, t.shapes, t.nbytes, t.crcs)}


def test_the_index_finds_every_tensor_and_the_read_never_calls_torch_load(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    path, rec = _written(tmp_path)
    fd = os.open(path, os.O_RDONLY)
    try:
        found = torchfile._index(fd, rec, os.fstat(fd).st_size)
    finally:
        os.close(fd)
    assert found is not None and set(found) == set(TENSORS)
    raw = path.read_bytes()
    for name, e in found.items():
        t = TENSORS[name]
        assert (e.dtype, e.shape, e.nbytes) == (dtype_name(t.dtype), tuple(t.shape), t.numel() * t.element_size())
        assert raw[e.offset:e.offset + e.nbytes] == t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes(), name

    def no_torch_load(*args: object, **kwargs: object) -> None:
        raise AssertionError("torch.load was called for an archive the index reads")
    monkeypatch.setattr(torchfile.torch, "load", no_torch_load)
    for r in (rec, _without_offsets(rec)):  # the recorded offsets, and the archive's own index
        got = torchfile.read(path, r)
        assert set(got) == set(TENSORS)
        for name, t in TENSORS.items():
            assert got[name].dtype == t.dtype and got[name].shape == t.shape and torch.equal(got[name], t), name
            assert got[name].untyped_storage().nbytes() == t.numel() * t.element_size()  # its own memory
        assert torchfile.verify(path, r) == []


def test_the_writer_records_where_each_tensor_landed(tmp_path: Path) -> None:
    """The offsets found from torch.save's writes are the archive's own (``_index``), for
    tied tensors (one storage), tensors of identical bytes (each its own record) and empty ones too."""
    w = torch.randn(4, 4)
    tensors = {**TENSORS, "objects/model/tied": TENSORS["objects/model/w"], "objects/a": torch.zeros(8),
               "objects/b": torch.zeros(8), "objects/e2": torch.empty(0), "objects/big": w}
    path, rec = _written(tmp_path, tensors)
    table = rec["tensors"]
    assert isinstance(table, TensorTable) and table.offsets is not None
    fd = os.open(path, os.O_RDONLY)
    try:
        found = torchfile._index(fd, _without_offsets(rec), os.fstat(fd).st_size)
    finally:
        os.close(fd)
    assert found is not None
    raw = path.read_bytes()
    for name, off, nbytes in zip(table.names, table.offsets, table.nbytes):
        if not nbytes:
            continue
        assert off == found[name].offset, name
        want = tensors[name].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        assert raw[off:off + nbytes] == want, name
    got = torchfile.read(path, rec)
    for name, t in tensors.items():
        assert torch.equal(got[name], t), name


def test_offsets_are_left_out_when_a_record_was_not_one_write() -> None:
    """``_offsets`` gives every tensor's place or none (readers then use the archive's index)."""
    places = {0x1000: (960, 40, 7), 0x2000: (1088, 24, 9)}
    assert torchfile._offsets(places, [0x1000, 0, 0x2000], [40, 0, 24], [7, 0, 9]) == [960, 0, 1088]
    assert torchfile._offsets(places, [0x1000, 0x2000, 0x3000], [40, 24, 12], [7, 9, 5]) is None  # not written
    assert torchfile._offsets(places, [0x1000], [40], [8]) is None  # its memory, other bytes than it holds now
    assert torchfile._offsets(places, [0x1000], [24], [9]) is None  # another size at that address
    assert torchfile._offsets(places, [0x1000, 0x1000], [40, 40], [7, 7]) == [960, 960]  # one storage, two names


def test_offsets_that_point_elsewhere_are_caught_by_the_checksums(tmp_path: Path) -> None:
    """A manifest whose offsets (sealed, but say mistaken) name other bytes: verify names the
    tensors and read refuses; nothing wrong is returned."""
    path, rec = _written(tmp_path)
    t = rec["tensors"]
    assert isinstance(t, TensorTable) and t.offsets is not None
    i, j = t.names.index("objects/model/w"), t.names.index("rng/torch")
    offsets = list(t.offsets)
    offsets[i] = offsets[j]
    bad = {**rec, "tensors": TensorTable(t.names, t.dtypes, t.shapes, t.nbytes, t.crcs, offsets)}
    problems = torchfile.verify(path, bad)
    assert len(problems) == 1 and "objects/model/w" in problems[0] and "fails its checksum" in problems[0]
    with pytest.raises(CheckpointCorrupt, match="objects/model/w"):
        torchfile.read(path, bad)
    assert torchfile.verify(path, rec) == []


def test_a_flipped_byte_is_named_by_verify_and_refused_by_read(tmp_path: Path) -> None:
    path, rec = _written(tmp_path)
    fd = os.open(path, os.O_RDONLY)
    offset = torchfile._index(fd, rec, os.fstat(fd).st_size)["objects/model/w"].offset  # type: ignore[index]
    os.close(fd)
    raw = bytearray(path.read_bytes())
    raw[offset + 9] ^= 0x10
    path.write_bytes(bytes(raw))
    problems = torchfile.verify(path, rec)
    assert len(problems) == 1 and "objects/model/w" in problems[0] and "fails its checksum" in problems[0]
    with pytest.raises(CheckpointCorrupt, match="objects/model/w"):
        torchfile.read(path, rec)


class _Boom:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, ("echo the restricted unpickler ran os.system >&2",))


def test_the_restricted_unpickler_calls_nothing_else() -> None:
    """A pickle naming any other global is refused before anything is called (the caller
    falls back to torch.load's weights-only unpickler, which refuses it too)."""
    import io
    for evil in (_Boom(), {"tensors": {"x": _Boom()}}):
        with pytest.raises(torchfile._Unrecognised):
            torchfile._Pickle(io.BytesIO(pickle.dumps(evil, protocol=2))).load()


def test_an_archive_the_index_does_not_recognise_is_read_by_torch_load(tmp_path: Path) -> None:
    """Saved by another writer (a tensor that is a view of a larger storage, as torch.save
    keeps it): the index declines, torch.load reads it, and the checks still apply."""
    path, rec = _written(tmp_path)
    base = torch.randn(100)
    view = base[10:45].view(7, 5)  # 35 floats of a 100-float storage
    with open(path, "wb") as f:
        torch.save({"tensors": {**TENSORS, "objects/model/w": view}}, f)
    rec = _without_offsets(rec)  # a manifest that does not say where the tensors are
    fd = os.open(path, os.O_RDONLY)
    try:
        assert torchfile._index(fd, rec, os.fstat(fd).st_size) is None
    finally:
        os.close(fd)
    with pytest.raises(CheckpointCorrupt, match="over a 400-byte storage"):
        torchfile.read(path, {**rec, "file_info": {"bytes": path.stat().st_size}})
