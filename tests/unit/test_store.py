from __future__ import annotations

import stat
import subprocess
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from hpcckpt.errors import CheckpointCorrupt
from hpcckpt.store import catalog, hdf5
from hpcckpt.store.commit import LATEST, MANIFEST, Transaction, read_latest, read_manifest, verify_files

pytestmark = pytest.mark.native


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "objects/model/w": torch.randn(300, 257, generator=g),
        "objects/model/b": torch.randn(7, generator=g).to(torch.bfloat16),
        "objects/opt/state/0/step": torch.tensor(12.0),
        "rng/torch": torch.get_rng_state(),
        "objects/model/mask": torch.tensor([True, False, True]),
        "objects/empty": torch.empty(0, 3),
        "extra/i64": torch.arange(10, dtype=torch.int64),
    }


def test_transaction_is_invisible_until_commit(ckdir: Path) -> None:
    with Transaction(ckdir, "step-1") as txn:
        (txn.path / "a.bin").write_bytes(b"hello")
        assert not (ckdir / "step-1").exists()
        assert txn.path.parent == ckdir and ".tmp-" in txn.path.name
        assert stat.S_IMODE(txn.path.stat().st_mode) == 0o700
        assert catalog.scan(ckdir)[0].status == "incomplete"
        txn.commit({"step": 1, "world_size": 1, "ranks": {}})
    assert read_latest(ckdir) == "step-1"
    assert stat.S_IMODE((ckdir / "step-1").stat().st_mode) == 0o700
    m = read_manifest(ckdir / "step-1")
    assert m["files"]["a.bin"]["bytes"] == 5
    assert verify_files(ckdir / "step-1") == []
    assert [i.status for i in catalog.scan(ckdir)] == ["committed"]


def test_transaction_aborts_on_exception(ckdir: Path) -> None:
    with pytest.raises(RuntimeError):
        with Transaction(ckdir, "step-2") as txn:
            (txn.path / "x").write_bytes(b"1")
            raise RuntimeError("boom")
    assert list(ckdir.iterdir()) == [] and read_latest(ckdir) is None


def test_recommitting_a_step_swaps_atomically(ckdir: Path) -> None:
    for payload in (b"old", b"new!"):
        with Transaction(ckdir, "step-3") as txn:
            (txn.path / "f").write_bytes(payload)
            txn.commit({"step": 3, "world_size": 1, "ranks": {}})
    assert (ckdir / "step-3" / "f").read_bytes() == b"new!"
    assert [p.name for p in ckdir.iterdir() if p.is_dir()] == ["step-3"]


def test_manifest_self_checksum_detects_edits(ckdir: Path) -> None:
    with Transaction(ckdir, "step-4") as txn:
        txn.commit({"step": 4, "world_size": 1, "ranks": {}})
    p = ckdir / "step-4" / MANIFEST
    p.write_text(p.read_text().replace('"step": 4', '"step": 5'))
    with pytest.raises(CheckpointCorrupt, match="checksum"):
        read_manifest(ckdir / "step-4")
    assert catalog.scan(ckdir)[0].status == "corrupt"


def test_hdf5_file_is_standard_and_offsets_are_raw(tmp_path: Path) -> None:
    ts = tensors()
    path = tmp_path / "rank-0.h5"
    entries = hdf5.write_tensors(path, ts)
    big = entries["objects/model/w"]
    assert big.offset % hdf5.ALIGN == 0  # aligned: O_DIRECT-able
    with h5py.File(path, "r") as f:
        names: list[str] = []
        f.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)
        assert sorted(names) == sorted(ts)
        np.testing.assert_array_equal(f["objects/model/w"][()], ts["objects/model/w"].numpy())
        assert f["objects/model/b"].attrs["torch_dtype"] == "bfloat16"
    back = hdf5.read_tensors(path, entries)
    for k, t in ts.items():
        assert back[k].dtype == t.dtype and torch.equal(back[k], t), k
    if shutil.which("h5dump"):
        out = subprocess.run(["h5dump", "-H", str(path)], capture_output=True, text=True, check=True).stdout
        assert "objects" in out and "DATASET" in out


def test_hdf5_bit_flip_names_the_tensor(tmp_path: Path) -> None:
    ts = tensors()
    path = tmp_path / "rank-0.h5"
    entries = hdf5.write_tensors(path, ts)
    e = entries["extra/i64"]
    with open(path, "r+b") as f:
        f.seek(e.offset + 3)
        b = f.read(1)
        f.seek(e.offset + 3)
        f.write(bytes([b[0] ^ 0x10]))
    problems = hdf5.verify_tensors(path, entries)
    assert len(problems) == 1 and "'extra/i64'" in problems[0]
    with pytest.raises(CheckpointCorrupt, match="extra/i64"):
        hdf5.read_tensors(path, entries)


def test_prune_keeps_newest_k_and_latest(ckdir: Path) -> None:
    for s in range(1, 6):
        with Transaction(ckdir, f"step-{s}") as txn:
            (txn.path / "f").write_bytes(b"x" * s)
            txn.commit({"step": s, "world_size": 1, "ranks": {}})
    # damage the newest: it is kept (evidence), and the newest good one is never deleted
    (ckdir / "step-5" / MANIFEST).unlink()
    removed = catalog.prune(ckdir, keep=2)
    left = sorted(i.step for i in catalog.scan(ckdir))
    assert left == [3, 4, 5], (left, removed)
    assert read_latest(ckdir) == "step-5"


def test_latest_write_is_atomic_file(ckdir: Path) -> None:
    with Transaction(ckdir, "step-9") as txn:
        txn.commit({"step": 9, "world_size": 1, "ranks": {}})
    assert (ckdir / LATEST).read_text() == "step-9\n"
    assert not [p for p in ckdir.iterdir() if ".tmp-" in p.name]
