"""hpcckpt ls / verify / inspect on real checkpoints written by the Checkpointer."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import h5py
import pytest
import torch

from hpcckpt.api import Checkpointer
from hpcckpt.engines import SaveContext, make_engine
from hpcckpt.ranks import Ranks
from hpcckpt.state import TrainState
from hpcckpt.store import catalog, hdf5
from tests.conftest import REPO
from tests.helpers import tiny_state, train_step

pytestmark = pytest.mark.native


def cli(*args: str) -> tuple[int, str]:
    p = subprocess.run([sys.executable, "-m", "hpcckpt.cli", *args], cwd=REPO, capture_output=True, text=True)
    return p.returncode, p.stdout + p.stderr


def make_ckpts(root: Path, steps: int = 6, every: int = 2) -> None:
    objs = tiny_state(0)
    with Checkpointer(root, engine="sync", every_steps=every, keep=5) as ck:  # its tests read rank-0.pt
        ck.register(**objs)
        for _ in ck.steps(steps):
            train_step(objs)


def test_ls_json_lists_every_status(ckdir: Path) -> None:
    make_ckpts(ckdir)
    (ckdir / "step-6" / "manifest.json").unlink()
    (ckdir / "step-99.tmp-abc").mkdir()
    code, out = cli("ls", str(ckdir), "--json")
    assert code == 0
    rows = {(r["step"], r["status"]) for r in json.loads(out)}
    assert rows == {(2, "committed"), (4, "committed"), (6, "incomplete"), (99, "incomplete")}
    assert all({"step", "status", "path", "bytes"} <= set(r) for r in json.loads(out))


def test_verify_names_the_flipped_tensor(ckdir: Path) -> None:
    make_ckpts(ckdir)
    code, out = cli("verify", str(ckdir), "--json")
    assert code == 0 and json.loads(out)["ok"] is True
    # flip one byte inside one tensor's bytes of the newest checkpoint
    f = ckdir / "step-6" / "rank-0.pt"
    raw = bytearray(f.read_bytes())
    w = tiny_state(0)["model"][0].weight.detach().contiguous().numpy().tobytes()
    pos = bytes(raw).find(w[:16])
    if pos < 0:  # weights changed by training: locate via the trained tensor instead
        loaded = torch.load(f, weights_only=True)["tensors"]["objects/model/0.weight"]
        pos = bytes(raw).find(loaded.numpy().tobytes()[:16])
    assert pos > 0
    raw[pos + 5] ^= 0x01
    f.write_bytes(bytes(raw))
    code, out = cli("verify", str(ckdir), "--json")
    res = json.loads(out)
    assert code == 1 and res["ok"] is False
    assert any("objects/model/0.weight" in p for p in res["checkpoints"][0]["problems"]), res
    code, text = cli("verify", str(ckdir), "--step", "4")
    assert code == 0 and "OK" in text


def test_verify_hdf5_names_tensor_and_h5py_shows_all(ckdir: Path) -> None:
    objs = tiny_state(0)
    train_step(objs)  # so the optimizer has state
    st = TrainState()
    for k, v in objs.items():
        st.register(k, v)
    flat = st.capture(step=1)
    rec_dir = ckdir / "step-1.tmp-x"
    rec_dir.mkdir(parents=True)
    entries = hdf5.write_tensors(rec_dir / "rank-0.h5", flat.tensors)
    eng = make_engine("sync", SaveContext(root=ckdir, keep=3, job={}, user={}), Ranks())
    eng._commit(1, rec_dir, [{"file": "rank-0.h5", "format": "hdf5", "meta": flat.meta,
                              "tensors": {n: e.to_json() for n, e in entries.items()}}])
    with h5py.File(ckdir / "step-1" / "rank-0.h5") as h:
        seen: list[str] = []
        h.visititems(lambda n, o: seen.append(n) if isinstance(o, h5py.Dataset) else None)
    assert sorted(seen) == sorted(flat.tensors)
    assert cli("verify", str(ckdir))[0] == 0
    e = entries["objects/optimizer/state/0/exp_avg"]
    with open(ckdir / "step-1" / "rank-0.h5", "r+b") as fh:
        fh.seek(e.offset + 1)
        fh.write(b"\x7f")
    code, out = cli("verify", str(ckdir))
    assert code == 1 and "objects/optimizer/state/0/exp_avg" in out


def test_inspect_json_shows_manifest(ckdir: Path) -> None:
    make_ckpts(ckdir)
    code, out = cli("inspect", str(ckdir), "--json")
    m = json.loads(out)["manifest"]
    assert code == 0 and m["step"] == 6 and m["engine"] == "sync" and m["world_size"] == 1
    assert "objects/model/0.weight" in m["ranks"]["0"]["tensors"]
    code, out = cli("inspect", str(ckdir), "--step", "77")
    assert code == 3 and "step 77" in out


def test_non_utf8_latest_and_ledger_line_break_nothing(ckdir: Path) -> None:
    make_ckpts(ckdir)
    (ckdir / "LATEST").write_bytes(b"step-\xff\xfe6\n")
    with open(ckdir / "ledger.jsonl", "ab") as f:  # a line another tool mangled, then a torn one
        f.write(b'{"event": "stop", "reason": "\xff\xfe"}\n{"event": "sig')
    code, out = cli("ls", str(ckdir), "--json")
    assert code == 0 and {r["step"] for r in json.loads(out)} == {2, 4, 6}, out
    code, out = cli("history", str(ckdir), "--json")
    assert code == 0 and json.loads(out)["finished"] is True, out
    code, out = cli("requeue", "--dir", str(ckdir), "--json")
    assert code == 75 and json.loads(out)["requeued"] is True, out  # local backend: exit 75 = restart me
    # the next append starts on a line of its own: the torn line costs nothing else
    from hpcckpt.lifecycle.ledger import Ledger
    Ledger(ckdir).append("probe", step=1)
    assert Ledger(ckdir).read()[-1]["event"] == "probe"
    objs = tiny_state(3)
    with Checkpointer(ckdir, every_steps=2, keep=1) as ck:  # resume + retention read LATEST too
        assert ck.register(**objs) == 6
        for _ in ck.steps(8):
            train_step(objs)
    assert [i.step for i in catalog.scan(ckdir)] == [8]


def test_history_says_what_became_of_the_job_when_its_criu_dump_failed(tmp_path: Path) -> None:
    from hpcckpt.lifecycle.ledger import Ledger
    ledger = Ledger(tmp_path)
    ledger.append("start", restart_count=0)
    ledger.append("criu_dump_failed", error="no space", job_ended=False, fix="free some space")
    ledger.append("criu_dump_failed", error="lock found no process", job_ended=True, exited_itself=True,
                  exit_code=0)
    ledger.append("criu_dump_failed", error="cuCheckpointProcessLock did not return", stuck=True)
    code, out = cli("history", str(tmp_path))
    assert code == 0, out
    lines = [line for line in out.splitlines() if "CRIU dump failed" in line]
    assert len(lines) == 3, out
    assert "job kept running: no space; fix: free some space" in lines[0]
    assert "the job finished by itself (exit 0): lock found no process" in lines[1]
    assert "THE JOB MAY BE STUCK" in lines[2]
    code, out = cli("history", str(tmp_path), "--json")
    assert code == 0 and [e["error"] for e in json.loads(out)["failed_dumps"]][1] == "lock found no process"
