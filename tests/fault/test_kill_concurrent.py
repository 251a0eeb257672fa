"""kill -9 a training process at random moments while concurrent persists are in flight.

After every kill the newest committed checkpoint must verify fully (every byte,
every tensor's crc32c) and the next run must resume from exactly that step.
"""
from __future__ import annotations

import json
import os
import random
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from hpcckpt.store import catalog
from tests.prefork import Child

pytestmark = [pytest.mark.native, pytest.mark.fault, pytest.mark.slow]

TRAIN = r'''
import json, sys, torch
from hpcckpt.api import Checkpointer

root, total = sys.argv[1], int(sys.argv[2])
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(768, 768) for _ in range(4)])  # ~28 MB with Adam state
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
with Checkpointer(root, engine="concurrent", every_steps=1, max_async=3, keep=3, writer_threads=1) as ck:
    resumed = ck.register(model=model, optimizer=opt)
    print(json.dumps({"resumed": resumed}), flush=True)
    for step in ck.steps(total):
        loss = model(torch.randn(32, 768)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
print(json.dumps({"done": ck.step}), flush=True)
'''

ROUNDS = 12


def newest_committed(root: Path) -> catalog.CheckpointInfo | None:
    infos = [i for i in catalog.scan(root) if i.status == "committed"]
    return infos[-1] if infos else None


def start(script: Path, root: Path, total: int, out: Path) -> tuple[Child, int | None]:
    env = {**os.environ, "HPCCKPT_CLUSTER": "local"}
    proc = Child([str(script), str(root), str(total)], env=env, output=out, errors=os.devnull)
    first = json.loads(proc.first_line(300))
    return proc, first["resumed"]


def _wait_for(cond: Callable[[], bool], proc: Child, what: str, timeout: float = 300.0) -> None:
    """Poll ``cond`` until it holds (a generous bound: a loaded machine is slow, never wrong)."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert proc.poll() is None, f"training ended (status {proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout:.0f}s"
        time.sleep(0.01)


def _in_flight(root: Path) -> bool:
    try:
        return any(".tmp-" in p.name for p in root.iterdir())
    except FileNotFoundError:
        return False


def test_kill_9_during_concurrent_persists_never_breaks_the_newest_checkpoint(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    root = tmp_path / "ckpt"
    rng = random.Random(20261121)
    total = 100_000
    for r in range(ROUNDS):
        before = newest_committed(root)
        proc, resumed = start(script, root, total, tmp_path / f"out-{r}.txt")
        assert resumed == (before.step if before else None)
        if r == 0:  # the scenario needs a committed checkpoint to protect, however slow the machine
            _wait_for(lambda: newest_committed(root) is not None, proc, "first commit")
        # Kill at a random moment while persists are in flight (what this test is about):
        # the moment is drawn, then taken at the first save in flight from there on.
        time.sleep(rng.uniform(0.05, 1.5))
        _wait_for(lambda: _in_flight(root), proc, "save in flight")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        newest = newest_committed(root)
        assert newest is not None, "the first round's committed checkpoint is gone"
        _, problems = catalog.check(newest.path, full=True)
        assert problems == [], f"newest committed {newest.path} fails verification: {problems}"
    final = newest_committed(root)
    assert final is not None, "no checkpoint committed in any round"
    proc, resumed = start(script, root, final.step + 3, tmp_path / "out-last.txt")
    assert resumed == final.step
    out = proc.communicate(timeout=600)
    assert proc.returncode == 0
    assert json.loads(out.strip().splitlines()[-1]) == {"done": final.step + 3}
    done = newest_committed(root)
    assert done is not None and done.step == final.step + 3
    assert catalog.check(done.path, full=True)[1] == []
