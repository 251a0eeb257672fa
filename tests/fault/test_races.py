"""Reading a checkpoint directory while another process trains in it and prunes (keep=1).

The reader resolves and loads the newest checkpoint again and again, lists the
directory and fully verifies the newest one, exactly as a resume, ``hpcckpt ls`` and
``hpcckpt verify`` do. Whatever the interleaving, it must never come back empty
(a silent fresh start), never load a checkpoint whose content is not its step's,
never see a committed step reported as corrupt or half there, and never raise.
The loops are bounded by counts, not time: the outcome cannot depend on speed.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hpcckpt.ranks import Ranks
from hpcckpt.resume import load_newest
from hpcckpt.store import catalog
from tests.conftest import REPO

pytestmark = [pytest.mark.native, pytest.mark.fault]

WRITER = r'''
import sys, torch
from hpcckpt.api import Checkpointer

root, engine, total = sys.argv[1], sys.argv[2], int(sys.argv[3])
model = torch.nn.Linear(64, 64)
torch.nn.init.zeros_(model.weight), torch.nn.init.zeros_(model.bias)
opt = torch.optim.SGD(model.parameters(), lr=1.0)
with Checkpointer(root, engine=engine, every_steps=1, keep=1) as ck:
    ck.register(model=model, optimizer=opt)
    for step in ck.steps(total):
        # checkpoint step-k holds weights equal to k (exact in float32), so a reader can tell;
        # only optimizer.step() changes them, as the concurrent engine requires
        for p in model.parameters():
            p.grad = p.detach() - (step + 1)
        opt.step()
print("done", flush=True)
'''

READER = r'''
import json, sys, time
from pathlib import Path
from hpcckpt.cli.verify import _newest
from hpcckpt.ranks import Ranks
from hpcckpt.resume import load_newest
from hpcckpt.store import catalog

root, done, max_loads = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
ranks = Ranks()
loads, retries, steps, polls = 0, 0, set(), 0
print("ready", flush=True)
while loads < max_loads and not (loads and done.exists()):  # as long as the writer runs
    out = load_newest(root, ranks)
    if out.flat is None:
        # before the writer's first commit only; afterwards "nothing" would be a fresh start
        assert loads == 0 and not out.damaged and not out.unusable, (loads, out.damaged, out.unusable)
        polls += 1
        assert polls < 60_000, "the writer never committed"
        time.sleep(0.005)  # leave the CPU to the writer until its first commit
        continue
    assert not out.damaged, out.damaged
    w = out.flat.tensors["objects/model/weight"]
    assert bool((w == out.step).all()), f"step {out.step} holds weights of another step"
    for info in catalog.scan(root):
        assert info.status != "corrupt", info.problems
        assert info.status == "committed" or ".tmp-" in info.path.name, (info.path, info.status)
    if loads % 10 == 0:
        newest = _newest(root)
        assert newest.problems == [], newest.problems
    loads += 1
    retries += out.rounds - 1
    steps.add(out.step)
print(json.dumps({"loads": loads, "retries": retries, "distinct_steps": len(steps)}), flush=True)
'''


@pytest.mark.parametrize("engine", ["sync", "concurrent"])
def test_resume_and_listing_race_a_writer_that_prunes(tmp_path: Path, engine: str) -> None:
    root = tmp_path / "ck"
    done = tmp_path / "writer-done"
    reader = subprocess.Popen([sys.executable, "-c", READER, str(root), str(done), "5000"], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert reader.stdout is not None and reader.stdout.readline().strip() == "ready"
    try:
        writer = subprocess.run([sys.executable, "-c", WRITER, str(root), engine, "60"], cwd=REPO,
                                capture_output=True, text=True, timeout=300)
    finally:
        done.touch()
    out, err = reader.communicate(timeout=300)
    assert writer.returncode == 0 and "done" in writer.stdout, writer.stderr[-3000:]
    assert reader.returncode == 0, err[-3000:]
    assert json.loads(out.strip().splitlines()[-1])["loads"] >= 1
    # the writer's last checkpoint is the only one left, and it loads
    assert [i.step for i in catalog.scan(root)] == [60]
    assert load_newest(root, Ranks()).step == 60


def test_a_candidate_pruned_before_it_is_read_is_retried_not_corrupt(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Deterministic form of the race: between listing and reading, a writer commits a newer
    step and retention removes the listed one (the real commit and prune run at that seam)."""
    import torch

    from hpcckpt import resume
    from hpcckpt.api import Checkpointer

    root = tmp_path / "ck"
    model = torch.nn.Linear(4, 4)
    with Checkpointer(root, every_steps=1, keep=1) as ck:
        ck.register(model=model)
        for _ in ck.steps(3):
            pass
        real = resume.load_rank
        calls: list[int] = []

        def writer_moves_on(info: catalog.CheckpointInfo, *a: object, **k: object) -> object:
            calls.append(info.step)
            if len(calls) == 1:
                ck.step = 5
                ck.save(final=True)  # commits step 5, and keep=1 prunes step 3 under the reader
            return real(info, *a, **k)

        monkeypatch.setattr(resume, "load_rank", writer_moves_on)
        out = load_newest(root, Ranks())
    assert calls == [3, 5] and out.step == 5 and out.damaged == [] and out.rounds == 2
