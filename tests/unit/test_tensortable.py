"""The manifest's tensor table (format hpcckpt/3): columns on disk, a Mapping in memory, and
manifests written before it (one object per tensor, format hpcckpt/2) still read."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hpcckpt.api import Checkpointer
from hpcckpt.store import catalog
from hpcckpt.store.commit import MANIFEST, crc32c, readable_json
from hpcckpt.store.manifest import ITEMSIZE, Invalid, decode, encode, validate
from hpcckpt.store.tensortable import TableError, TensorTable
from tests.helpers import tiny_state, train_step

RECORDS = {
    "objects/model/w": {"dtype": "float32", "shape": [4, 3], "nbytes": 48, "crc32c": 7, "offset": 4096},
    "objects/model/empty": {"dtype": "int64", "shape": [0], "nbytes": 0, "crc32c": 0, "offset": 0},
    "rng/torch": {"dtype": "uint8", "shape": [16], "nbytes": 16, "crc32c": 2**32 - 1, "offset": 8192},
}


def test_records_and_columns_round_trip_and_read_as_a_mapping() -> None:
    t = TensorTable.from_records(RECORDS)
    assert dict(t.items()) == RECORDS and len(t) == 3 and list(t) == list(RECORDS)
    assert "rng/torch" in t and "nope" not in t and t.get("nope") is None
    assert t["objects/model/w"]["offset"] == 4096
    back = TensorTable.from_columns(json.loads(json.dumps(t.columns())))
    assert back == t and dict(back.items()) == RECORDS
    names, offsets, nbytes, crcs = t.arrays()  # only tensors that hold bytes
    assert names == ["objects/model/w", "rng/torch"]
    assert offsets.tolist() == [4096, 8192] and nbytes.tolist() == [48, 16] and crcs.tolist() == [7, 2**32 - 1]


def test_without_offsets_for_torch_archives() -> None:
    recs = {n: {k: v for k, v in r.items() if k != "offset"} for n, r in RECORDS.items()}
    t = TensorTable.from_records(recs)
    assert t.offsets is None and "offset" not in t.columns() and dict(t.items()) == recs
    assert t.sound(ITEMSIZE, file_bytes=10_000, offsets=False, max_dims=64)
    assert not t.sound(ITEMSIZE, file_bytes=10_000, offsets=True, max_dims=64)


@pytest.mark.parametrize("cols,why", [
    ([], "not an object"),
    ({"name": ["a"], "dtype": ["uint8"], "shape": [[1]], "nbytes": [1]}, "column 'crc32c' is NoneType"),
    ({"name": ["a"], "dtype": ["uint8"], "shape": [[1]], "nbytes": [1, 2], "crc32c": [0]}, "different lengths"),
    ({"name": ["a"], "dtype": ["uint8"], "shape": [[1]], "nbytes": [1], "crc32c": [0], "offset": 5},
     "column 'offset' is int"),
    ({"name": [], "dtype": [], "shape": [], "nbytes": [], "crc32c": [], "size": []}, "unknown columns"),
])
def test_columns_that_are_not_a_table_are_refused(cols: object, why: str) -> None:
    with pytest.raises(TableError, match=why):
        TensorTable.from_columns(cols)


@pytest.mark.parametrize("change", [
    lambda r: r["objects/model/w"].update(nbytes=44),           # shape x itemsize disagrees
    lambda r: r["objects/model/w"].update(shape=[4, -3]),       # negative dim
    lambda r: r["objects/model/w"].update(shape=[4.0, 3]),      # float dim
    lambda r: r["objects/model/w"].update(nbytes=True),         # bool size
    lambda r: r["rng/torch"].update(crc32c=2**32),               # crc beyond 32 bits
    lambda r: r["rng/torch"].update(offset=9990),               # ends past the file
    lambda r: r["rng/torch"].update(dtype="qint8"),             # not a plain dtype
    lambda r: r["objects/model/w"].update(shape=[1] * 65 + [48]),  # too many dims
    lambda r: r["objects/model/w"].update(shape=[2**62, 2**3]),  # elements overflow 64 bits
    lambda r: r["objects/model/w"].update(shape=[2**61, 3]),    # elements x itemsize overflow
    lambda r: r["objects/model/w"].update(nbytes=2**64 + 48),   # beyond any int64
    lambda r: r["rng/torch"].update(offset=2**64 + 8192),       # wraps to a range inside the file
    lambda r: r["rng/torch"].update(offset=2**63 - 8),          # its end overflows
    lambda r: r["rng/torch"].update(crc32c=-1),                 # negative crc
])
def test_the_quick_checks_reject_what_the_row_checks_reject(change: object) -> None:
    recs = json.loads(json.dumps(RECORDS))
    change(recs)  # type: ignore[operator]
    t = TensorTable.from_records(recs)
    assert not t.sound(ITEMSIZE, file_bytes=10_000, offsets=True, max_dims=64)
    assert TensorTable.from_records(RECORDS).sound(ITEMSIZE, file_bytes=10_000, offsets=True, max_dims=64)


def _manifest(records: dict[str, dict[str, object]], fmt: str = "hpcckpt/2") -> dict[str, object]:
    return {"format": fmt, "step": 1, "world_size": 1, "files": {"rank-0.h5": {"bytes": 10_000}}, "shared": {},
            "ranks": {"0": {"file": "rank-0.h5", "format": "hdf5", "tensors": records,
                            "meta": {"step": 1, "objects": {"model": {"w": {"__tensor__": "objects/model/w"}}}}}}}


def test_encode_writes_columns_and_format_3_and_decode_reads_them_back() -> None:
    m = _manifest(RECORDS)
    disk = json.loads(json.dumps(encode(m)))
    assert disk["format"] == "hpcckpt/3" and "tensors" not in disk["ranks"]["0"]
    assert disk["ranks"]["0"]["tensor_table"]["name"] == list(RECORDS)
    assert m["ranks"]["0"]["tensors"] is RECORDS  # type: ignore[index]  # encode copies, never changes
    decoded = decode(disk)
    validate(decoded, step=1)
    assert dict(decoded["ranks"]["0"]["tensors"].items()) == RECORDS
    fmt1 = {**m, "format": "hpcckpt/1"}
    assert encode(fmt1)["ranks"]["0"]["tensors"] is RECORDS  # type: ignore[index]  # format 1 stays as it was


def test_a_table_with_a_dtype_only_torch_knows_is_checked_row_by_row() -> None:
    recs = json.loads(json.dumps(RECORDS))
    recs["objects/model/w"].update(dtype="float8_e8m0fnu", shape=[48])
    if "float8_e8m0fnu" in ITEMSIZE or not hasattr(torch, "float8_e8m0fnu"):
        pytest.skip("this torch has no dtype outside ITEMSIZE to try")
    m = decode(json.loads(json.dumps(encode(_manifest(recs)))))
    validate(m, step=1)  # slow path: asked of torch, accepted
    recs["objects/model/w"]["nbytes"] = 47
    with pytest.raises(Invalid, match="manifest says 47"):
        validate(decode(json.loads(json.dumps(encode(_manifest(recs))))), step=1)


def _digest(objs: dict[str, object]) -> dict[str, bytes]:
    """Every tensor of the model's and optimizer's state, by name, as bytes."""
    out = [(f"model/{k}", v.numpy().tobytes()) for k, v in objs["model"].state_dict().items()]  # type: ignore[attr-defined]
    for p, st in objs["optimizer"].state_dict()["state"].items():  # type: ignore[attr-defined]
        out += [(f"opt/{p}/{k}", v.numpy().tobytes()) for k, v in st.items()]
    return dict(out)


def _write_format_2(step_dir: Path) -> None:
    """Rewrite a checkpoint's manifest as hpcckpt 2 wrote it: one object per tensor, format 2,
    sealed the same way (the crc32c of the bytes before the seal)."""
    m = json.loads((step_dir / MANIFEST).read_text())
    m.pop("manifest_crc32c")
    for rec in m["ranks"].values():
        rec["tensors"] = dict(TensorTable.from_columns(rec.pop("tensor_table")).items())
    m["format"] = "hpcckpt/2"
    head = readable_json(m).encode()[:-3]
    (step_dir / MANIFEST).write_bytes(head + f',\n "manifest_crc32c": {crc32c(head)}\n}}\n'.encode())


@pytest.mark.native
@pytest.mark.parametrize("engine", ["sync", "concurrent"])
def test_a_format_2_checkpoint_verifies_and_resumes_exactly(tmp_path: Path, engine: str) -> None:
    objs = tiny_state(0)
    with Checkpointer(tmp_path, engine=engine, every_steps=3, keep=2) as ck:
        ck.register(**objs)
        for _ in ck.steps(3):
            train_step(objs)
    want = _digest(objs)
    _write_format_2(tmp_path / "step-3")
    assert json.loads((tmp_path / "step-3" / MANIFEST).read_text())["format"] == "hpcckpt/2"
    info = catalog.inspect_step(tmp_path, 3, full=True)
    assert info is not None and info.status == "committed", info and info.problems
    fresh = tiny_state(1)
    with Checkpointer(tmp_path, engine=engine, every_steps=None) as ck:
        assert ck.register(**fresh) == 3
    assert _digest(fresh) == want
