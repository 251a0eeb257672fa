"""Symlink and FIFO swap loops against a resume: open once, then check the open file.

While a resume reads the newest checkpoint again and again, another process swaps the
rank file of that checkpoint, as fast as it can, for a symlink to a file outside the
checkpoint (an exact copy of the rank file: following the link would read it without
any checksum noticing, so the copy's access time is the witness) or for a FIFO (a
blocking open would hang the resume for good), putting the real file back between
swaps. Every read must come back (no hang), nothing outside may be read, and whatever
is loaded is the checkpoint's own state: a swapped-in name only makes that checkpoint
unreadable for that moment (the resume falls back, and says so).
Rounds are counted, not timed: the reader goes on until the swaps have hit it
``HITS`` times (or ``MAX_ROUNDS`` reads).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hpcckpt import Checkpointer
from hpcckpt.store import catalog
from tests.conftest import REPO

pytestmark = [pytest.mark.native, pytest.mark.fault]

HITS, MAX_ROUNDS = 10, 3000

SWAPPER = r'''
import os, sys
path, outside, kind, stop = sys.argv[1:5]
aside = path + ".aside"
while not os.path.exists(stop):
    os.rename(path, aside)
    if kind == "symlink":
        os.symlink(outside, path)
    else:
        os.mkfifo(path, 0o600)
    for _ in range(300):  # hold each state a while (counted, not timed) so reads land in both
        os.lstat(path)
    os.unlink(path)
    os.rename(aside, path)
    for _ in range(300):
        os.lstat(path)
'''

READER = r'''
import json, sys
from pathlib import Path
from hpcckpt.ranks import Ranks
from hpcckpt.resume import load_newest
root, hits, rounds = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
seen = {"loads": 0, "fell_back": 0, "none": 0}
ranks = Ranks()
while seen["loads"] < rounds and seen["fell_back"] < hits:
    out = load_newest(root, ranks)
    seen["loads"] += 1
    seen["fell_back"] += bool(out.damaged)
    if out.flat is None:
        seen["none"] += 1
        continue
    w = out.flat.tensors["objects/model/weight"]
    assert bool((w == out.step).all()), f"step {out.step} loaded weights it does not hold"
print(json.dumps(seen), flush=True)
'''


def _run(root: Path, engine: str, steps: int) -> None:
    """Checkpoints whose step-k weights all equal k."""
    model = torch.nn.Linear(16, 16)
    torch.nn.init.zeros_(model.weight), torch.nn.init.zeros_(model.bias)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    with Checkpointer(root, engine=engine, every_steps=1, keep=5) as ck:
        ck.register(model=model, optimizer=opt)
        for step in ck.steps(steps):
            for p in model.parameters():
                p.grad = p.detach() - (step + 1)
            opt.step()


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
@pytest.mark.parametrize("engine", ["sync", "concurrent"])
def test_swap_loop_against_resume_never_hangs_or_reads_outside(tmp_path: Path, engine: str, kind: str) -> None:
    root = tmp_path / "ck"
    _run(root, engine, 3)
    newest = [i for i in catalog.scan(root) if i.status == "committed"][-1]
    rank_file = next(p for p in newest.path.iterdir() if p.name.startswith("rank-0"))
    outside = tmp_path / "outside-copy"
    shutil.copyfile(rank_file, outside)
    os.utime(outside, (0, outside.stat().st_mtime))  # relatime: the first read sets the access time
    stop = tmp_path / "stop"
    swapper = subprocess.Popen([sys.executable, "-c", SWAPPER, str(rank_file), str(outside), kind, str(stop)],
                               cwd=REPO, stderr=subprocess.DEVNULL)
    try:
        reader = subprocess.run([sys.executable, "-c", READER, str(root), str(HITS), str(MAX_ROUNDS)], cwd=REPO,
                                capture_output=True, text=True, timeout=500, check=False)  # a hang fails here
    finally:
        stop.touch()
        swapper.wait(timeout=60)
    assert reader.returncode == 0, reader.stderr[-3000:]
    seen = json.loads(reader.stdout.strip().splitlines()[-1])
    assert outside.stat().st_atime == 0, "the resume read a file outside the checkpoint through a symlink"
    assert seen["fell_back"] > 0, f"the swaps never hit a read: {seen}"
    assert seen["loads"] > seen["none"], seen
    assert rank_file.is_file() and not rank_file.is_symlink()


@pytest.mark.parametrize("engine", ["sync", "concurrent"])
def test_a_name_swapped_between_check_and_read_is_never_followed(tmp_path: Path, engine: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The race's exact seam, made deterministic: the checkpoint passes its checks, then its
    rank file becomes a symlink to an exact copy outside before the bytes are read."""
    from hpcckpt import resume
    from hpcckpt.ranks import Ranks

    root = tmp_path / "ck"
    _run(root, engine, 3)
    newest = [i for i in catalog.scan(root) if i.status == "committed"][-1]
    rank_file = next(p for p in newest.path.iterdir() if p.name.startswith("rank-0"))
    outside = tmp_path / "outside-copy"
    shutil.copyfile(rank_file, outside)
    os.utime(outside, (0, outside.stat().st_mtime))
    real = resume.load_rank

    def swap_then_read(info: catalog.CheckpointInfo, *a: object, **k: object) -> object:
        if info.path == newest.path and not rank_file.is_symlink():
            rank_file.rename(tmp_path / "aside")
            rank_file.symlink_to(outside)
        return real(info, *a, **k)

    monkeypatch.setattr(resume, "load_rank", swap_then_read)
    out = resume.load_newest(root, Ranks())
    assert outside.stat().st_atime == 0, "the resume followed a symlink out of the checkpoint"
    assert out.step == newest.step - 1 and [s for s, _ in out.damaged] == [newest.step], out.damaged
