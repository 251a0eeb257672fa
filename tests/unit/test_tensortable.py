"""The manifest's tensor table (formats hpcckpt/3 and /4): columns on disk, the whole numbers
packed in /4, a Mapping in memory, and manifests written before it (lists, format hpcckpt/3;
one object per tensor, format hpcckpt/2) still read."""
from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
import torch

from hpcckpt.api import Checkpointer
from hpcckpt.errors import ConfigError
from hpcckpt.store import catalog
from hpcckpt.store.commit import MANIFEST, crc32c, readable_json, seal_manifest
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
    disk = json.loads(json.dumps(t.columns()))
    assert all(isinstance(disk[k], str) for k in ("ndim", "dims", "nbytes", "crc32c", "offset"))  # packed
    back = TensorTable.from_columns(disk)
    assert back == t and dict(back.items()) == RECORDS
    listed = TensorTable.from_columns(json.loads(json.dumps(t.listed())))  # the hpcckpt/3 form
    assert listed == t and dict(listed.items()) == RECORDS
    names, offsets, nbytes, crcs = t.arrays()  # only tensors that hold bytes
    assert names == ["objects/model/w", "rng/torch"]
    assert offsets.tolist() == [4096, 8192] and nbytes.tolist() == [48, 16] and crcs.tolist() == [7, 2**32 - 1]


def test_both_forms_bound_a_file_by_the_ranges_that_hold_bytes() -> None:
    """``held_bytes``: an empty tensor's offset is never read, so it bounds nothing, in the list
    form as in the packed one; summed, sizes of any magnitude add up exactly."""
    recs = json.loads(json.dumps(RECORDS))
    recs["objects/model/empty"]["offset"] = 1 << 40
    listed = TensorTable.from_records(recs)
    packed = TensorTable.from_columns(json.loads(json.dumps(listed.columns())))
    assert listed.held_bytes(summed=False) == packed.held_bytes(summed=False) == 8192 + 16
    big = {f"t{i}": {"dtype": "uint8", "shape": [(1 << 62) + i], "nbytes": (1 << 62) + i, "crc32c": 0} for i in range(5)}
    want = sum(r["nbytes"] for r in big.values())  # beyond 64 bits
    packed_big = TensorTable.from_columns(json.loads(json.dumps(TensorTable.from_records(big).columns())))
    assert TensorTable.from_records(big).held_bytes(summed=True) == packed_big.held_bytes(summed=True) == want


def test_one_row_of_a_packed_table_is_read_without_making_lists() -> None:
    packed = TensorTable.from_columns(json.loads(json.dumps(TensorTable.from_records(RECORDS).columns())))
    assert packed["rng/torch"] == RECORDS["rng/torch"] and packed["objects/model/w"] == RECORDS["objects/model/w"]
    assert packed._shapes is None and packed._nbytes is None  # one row, no column as a list
    assert dict(packed.items()) == RECORDS


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


def _packed(**change: object) -> dict[str, object]:
    cols = TensorTable.from_records(RECORDS).columns()
    cols.update(change)
    return {k: v for k, v in cols.items() if v is not None}


@pytest.mark.parametrize("cols,why", [
    (_packed(nbytes="not base64!"), "column 'nbytes' is not valid base64"),
    (_packed(crc32c="AAAA"), r"different lengths \(column 'crc32c': 3 bytes for 3 numbers of 4\)"),
    (_packed(dims=base64.b64encode(bytes(8)).decode()), "column 'dims': 8 bytes for 4 numbers"),  # ndim: 2 + 1 + 1
    (_packed(offset=[4096, 0, 8192]), "column 'offset' is list, not a packed column"),
    (_packed(ndim=None), "column 'ndim' is NoneType, not a packed column"),
    (_packed(dtype="float32"), "column 'dtype' is str, not a list"),
    (_packed(name=["a", "b"]), "different lengths"),
    (_packed(shape=[[4, 3], [0], [16]]), r"unknown columns \['shape'\]"),
])
def test_packed_columns_that_do_not_decode_are_refused(cols: object, why: str) -> None:
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
    # The same row packed (hpcckpt/4), where packed numbers can say it at all: not a float, a
    # bool, a negative number or one beyond 64 bits (or 32, for a crc).
    numbers = [d for r in recs.values() for d in r["shape"]] + [r[k] for r in recs.values()
                                                                  for k in ("nbytes", "crc32c", "offset")]
    if any(type(v) is not int or not 0 <= v < 2**64 for v in numbers) or recs["rng/torch"]["crc32c"] >= 2**32:
        return
    cols = json.loads(json.dumps(t.columns()))
    packed = TensorTable.from_columns(cols)
    assert not packed.sound(ITEMSIZE, file_bytes=10_000, offsets=True, max_dims=64)
    whole = TensorTable.from_columns(json.loads(json.dumps(TensorTable.from_records(RECORDS).columns())))
    assert whole.sound(ITEMSIZE, file_bytes=10_000, offsets=True, max_dims=64)
    assert whole.arrays()[1].tolist() == [4096, 8192]  # from the packed columns, no list made
    assert whole._nbytes is None and whole._shapes is None


def _manifest(records: dict[str, dict[str, object]], fmt: str = "hpcckpt/2") -> dict[str, object]:
    return {"format": fmt, "step": 1, "world_size": 1, "files": {"rank-0.h5": {"bytes": 10_000}}, "shared": {},
            "ranks": {"0": {"file": "rank-0.h5", "format": "hdf5", "tensors": records,
                            "meta": {"step": 1, "objects": {"model": {"w": {"__tensor__": "objects/model/w"}}}}}}}


def test_encode_writes_columns_and_format_4_and_decode_reads_them_back() -> None:
    m = _manifest(RECORDS)
    disk = json.loads(json.dumps(encode(m)))
    assert disk["format"] == "hpcckpt/4" and "tensors" not in disk["ranks"]["0"]
    assert disk["ranks"]["0"]["tensor_table"]["name"] == list(RECORDS)
    assert isinstance(disk["ranks"]["0"]["tensor_table"]["nbytes"], str)
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


def _write_older(step_dir: Path, fmt: str) -> None:
    """Rewrite a checkpoint's manifest as an older hpcckpt wrote it, sealed the same way (the
    crc32c of the bytes before the seal): format 2, one object per tensor; format 3, every
    column a list."""
    m = json.loads((step_dir / MANIFEST).read_text())
    m.pop("manifest_crc32c")
    for rec in m["ranks"].values():
        table = TensorTable.from_columns(rec.pop("tensor_table"))
        if fmt == "hpcckpt/2":
            rec["tensors"] = dict(table.items())
        else:
            rec["tensor_table"] = table.listed()
    m["format"] = fmt
    head = readable_json(m).encode()[:-3]
    (step_dir / MANIFEST).write_bytes(head + f',\n "manifest_crc32c": {crc32c(head)}\n}}\n'.encode())


@pytest.mark.native
@pytest.mark.parametrize("fmt", ["hpcckpt/2", "hpcckpt/3"])
@pytest.mark.parametrize("engine", ["sync", "concurrent"])
def test_an_older_format_checkpoint_verifies_and_resumes_exactly(tmp_path: Path, engine: str, fmt: str) -> None:
    objs = tiny_state(0)
    with Checkpointer(tmp_path, engine=engine, every_steps=3, keep=2) as ck:
        ck.register(**objs)
        for _ in ck.steps(3):
            train_step(objs)
    want = _digest(objs)
    _write_older(tmp_path / "step-3", fmt)
    assert json.loads((tmp_path / "step-3" / MANIFEST).read_text())["format"] == fmt
    info = catalog.inspect_step(tmp_path, 3, full=True)
    assert info is not None and info.status == "committed", info and info.problems
    fresh = tiny_state(1)
    with Checkpointer(tmp_path, engine=engine, every_steps=None) as ck:
        assert ck.register(**fresh) == 3
    assert _digest(fresh) == want


@pytest.mark.native
@pytest.mark.parametrize("encoding", ["same", "new columns"])
def test_a_checkpoint_in_a_newer_format_is_not_passed_over_for_an_older_one(tmp_path: Path, encoding: str) -> None:
    """An intact manifest in a format this version does not know was written by a newer
    hpcckpt (a job downgraded by mistake): listed as unreadable with the fix, and a resume
    refuses instead of rewinding to the older checkpoint; nothing is deleted. Also when the
    newer format encodes its records in a way this version cannot decode (the format is
    asked first)."""
    objs = tiny_state(0)
    with Checkpointer(tmp_path, engine="sync", every_steps=3, keep=3) as ck:
        ck.register(**objs)
        for _ in ck.steps(6):
            train_step(objs)
    m = json.loads((tmp_path / "step-6" / MANIFEST).read_text())
    m["format"] = "hpcckpt/99"  # sealed as written: no format this version encodes
    if encoding == "new columns":
        m["ranks"]["0"]["tensor_table"] = {"v99cols": "AAAA"}
    (tmp_path / "step-6" / MANIFEST).write_bytes(seal_manifest(m))
    info = catalog.inspect_step(tmp_path, 6)
    assert info is not None and info.status == "corrupt", info
    assert "written by a newer hpcckpt" in info.problems[0] and "upgrade hpcckpt" in info.problems[0], info.problems
    with pytest.raises(ConfigError, match=r"newer hpcckpt.*will not resume an older checkpoint instead.*move "
                                          r"that step directory out"):
        with Checkpointer(tmp_path, engine="sync", every_steps=None) as ck:
            ck.register(**tiny_state(1))
    assert (tmp_path / "step-6").is_dir() and (tmp_path / "step-3").is_dir()
