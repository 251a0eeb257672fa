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

pytestmark = pytest.mark.native

TENSORS = {
    "objects/model/w": torch.randn(7, 5),
    "objects/model/b": torch.arange(5, dtype=torch.bfloat16),
    "objects/model/empty": torch.empty(0, 3),
    "rng/torch": torch.randint(0, 255, (16,), dtype=torch.uint8),
    "rng/numpy/1": torch.arange(624, dtype=torch.int64).to(torch.uint32),  # a dtype torch.save writes with _rebuild_tensor_v3
    "step": torch.tensor(3.0),
}


def _written(tmp_path: Path) -> tuple[Path, dict[str, object]]:
    path = tmp_path / "rank-0.pt"
    rec = torchfile.write(path, TENSORS)
    return path, rec


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
    got = torchfile.read(path, rec)
    assert set(got) == set(TENSORS)
    for name, t in TENSORS.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape and torch.equal(got[name], t), name
        assert got[name].untyped_storage().nbytes() == t.numel() * t.element_size()  # its own memory
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
    fd = os.open(path, os.O_RDONLY)
    try:
        assert torchfile._index(fd, rec, os.fstat(fd).st_size) is None
    finally:
        os.close(fd)
    with pytest.raises(CheckpointCorrupt, match="over a 400-byte storage"):
        torchfile.read(path, {**rec, "file_info": {"bytes": path.stat().st_size}})
