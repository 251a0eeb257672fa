"""Crafted manifests: each field made untrustworthy while the self-checksum is recomputed.

A manifest that passes its own checksum is still input. For every case the newest
checkpoint (step 6) becomes corrupt in the catalog with a message naming the field,
a resume falls back to step 3 like for any other damage, and the CLI reports it
without a traceback. Real checkpoints of both engines (torch archives, HDF5 files).
"""
from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hpcckpt.api import Checkpointer
from hpcckpt.store import catalog
from hpcckpt.store.commit import MANIFEST, seal_manifest
from hpcckpt.store.tensortable import TensorTable
from tests.conftest import REPO
from tests.helpers import tiny_state, train_step

pytestmark = pytest.mark.native

Manifest = dict[str, Any]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Per engine, a directory with committed steps 3 and 6 (never modified: copy it)."""
    out = {}
    for engine in ("sync", "concurrent"):
        root = tmp_path_factory.mktemp(f"pristine-{engine}")
        objs = tiny_state(0)
        with Checkpointer(root, engine=engine, every_steps=3, keep=5) as ck:
            ck.register(**objs)
            for _ in ck.steps(6):
                train_step(objs)
        assert [i.step for i in catalog.scan(root) if i.status == "committed"] == [3, 6]
        out[engine] = root
    return out


def copy(pristine: dict[str, Path], engine: str, dest: Path) -> Path:
    shutil.copytree(pristine[engine], dest, symlinks=True)
    for lease in dest.glob(".hpcckpt*"):
        lease.unlink()
    return dest


def craft(step_dir: Path, change: Callable[[Manifest, Path], None]) -> None:
    """Apply ``change`` to the manifest, each rank's tensor table given as records (one
    object per tensor, so a change names one field of one tensor), then reseal it so its
    self-checksum is valid again; the records are written back as columns, every one a list
    (the hpcckpt/3 form, also read: packed columns cannot hold a float, a string or a
    negative number)."""
    m = json.loads((step_dir / MANIFEST).read_text())
    for rec in m["ranks"].values():
        rec["tensors"] = dict(TensorTable.from_columns(rec.pop("tensor_table")).items())
    change(m, step_dir)
    ranks = m.get("ranks")
    for rec in ranks.values() if isinstance(ranks, dict) else ():
        if isinstance(rec, dict) and isinstance(rec.get("tensors"), dict):
            rec["tensor_table"] = TensorTable.from_records(rec.pop("tensors")).listed()
    (step_dir / MANIFEST).write_bytes(seal_manifest(m))


def craft_columns(step_dir: Path, change: Callable[[dict[str, Any]], None], *, packed: bool) -> None:
    """Apply ``change`` to rank 0's tensor table as columns, as hpcckpt/4 writes them
    (``packed``) or every column a list (hpcckpt/3, also read), then reseal."""
    m = json.loads((step_dir / MANIFEST).read_text())
    if not packed:
        m["ranks"]["0"]["tensor_table"] = TensorTable.from_columns(m["ranks"]["0"]["tensor_table"]).listed()
    change(m["ranks"]["0"]["tensor_table"])
    (step_dir / MANIFEST).write_bytes(seal_manifest(m))


def rank0(m: Manifest) -> dict[str, Any]:
    return m["ranks"]["0"]


def big(m: Manifest) -> dict[str, Any]:
    """The tensor record with the most bytes (a model weight or its Adam moment)."""
    return max(rank0(m)["tensors"].values(), key=lambda t: t["nbytes"])


def fname(m: Manifest) -> str:
    return str(rank0(m)["file"])


def _symlinked_rank_file(m: Manifest, d: Path) -> None:
    """The rank file swapped for a symlink to a same-sized file outside (the manifest stays as it was)."""
    outside = d.parent.parent / "outside.bin"
    shutil.move(d / fname(m), outside)
    (d / fname(m)).symlink_to(outside)


def _drop_named_tensor(m: Manifest, d: Path) -> None:
    del rank0(m)["tensors"]["objects/model/0.weight"]


def _set(path: str, value: Any) -> Callable[[Manifest, Path], None]:
    """A change setting one field: ``big.offset``, ``rank0.format``, ``m.world_size``..."""
    where, key = path.split(".")

    def change(m: Manifest, d: Path) -> None:
        {"big": big, "rank0": rank0, "m": lambda m: m}[where](m)[key] = value
    return change


def _step(n: int) -> Callable[[Manifest, Path], None]:
    def change(m: Manifest, d: Path) -> None:
        m["step"] = n
        rank0(m)["meta"]["step"] = n
    return change


def _file(name: str) -> Callable[[Manifest, Path], None]:
    def change(m: Manifest, d: Path) -> None:
        m["files"][name] = m["files"].pop(fname(m))
        rank0(m)["file"] = name
    return change


def _terabyte(m: Manifest, d: Path) -> None:
    big(m).update(dtype="float32", shape=[1 << 38], nbytes=1 << 40)


def _past_end(m: Manifest, d: Path) -> None:
    big(m)["offset"] = m["files"][fname(m)]["bytes"] - 8


def _huge_file(m: Manifest, d: Path) -> None:
    m["files"][fname(m)]["bytes"] = 1 << 64  # no file is that large (off_t)


def _empty_tensor_far_away(m: Manifest, d: Path) -> None:
    """An empty tensor placed beyond any file: its offset is never read, but no file has it."""
    rank0(m)["tensors"]["objects/model/empty"] = {"dtype": "float32", "shape": [0], "nbytes": 0, "crc32c": 0,
                                                  "offset": 1 << 64}


BOTH, HDF5, TORCH = ("sync", "concurrent"), ("concurrent",), ("sync",)

# (case, engines, change, what the problem must say)
CASES: list[tuple[str, tuple[str, ...], Callable[[Manifest, Path], None], str]] = [
    ("negative offset", BOTH, _set("big.offset", -4096), r"offset is -4096, outside"),
    ("offset past the end", BOTH, _past_end, r"past the end of its"),
    ("file size beyond any file", BOTH, _huge_file, r"size of .* is 18446744073709551616, outside"),
    ("empty tensor's offset beyond any file", BOTH, _empty_tensor_far_away, r"offset is 18446744073709551616, outside"),
    ("offset not a number", BOTH, _set("big.offset", "0"), r"offset is '0', not a whole number"),
    ("1 TiB shape", BOTH, _terabyte, r"claims 1099511627776 bytes, more than"),
    ("bytes disagree with dtype x shape", BOTH, _set("big.nbytes", 12), r"manifest says 12"),
    ("negative dimension", BOTH, _set("big.shape", [-1, 16]), r"dimension is -1, outside"),
    ("shape not a list", BOTH, _set("big.shape", "16x8"), r"not a list"),
    ("quantized dtype", BOTH, _set("big.dtype", "qint8"), r"dtype 'qint8', which is not a plain torch dtype"),
    ("dtype names a function", BOTH, _set("big.dtype", "load"), r"dtype 'load'"),
    ("crc32c not a number", BOTH, _set("big.crc32c", "ffff"), r"crc32c is 'ffff'"),
    ("rank file outside the step directory", BOTH, _file("../step-3/x"), r"not a plain path inside"),
    ("absolute rank file", BOTH, _file("/etc/passwd"), r"not a plain path inside"),
    ("rank file is a symlink", BOTH, _symlinked_rank_file, r"not a regular file"),
    ("rank file not listed in files", BOTH, lambda m, d: m["files"].pop(fname(m)), r"not listed"),
    ("manifest step differs from the directory's", BOTH, _step(7), r"says step 7 but sits in .* step 6"),
    ("metadata step differs", BOTH, lambda m, d: rank0(m)["meta"].update(step=5), r"meta says step 5"),
    ("tensor named by the metadata is missing", BOTH, _drop_named_tensor,
     r"does not hold: objects/model/0.weight"),
    ("unknown rank file format", BOTH, _set("rank0.format", "pickle"), r"format 'pickle'"),
    ("world size without records", BOTH, _set("m.world_size", 2), r"missing \['1'\]"),
    ("world size zero", BOTH, _set("m.world_size", 0), r"world_size is 0, outside"),
    ("world size a boolean", BOTH, _set("m.world_size", True), r"world_size is True, not a whole number"),
    ("ranks not an object", BOTH, _set("m.ranks", []), r"ranks is list, not an object"),
    ("step a string", BOTH, _set("m.step", "6"), r"step is '6', not a whole number"),
]


@pytest.mark.parametrize("engine,change,problem", [pytest.param(e, c, p, id=f"{e}-{name}")
                                                    for name, engines, c, p in CASES for e in engines])
def test_crafted_manifest_is_corrupt_and_resume_falls_back(
        pristine: dict[str, Path], tmp_path: Path, engine: str, change: Callable[[Manifest, Path], None],
        problem: str) -> None:
    root = copy(pristine, engine, tmp_path / "ck")
    craft(root / "step-6", change)
    _corrupt_and_falls_back(root, engine, problem)


def _corrupt_and_falls_back(root: Path, engine: str, problem: str) -> None:
    """Step 6 is corrupt with ``problem`` among its problems; a resume falls back to step 3."""
    infos = {i.step: i for i in catalog.scan(root)}
    assert infos[6].status == "corrupt" and infos[3].status == "committed"
    assert any(re.search(problem, p) for p in infos[6].problems), infos[6].problems
    with Checkpointer(root, engine=engine, every_steps=None) as ck:
        assert ck.register(**tiny_state(1)) == 3


def _swap(col: str, i: int, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(t: dict[str, Any]) -> None:
        t[col][i] = value
    return change


# (case, change of the on-disk columns, what the problem must say)
COLUMN_CASES: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("a column shorter than the others", lambda t: t["nbytes"].pop(), r"columns of different lengths"),
    ("a column not a list", lambda t: t.update(crc32c={"0": 1}), r"column 'crc32c' is dict, not a list"),
    ("a column missing", lambda t: t.pop("dtype"), r"column 'dtype' is NoneType"),
    ("an unknown column", lambda t: t.update(pickle=[]), r"unknown columns \['pickle'\]"),
    ("a tensor listed twice", lambda t: t["name"].__setitem__(1, t["name"][0]), r"lists tensor .* twice"),
    ("a name not a string", _swap("name", 0, 7), r"names a tensor 7, not a string"),
    ("a size given as a float", lambda t: t["nbytes"].__setitem__(0, float(t["nbytes"][0])),
     r"nbytes is \d+\.0, not a whole number"),
    ("a crc32c given as a boolean", _swap("crc32c", 0, True), r"crc32c is True, not a whole number"),
    ("only unknown columns", lambda t: (t.clear(), t.update(x=1)), r"unknown columns"),
]
# The same for the packed columns of hpcckpt/4.
PACKED_CASES: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("a packed column cut short", lambda t: t.update(nbytes=t["nbytes"][:-12]), r"columns of different lengths"),
    ("a packed column not base64", lambda t: t.update(crc32c=t["crc32c"][:-4] + "*!*="), r"not valid base64"),
    ("a packed column given as a list", lambda t: t.update(nbytes=[1, 2]), r"'nbytes' is list, not a packed column"),
    ("dims for fewer dimensions than ndim says", lambda t: t.update(dims=""), r"column 'dims': 0 bytes"),
    ("a list column beside packed ones", lambda t: t.update(shape=[]), r"unknown columns \['shape'\]"),
    ("sizes that disagree with the shapes", lambda t: t.update(nbytes=base64.b64encode(
        bytes(len(base64.b64decode(t["nbytes"])))).decode()), r"manifest says 0"),
]


@pytest.mark.parametrize("engine,packed,change,problem", [
    pytest.param(e, packed, c, p, id=f"{e}-{name}")
    for packed, cases in ((False, COLUMN_CASES), (True, PACKED_CASES)) for name, c, p in cases for e in BOTH])
def test_crafted_tensor_table_is_corrupt_and_resume_falls_back(
        pristine: dict[str, Path], tmp_path: Path, engine: str, packed: bool,
        change: Callable[[dict[str, Any]], None], problem: str) -> None:
    """The columns themselves are input too: ragged, mistyped, duplicated, packed wrong."""
    root = copy(pristine, engine, tmp_path / "ck")
    craft_columns(root / "step-6", change, packed=packed)
    _corrupt_and_falls_back(root, engine, problem)


@pytest.mark.parametrize("raw", [b"[" * 200_000, b'{"step": 1' + b"9" * 5000 + b"}", b"\xff\xfe{}",
                                 b"{}" + b" " * 10])
def test_unparseable_manifest_is_corrupt(pristine: dict[str, Path], tmp_path: Path, raw: bytes) -> None:
    root = copy(pristine, "sync", tmp_path / "ck")
    (root / "step-6" / MANIFEST).write_bytes(raw)
    info = {i.step: i for i in catalog.scan(root)}[6]
    assert info.status == "corrupt" and "manifest" in info.problems[0]
    with Checkpointer(root, every_steps=None) as ck:
        assert ck.register(**tiny_state(1)) == 3


def test_symlinked_step_directory_is_not_a_checkpoint(pristine: dict[str, Path], tmp_path: Path) -> None:
    root = copy(pristine, "concurrent", tmp_path / "ck")
    (root / "step-8").symlink_to(root / "step-3")
    infos = {i.step: i for i in catalog.scan(root)}
    assert infos[8].status == "corrupt" and "symlink" in infos[8].problems[0]
    with Checkpointer(root, engine="concurrent", every_steps=None) as ck:
        assert ck.register(**tiny_state(1)) == 6


def restep(root: Path, src: int, dst: int, change: Callable[[Manifest, Path], None] | None = None) -> None:
    """Copy step ``src`` to step ``dst`` (a valid checkpoint of that step), then craft it."""
    shutil.copytree(root / f"step-{src}", root / f"step-{dst}")
    craft(root / f"step-{dst}", _step(dst))
    if change is not None:
        craft(root / f"step-{dst}", change)


def cli(*args: str) -> tuple[int, str]:
    p = subprocess.run([sys.executable, "-m", "hpcckpt.cli", *args], cwd=REPO, capture_output=True, text=True,
                       timeout=300)
    return p.returncode, p.stdout + p.stderr


def test_cli_reports_crafted_checkpoints_without_traceback(pristine: dict[str, Path], tmp_path: Path) -> None:
    root = copy(pristine, "concurrent", tmp_path / "ck")
    restep(root, 6, 9, _set("big.offset", -1))
    restep(root, 6, 12, _file("../../../../etc/passwd"))
    restep(root, 6, 15, _terabyte)
    (root / "step-18").symlink_to(root / "step-6")
    (root / "LATEST").write_bytes(b"\xff\xfestep-6\n")  # non-UTF-8: ignored, not a crash

    code, out = cli("ls", str(root), "--json")
    assert code == 0, out
    assert {(r["step"], r["status"]) for r in json.loads(out)} == {
        (3, "committed"), (6, "committed"), (9, "corrupt"), (12, "corrupt"), (15, "corrupt"), (18, "corrupt")}
    code, out = cli("verify", str(root), "--all", "--json")
    res = {r["step"]: r for r in json.loads(out)["checkpoints"]}
    assert code == 1 and res[3]["ok"] and res[6]["ok"] and not any(res[s]["ok"] for s in (9, 12, 15, 18))
    assert "outside" in res[9]["problems"][0] and "plain path" in res[12]["problems"][0]
    for step in (9, 12, 15, 18):
        code, out = cli("inspect", str(root), "--step", str(step))
        assert code == 1 and "CORRUPT" in out and "Traceback" not in out, out


def _sparse_tebibyte(m: Manifest, d: Path) -> None:
    """The rank file made a sparse 1 TiB file, and the manifest re-sealed to list that size
    (with a whole-file checksum, so a verify would read all of it)."""
    import os
    name = fname(m)
    os.truncate(d / name, 1 << 40)
    m["files"][name] = {"bytes": 1 << 40, "crc32c": 0}
    if "file_info" in rank0(m):
        rank0(m)["file_info"] = {"bytes": 1 << 40, "crc32c": 0}


@pytest.mark.parametrize("engine", ["sync", "concurrent"])
def test_a_sparse_tebibyte_rank_file_is_refused_without_reading_it(pristine: dict[str, Path], tmp_path: Path,
                                                                    engine: str) -> None:
    """verify stays proportional to the bytes the manifest's tensors account for."""
    root = copy(pristine, engine, tmp_path / "ck")
    craft(root / "step-6", _sparse_tebibyte)
    info = catalog.inspect_step(root, 6, full=True)  # reading 1 TiB would take hours: refused up front
    assert info is not None and info.status == "corrupt"
    assert any("at most" in p and "plausible" in p for p in info.problems), info.problems
    with Checkpointer(root, engine=engine, every_steps=None) as ck:
        assert ck.register(**tiny_state(1)) == 3


def test_an_oversized_manifest_is_refused_before_it_is_parsed(pristine: dict[str, Path], tmp_path: Path) -> None:
    from hpcckpt.store.commit import MAX_MANIFEST_BYTES
    root = copy(pristine, "sync", tmp_path / "ck")
    path = root / "step-6" / MANIFEST
    raw = path.read_bytes()
    path.write_bytes(raw[:-2] + b" " * (MAX_MANIFEST_BYTES + 1 - len(raw)) + raw[-2:])  # still valid JSON
    info = {i.step: i for i in catalog.scan(root)}[6]
    assert info.status == "corrupt" and "more than any manifest" in info.problems[0]
    with Checkpointer(root, every_steps=None) as ck:
        assert ck.register(**tiny_state(1)) == 3


@pytest.mark.parametrize("engine", BOTH)
@pytest.mark.parametrize("case", ["metadata", "table"])
def test_a_full_check_reports_what_the_cheap_one_does(pristine: dict[str, Path], tmp_path: Path, engine: str,
                                                      case: str) -> None:
    """``hpcckpt verify`` validates the metadata trees while the checksums run (a thread of
    their own): a crafted manifest is still corrupt with the same problem, whichever half of
    the validation finds it, and nothing is left running."""
    import threading
    root = copy(pristine, engine, tmp_path / "ck")
    change = _drop_named_tensor if case == "metadata" else _set("big.nbytes", 12)
    craft(root / "step-6", change)
    cheap = catalog.inspect_step(root, 6)
    full = catalog.inspect_step(root, 6, full=True)
    assert cheap is not None and full is not None
    assert cheap.status == full.status == "corrupt" and full.problems == cheap.problems, full.problems
    assert not [t for t in threading.enumerate() if t.name == "hpcckpt-verify" or t.name.startswith("hpcckpt-prefetch")]
    good = catalog.inspect_step(root, 3, full=True)
    assert good is not None and good.status == "committed", good.problems
