from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from hpcckpt._core import native
from hpcckpt.errors import CheckpointCorrupt
from hpcckpt.store import catalog, hdf5
from hpcckpt.store.commit import (
    LATEST,
    MANIFEST,
    STALE_SPARE_AGE_S,
    Transaction,
    read_latest,
    read_manifest,
    verify_files,
)

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


def minimal(step: int, file: str = "f") -> dict[str, object]:
    """The smallest manifest the catalog trusts: one rank whose (torch) file holds no tensor."""
    return {"step": step, "world_size": 1,
            "ranks": {"0": {"file": file, "format": "torch", "tensors": {}, "meta": {"step": step, "objects": {}}}}}


def test_transaction_is_invisible_until_commit(ckdir: Path) -> None:
    with Transaction(ckdir, "step-1") as txn:
        (txn.path / "a.bin").write_bytes(b"hello")
        assert not (ckdir / "step-1").exists()
        assert txn.path.parent == ckdir and ".tmp-" in txn.path.name
        assert stat.S_IMODE(txn.path.stat().st_mode) == 0o700
        assert catalog.scan(ckdir)[0].status == "incomplete"
        txn.commit(minimal(1, "a.bin"))
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
            txn.commit(minimal(3))
    assert (ckdir / "step-3" / "f").read_bytes() == b"new!"
    assert [p.name for p in ckdir.iterdir() if p.is_dir()] == ["step-3"]


def test_manifest_self_checksum_detects_edits(ckdir: Path) -> None:
    with Transaction(ckdir, "step-4") as txn:
        (txn.path / "f").write_bytes(b"")
        txn.commit(minimal(4))
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
    problems = hdf5.verify_tensors(path, {n: x.to_json() for n, x in entries.items()})
    assert len(problems) == 1 and "'extra/i64'" in problems[0]
    with pytest.raises(CheckpointCorrupt, match="extra/i64"):
        hdf5.read_tensors(path, entries)


def _direct_supported(directory: Path) -> bool:
    probe = directory / "direct-probe"
    probe.write_bytes(b"\0" * 4096)
    try:
        os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
        return True
    except OSError:
        return False
    finally:
        probe.unlink()


@pytest.mark.parametrize("direct", [True, False, None])
def test_hdf5_read_paths_agree_and_checksum_every_chunk(tmp_path: Path, direct: bool | None) -> None:
    g = torch.Generator().manual_seed(1)
    ts = {"big": torch.randn(5_000_001, generator=g),  # ~20 MB: several reader chunks, odd tail
          "mid": torch.randn(70_000, generator=g).to(torch.float16), "tiny": torch.arange(5, dtype=torch.int32)}
    path = tmp_path / "rank-0.h5"
    entries = hdf5.write_tensors(path, ts)
    stats: dict[str, object] = {}
    back = hdf5.read_tensors(path, entries, direct=direct, stats=stats)
    for k, t in ts.items():
        assert back[k].dtype == t.dtype and back[k].shape == t.shape and torch.equal(back[k], t), k
    assert stats["direct_bytes"] + stats["buffered_bytes"] == sum(e.nbytes for e in entries.values())
    if direct and _direct_supported(tmp_path):
        assert stats["direct_bytes"] >= entries["big"].nbytes - 4096
    if direct is False:
        assert stats["direct_bytes"] == 0
    # a flipped byte deep in the last chunk of the big tensor is caught and named
    e = entries["big"]
    with open(path, "r+b") as f:
        f.seek(e.offset + e.nbytes - 10)
        b = f.read(1)
        f.seek(e.offset + e.nbytes - 10)
        f.write(bytes([b[0] ^ 0x01]))
    with pytest.raises(CheckpointCorrupt, match="'big'"):
        hdf5.read_tensors(path, entries, direct=direct)


def test_hdf5_truncated_file_is_reported_as_corrupt(tmp_path: Path) -> None:
    ts = {"w": torch.randn(100_000)}
    path = tmp_path / "rank-0.h5"
    entries = hdf5.write_tensors(path, ts)
    os.truncate(path, entries["w"].offset + 1000)
    with pytest.raises(CheckpointCorrupt, match="shorter than its manifest"):
        hdf5.read_tensors(path, entries)


def test_loaded_tensors_own_their_memory(tmp_path: Path) -> None:
    ts = {"w": torch.randn(300_000), "v": torch.randn(200_000)}
    path = tmp_path / "rank-0.h5"
    back = hdf5.read_tensors(path, hdf5.write_tensors(path, ts))
    w = back.pop("w")
    del back  # the other tensor's memory goes; w's stays valid and writable
    w.add_(1)
    assert torch.equal(w, ts["w"] + 1)
    assert w.untyped_storage().data_ptr() % hdf5.ALIGN == 0


def test_prune_keeps_newest_k_and_latest(ckdir: Path) -> None:
    for s in range(1, 6):
        with Transaction(ckdir, f"step-{s}") as txn:
            (txn.path / "f").write_bytes(b"x" * s)
            txn.commit(minimal(s))
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


def test_latest_is_rewritten_in_place_and_a_torn_rewrite_is_never_a_name(ckdir: Path) -> None:
    """Each commit sets LATEST in place (same inode, no new file); what a kill between its
    write and its truncate can leave (the new name, then the old one's tail) reads as the
    new name or as no hint at all, never as another step."""
    from hpcckpt.store.commit import replace_hint
    for step in (8, 1000):
        with Transaction(ckdir, f"step-{step}") as txn:
            txn.commit({"step": step, "world_size": 1, "ranks": {}})
        if step == 8:
            inode = (ckdir / LATEST).stat().st_ino
    assert (ckdir / LATEST).stat().st_ino == inode and read_latest(ckdir) == "step-1000"
    replace_hint(ckdir / LATEST, b"step-9\n")  # shorter: the old tail is truncated away
    assert (ckdir / LATEST).read_bytes() == b"step-9\n" and (ckdir / LATEST).stat().st_ino == inode
    for torn, name in ((b"step-999\n\n", "step-999"), (b"step-5\n00\n", None), (b"step-12\n\n", "step-12")):
        (ckdir / LATEST).write_bytes(torn)
        assert read_latest(ckdir) == name, torn


@pytest.mark.parametrize("kind", ["symlink", "fifo", "dangling"])
def test_latest_that_is_not_a_regular_file_is_replaced_not_followed(ckdir: Path, tmp_path: Path, kind: str) -> None:
    """A symlink (to a file elsewhere, or dangling) or a FIFO where LATEST should be: the
    commit replaces it with a file of its own, never writes through it, never blocks."""
    from hpcckpt.store.commit import replace_hint
    ckdir.mkdir(parents=True)
    outside = tmp_path / "outside"
    if kind == "symlink":
        outside.write_text("keep me\n")
        (ckdir / LATEST).symlink_to(outside)
    elif kind == "dangling":
        (ckdir / LATEST).symlink_to(outside)
    else:
        os.mkfifo(ckdir / LATEST)
    replace_hint(ckdir / LATEST, b"step-3\n")
    assert stat.S_ISREG(os.lstat(ckdir / LATEST).st_mode) and (ckdir / LATEST).read_bytes() == b"step-3\n"
    if kind == "symlink":
        assert outside.read_text() == "keep me\n"
    else:
        assert not outside.exists()


def test_exit_while_holding_loaded_tensors_is_quiet(tmp_path: Path) -> None:
    # Restored tensors live in native buffers; holding them at interpreter exit (as every
    # training script does) must not print reference-leak reports.
    path = tmp_path / "rank-0.h5"
    code = ("import sys, torch; from pathlib import Path; from hpcckpt.store import hdf5\n"
            "p = Path(sys.argv[1]); keep = hdf5.read_tensors(p, hdf5.write_tensors(p, {'w': torch.randn(100_000)}))\n"
            "print(float(keep['w'].sum()) != 0)\n")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr
    assert "leak" not in out.stderr.lower(), out.stderr


def test_manifest_is_readable_json_that_round_trips(ckdir: Path) -> None:
    from hpcckpt.store.commit import readable_json, seal_manifest

    body = {"step": 7, "world_size": 2, "ranks": {"0": {"tensors": {"a/b": {"shape": [2, 3]}}}, "1": {}},
            "files": {}, "user": {"note": 'quote " and \n newline, é'}, "list": [{"x": {"y": 1}}]}
    assert json.loads(readable_json(body)) == body
    sealed = seal_manifest(body).decode()
    lines = sealed.splitlines()
    assert '  "0": {"tensors": {"a/b": {"shape": [2, 3]}}},' in lines  # one line per rank
    with Transaction(ckdir, "step-7") as txn:
        txn.commit(dict(body))
    assert read_manifest(ckdir / "step-7")["ranks"] == body["ranks"]


def test_manifest_seal_covers_its_bytes_and_older_canonical_seals_still_read(ckdir: Path) -> None:
    from hpcckpt._core import crc32c
    from hpcckpt.store.commit import readable_json, seal_manifest

    body = {"step": 3, "world_size": 1, "ranks": {"0": {}}, "files": {}, "user": {"k": [1, 2.5, "x"]}}
    sealed = seal_manifest(body)
    assert sealed.endswith(b'"manifest_crc32c": %d\n}\n' % json.loads(sealed)["manifest_crc32c"])
    step = ckdir / "step-3"
    step.mkdir(parents=True)
    (step / "manifest.json").write_bytes(sealed)
    assert {k: v for k, v in read_manifest(step).items() if k != "manifest_crc32c"} == body
    # one byte changed anywhere before the seal (here inside a value that still parses) fails it
    step4 = ckdir / "step-4"
    step4.mkdir()
    (step4 / "manifest.json").write_bytes(sealed.replace(b'"x"', b'"y"'))
    with pytest.raises(CheckpointCorrupt, match="fails its own checksum"):
        read_manifest(step4)
    # a manifest sealed the earlier way (crc32c of its canonical JSON) still reads
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    old = readable_json({**body, "manifest_crc32c": crc32c(canonical)}).encode()
    step5 = ckdir / "step-5"
    step5.mkdir()
    (step5 / "manifest.json").write_bytes(old)
    assert read_manifest(step5)["user"] == body["user"]
    (step5 / "manifest.json").write_bytes(old.replace(b'"x"', b'"y"'))
    with pytest.raises(CheckpointCorrupt, match="fails its own checksum"):
        read_manifest(step5)


@pytest.mark.parametrize("direct", [True, False])
def test_hdf5_reads_in_place_into_matching_live_tensors(tmp_path: Path, direct: bool) -> None:
    g = torch.Generator().manual_seed(2)
    saved = {"w": torch.randn(1_500_000, generator=g),  # a few reader chunks; torch memory is not 4 KiB-aligned
             "half": torch.randn(300, 301, generator=g).to(torch.bfloat16),
             "shape": torch.randn(40, 50, generator=g), "dtype": torch.randn(1000, generator=g),
             "strided": torch.randn(64, 64, generator=g), "tied_a": torch.randn(70_000, generator=g)}
    saved["tied_b"] = saved["tied_a"].clone()
    path = tmp_path / "rank-0.h5"
    entries = hdf5.write_tensors(path, saved)
    tied = torch.zeros(70_000)
    # "w" sits 64 bytes past a page boundary, as torch's allocator often places big tensors
    page = torch.frombuffer(native().aligned_buffer(6_000_064, 4096, True), dtype=torch.float32)
    live = {"w": page[16:], "half": torch.zeros(300, 301, dtype=torch.bfloat16),
            "shape": torch.zeros(50, 40), "dtype": torch.zeros(1000, dtype=torch.float64),
            "strided": torch.zeros(64, 64).t(), "tied_a": tied, "tied_b": tied.view(-1)}
    ptrs = {n: t.data_ptr() for n, t in live.items()}
    stats: dict[str, object] = {}
    back = hdf5.read_tensors(path, entries, into=live, direct=direct, stats=stats)
    for k, t in saved.items():
        assert back[k].dtype == t.dtype and back[k].shape == t.shape and torch.equal(back[k], t), k
    in_place = {k for k in saved if back[k].data_ptr() == ptrs[k]}
    # mismatched shape/dtype/layout get fresh memory; of two names on one memory, one is read in place
    assert in_place == {"w", "half", "tied_a"} or in_place == {"w", "half", "tied_b"}
    assert back["w"] is live["w"] and torch.equal(live["w"], saved["w"]) and torch.equal(tied, saved["tied_a"])
    assert stats["in_place_bytes"] == sum(entries[k].nbytes for k in in_place)
    if direct and _direct_supported(tmp_path):
        # live memory not aligned as O_DIRECT wants here (4 KiB, or what statx reports:
        # 512 on a virtio disk) still bypasses the page cache, through bounce buffers
        align = stats["direct_mem_align"]
        assert align in (4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
        assert stats["bounced_bytes"] == sum(entries[k].nbytes & ~4095 for k in in_place
                                             if back[k].data_ptr() % align)
        assert align <= 64 or stats["bounced_bytes"] >= entries["w"].nbytes & ~4095
    else:
        assert stats["bounced_bytes"] == 0


def test_hdf5_in_place_read_of_a_damaged_tensor_is_reported(tmp_path: Path) -> None:
    saved = {"w": torch.randn(200_000), "v": torch.randn(100_000)}
    path = tmp_path / "rank-0.h5"
    entries = hdf5.write_tensors(path, saved)
    with open(path, "r+b") as f:
        f.seek(entries["v"].offset + 5)
        f.write(b"\xff\xff")
    live = {"w": torch.zeros(200_000), "v": torch.zeros(100_000)}
    stats: dict[str, object] = {}
    with pytest.raises(CheckpointCorrupt, match="'v'"):
        hdf5.read_tensors(path, entries, into=live, stats=stats)
    assert stats["in_place_bytes"] == entries["w"].nbytes + entries["v"].nbytes  # the caller must know


def test_prune_renames_aside_and_sweeps_leftovers(ckdir: Path) -> None:
    for s in range(1, 4):
        with Transaction(ckdir, f"step-{s}") as txn:
            (txn.path / "f").write_bytes(b"x")
            txn.commit(minimal(s))
    leftover = ckdir / ".trash-step-0-dead"  # what a prune killed mid-delete leaves: never listed
    leftover.mkdir()
    (leftover / "rank-0.pt").write_bytes(b"half")
    assert [i.step for i in catalog.scan(ckdir)] == [1, 2, 3]
    removed = catalog.prune(ckdir, keep=1)
    assert sorted(p.name for p in removed) == ["step-1", "step-2"]
    assert sorted(p.name for p in ckdir.iterdir() if p.is_dir()) == ["step-3"]


def test_prune_can_leave_the_deletion_to_its_caller(ckdir: Path) -> None:
    """With ``trash``, pruned checkpoints are renamed aside (gone from every listing) at once and
    deleted only by remove_trash: what lets an engine report a save durable before old files
    are unlinked. A leftover of an earlier kill joins them; the engine empties it after each save."""
    from hpcckpt.store.commit import remove_trash
    for s in range(1, 4):
        with Transaction(ckdir, f"step-{s}") as txn:
            (txn.path / "f").write_bytes(b"x")
            txn.commit(minimal(s))
    (ckdir / ".trash-step-0-dead").mkdir()
    trash: list[Path] = []
    removed = catalog.prune(ckdir, keep=1, trash=trash)
    assert sorted(p.name for p in removed) == ["step-1", "step-2"]
    assert [i.step for i in catalog.scan(ckdir)] == [3]
    assert len(trash) == 3 and all(p.name.startswith(".trash-") and p.is_dir() for p in trash)
    remove_trash(trash)
    assert sorted(p.name for p in ckdir.iterdir() if p.is_dir()) == ["step-3"]


def test_an_engine_deletes_what_retention_pruned_once_the_save_is_reported(ckdir: Path) -> None:
    from hpcckpt.engines import SaveContext, make_engine
    from hpcckpt.ranks import Ranks
    from hpcckpt.state import TrainState

    for kind in ("sync", "concurrent"):
        root = ckdir / kind
        engine = make_engine(kind, SaveContext(root=root, keep=1, job={}, user={}), Ranks())
        state = TrainState()
        state.register("model", torch.nn.Linear(4, 4))
        engine.bind(state)
        try:
            for step in (1, 2, 3):
                assert engine.save(state.capture(step=step), step).wait(timeout=60)
                if hasattr(engine, "drain"):
                    engine.drain()
        finally:
            engine.close()
        assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["step-3"], kind
        assert not engine._trash, kind


@pytest.mark.parametrize("raw", [b"\xff\xfestep-3\n", b"../../etc\n", b"step-3/x\n", b"", b"step-\x003\n"])
def test_latest_that_is_not_a_plain_utf8_name_is_ignored(ckdir: Path, raw: bytes) -> None:
    ckdir.mkdir(parents=True)
    (ckdir / LATEST).write_bytes(raw)
    assert read_latest(ckdir) is None


@pytest.mark.parametrize("name", ["step-0099", "step-99\n", "step-\u0661\u0662", "step-01", "step-+5", "step-5 "])
def test_step_names_are_parsed_strictly(tmp_path: Path, name: str) -> None:
    """Only ``step-0`` and ``step-[1-9][0-9]*`` (ASCII) are checkpoints; any other name is
    ignored, never looked up as another step (which read as "another job is pruning")."""
    from hpcckpt.api import Checkpointer
    from hpcckpt.ranks import Ranks
    from hpcckpt.resume import load_newest
    model = torch.nn.Linear(2, 2)
    with Checkpointer(tmp_path, every_steps=1) as ck:
        ck.register(model=model)
        for _ in ck.steps(2):
            pass
    shutil.copytree(tmp_path / "step-2", tmp_path / name)
    assert [i.path.name for i in catalog.scan(tmp_path)] == ["step-1", "step-2"]
    out = load_newest(tmp_path, Ranks())
    assert out.step == 2 and out.damaged == [] and out.rounds == 1


@pytest.mark.parametrize("where", ["/proc/self", "/sys"])
def test_an_unusable_checkpoint_directory_is_a_clear_error_not_a_hang(where: str) -> None:
    from hpcckpt.errors import ConfigError
    from hpcckpt.store.lock import usable_root, writer_lock
    if os.access(where, os.W_OK) and where == "/sys" and os.geteuid() != 0:
        pytest.skip("/sys is writable here")
    with pytest.raises(ConfigError, match=f"checkpoint directory {where} cannot be used.*HPCCKPT_DIR"):
        usable_root(Path(where))
    with pytest.raises(ConfigError, match="cannot be used"):
        with writer_lock(Path(where)):
            pass
    from hpcckpt.api import Checkpointer
    with pytest.raises(ConfigError, match="cannot be used"):
        Checkpointer(where)
    with pytest.raises(ConfigError, match="cannot be used"):  # made under it: no raw OSError from mkdir
        Checkpointer(f"{where}/run/ckpt")


def test_a_prune_of_known_checkpoints_reads_one_listing_and_still_removes_what_it_must(ckdir: Path) -> None:
    """With every step directory known committed (or just committed), a prune is one listing
    and names its victims from it (the oldest beyond ``keep``, never LATEST's); a directory
    this process does not know (an incomplete one, a replaced one), a stale temporary
    directory or a discard's leftover sends it to the full pass."""
    def quick(keep: int, protected: set[str] | None = None) -> list[Path] | None:
        return catalog._quick_victims(ckdir, keep, protected or set(), str(ckdir), None)

    for s in range(1, 6):
        with Transaction(ckdir, f"step-{s}") as txn:
            (txn.path / "f").write_bytes(b"x" * s)
            txn.commit(minimal(s))
        assert catalog.prune(ckdir, keep=10, protect={ckdir / f"step-{s}"}) == []
    assert quick(10) == []
    assert quick(4) == [ckdir / "step-1"]  # one too many: the oldest
    assert quick(2, {"step-1"}) == [ckdir / "step-3", ckdir / "step-2"]  # never the protected
    (ckdir / LATEST).write_text("step-2\n")
    assert quick(2) == [ckdir / "step-3", ckdir / "step-1"]  # never LATEST's
    (ckdir / LATEST).write_text("step-5\n")
    (ckdir / "step-0").mkdir()  # no manifest: not known, and older than the newest good one
    assert quick(10) is None
    assert catalog.prune(ckdir, keep=10) == [ckdir / "step-0"]
    assert quick(10) == []
    leftover = ckdir / ".trash-step-9-0123abcd"
    leftover.mkdir()
    assert quick(10) is None
    catalog.prune(ckdir, keep=10)
    assert not leftover.exists()
    replaced = ckdir / "step-3"  # another writer's step-3 in its place: another inode
    (ckdir / "elsewhere").mkdir()  # made while the old one exists: its inode cannot be the old one's
    shutil.rmtree(replaced)
    (ckdir / "elsewhere").rename(replaced)
    assert quick(10) is None
    assert catalog.prune(ckdir, keep=10) == [replaced]
    assert sorted(i.step for i in catalog.scan(ckdir)) == [1, 2, 4, 5]
    assert catalog.prune(ckdir, keep=2) == [ckdir / "step-2", ckdir / "step-1"]  # the quick pass, applied
    assert sorted(i.step for i in catalog.scan(ckdir)) == [4, 5]


def test_a_prune_beside_trees_its_caller_holds_aside_reads_one_listing(ckdir: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A tree renamed aside that the caller holds (``trash``/``tracked``: an engine's pruned step
    waiting for the next fsync of the root, always there with ``keep=1`` and a save at every
    step) is not a leftover: the prune stays on its one listing and leaves the tree alone; a
    tree nobody holds still sends it to the full pass, which sweeps it."""
    for s in range(1, 4):
        with Transaction(ckdir, f"step-{s}") as txn:
            (txn.path / "f").write_bytes(b"x")
            txn.commit(minimal(s))
        catalog.learn_committed(ckdir / f"step-{s}")
    held = ckdir / ".trash-step-0-0123abcd"
    held.mkdir()
    listings: list[str] = []
    real = os.scandir

    def counted(path: str | os.PathLike[str] = ".") -> os._ScandirIterator[str]:
        listings.append(str(path))
        return real(path)
    monkeypatch.setattr(os, "scandir", counted)
    assert catalog.prune(ckdir, keep=3, tracked=[held]) == []
    assert listings == [str(ckdir)] and held.exists()  # one listing; the held tree untouched
    trash: list[Path] = []
    listings.clear()
    assert catalog.prune(ckdir, keep=2, trash=trash, durable=False, tracked=[held]) == [ckdir / "step-1"]
    assert held.exists() and len(trash) == 1 and trash[0].name.startswith(".trash-step-1-")
    assert listings == [str(ckdir)]  # the victim renamed aside, and no second listing for the sweep
    spare, fresh = ckdir / ".spare-0123456789ab", ckdir / ".spare-ba9876543210"
    spare.mkdir()
    fresh.mkdir()
    old = os.stat(spare).st_mtime - 2 * STALE_SPARE_AGE_S
    os.utime(spare, (old, old))  # a spare no engine touched for long: swept from the same listing
    listings.clear()
    assert catalog.prune(ckdir, keep=2, tracked=[held, *trash]) == []
    assert listings.count(str(ckdir)) == 1  # the root listed once (rmtree lists the swept tree itself)
    assert not spare.exists() and fresh.exists() and held.exists()
    listings.clear()
    assert catalog.prune(ckdir, keep=2, tracked=[]) == []  # nobody holds them now: leftovers, swept
    assert listings.count(str(ckdir)) > 1 and not held.exists() and not trash[0].exists()


def test_the_engines_commit_lock_excludes_filelock_readers_and_its_own_threads(ckdir: Path) -> None:
    """``CommitLock`` (a descriptor kept open, one flock a commit) and ``writer_lock``
    (filelock) exclude each other both ways, a listing's shared lock waits for it, threads
    of one process take turns, and a lock file replaced meanwhile is the one locked next."""
    import threading

    from filelock import Timeout

    from hpcckpt.store.lock import LOCK_NAME, CommitLock, reader_lock, writer_lock
    lock = CommitLock(ckdir)
    with lock():
        with pytest.raises(Timeout):
            with writer_lock(ckdir, timeout_s=0.1):
                pass
        with reader_lock(ckdir, timeout_s=0.1) as shared:
            assert shared is False
    with writer_lock(ckdir):
        with pytest.raises(Timeout):
            with lock(0.1):
                pass
    with reader_lock(ckdir, timeout_s=1) as shared:  # released: a listing gets it
        assert shared is True
    inside, overlaps = [0], [0]

    def commits() -> None:
        for _ in range(200):
            with lock():
                inside[0] += 1
                overlaps[0] += inside[0] > 1
                inside[0] -= 1
    threads = [threading.Thread(target=commits) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert overlaps == [0]
    (ckdir / LOCK_NAME).unlink()  # removed by hand while the engine runs; filelock makes a new one
    with writer_lock(ckdir):
        with pytest.raises(Timeout):
            with lock(0.1):
                pass
    with lock():
        assert (ckdir / LOCK_NAME).stat().st_ino == os.fstat(lock._fd).st_ino
    lock.close()
    lock.close()  # idempotent


def test_the_commit_lock_goes_through_filelock_where_the_file_system_refuses_flock(
        ckdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file system without ``flock`` (ENOLCK, as NFS without lockd says it): every commit
    then takes ``writer_lock``, whose own fallback applies; still exclusive."""
    import errno
    import fcntl as real_fcntl
    import types

    from filelock import Timeout

    from hpcckpt.store import lock as lock_mod

    def refused(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")
    monkeypatch.setattr(lock_mod, "fcntl", types.SimpleNamespace(
        flock=refused, LOCK_EX=real_fcntl.LOCK_EX, LOCK_NB=real_fcntl.LOCK_NB, LOCK_SH=real_fcntl.LOCK_SH,
        LOCK_UN=real_fcntl.LOCK_UN))
    lock = lock_mod.CommitLock(ckdir)
    with lock():
        assert lock._fallback and lock._fd is None
        with pytest.raises(Timeout):
            with lock_mod.writer_lock(ckdir, timeout_s=0.1):
                pass
    with lock():  # and every commit after it
        pass
    with lock_mod.writer_lock(ckdir, timeout_s=1):  # released
        pass


@pytest.mark.native
def test_a_resume_passes_over_more_damaged_checkpoints_than_one_round_offers(ckdir: Path) -> None:
    """The newest 36 checkpoints fail their checksums only when read whole (their sizes and
    manifests are fine): a resume offers older ones by name a window at a time
    (``resume.OLDER_WINDOW``), lists again when a window is used up, and lands on step 4."""
    from hpcckpt import resume
    from hpcckpt.api import Checkpointer
    from hpcckpt.store import torchfile
    from tests.helpers import tiny_state, train_step
    assert resume.OLDER_WINDOW < 36
    objs = tiny_state(0)
    with Checkpointer(ckdir, engine="sync", every_steps=1, keep=100) as ck:
        ck.register(**objs)
        for _ in ck.steps(40):
            train_step(objs)
    for step in range(5, 41):
        d = ckdir / f"step-{step}"
        rec = read_manifest(d)["ranks"]["0"]
        fd = os.open(d / rec["file"], os.O_RDONLY)
        try:
            found = torchfile._index(fd, rec, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        assert found is not None
        offset = found["objects/model/0.weight"].offset
        raw = bytearray((d / rec["file"]).read_bytes())
        raw[offset + 3] ^= 0x40
        (d / rec["file"]).write_bytes(bytes(raw))
    with Checkpointer(ckdir, engine="sync", every_steps=None, keep=100) as ck:
        assert ck.register(**tiny_state(1)) == 4


def test_a_commit_lists_the_files_os_walk_finds(tmp_path: Path) -> None:
    """``_relative_files`` (a commit's one scandir per directory) finds what ``os.walk``
    finds: nested files, no directories, symlinked directories not descended."""
    import os

    from hpcckpt.store.commit import _relative_files
    top = tmp_path / "t"
    (top / "sub" / "deeper").mkdir(parents=True)
    for rel in ("b", "a", "sub/c", "sub/deeper/d"):
        (top / rel).write_bytes(rel.encode())
    (top / "link").symlink_to(top / "sub")
    (top / "flink").symlink_to(top / "a")
    want = sorted(str((Path(d) / f).relative_to(top)) for d, _dirs, files in os.walk(top) for f in files)
    got = list(_relative_files(str(top)))
    assert sorted(rel for rel, _ in got) == want == ["a", "b", "flink", "sub/c", "sub/deeper/d"]
    assert all(path == str(top / rel) for rel, path in got)
