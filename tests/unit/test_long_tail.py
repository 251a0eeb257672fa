"""A job killed during the code between two epochs (an evaluation) comes back from the end of
that epoch's training, not from its last checkpoint.

A stop signal that arrives during such code is taken at the next step boundary; a job killed
first (a preemption's grace shorter than the evaluation) lost everything since its last save,
with ``every_steps=None`` the whole run. When the code between two passes took
``LONG_TAIL_S`` or more, the end of each pass is checkpointed. Here the threshold is lowered
to 0.2 s and the evaluation sleeps 0.4 s; the run is SIGKILLed (no handler, no final save) in
its third epoch's evaluation, restarted, and compared with an uninterrupted run.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.native

SCRIPT = r"""
import json, os, sys, time, torch
import hpcckpt.checkpointer.passes
from torch.utils.data import DataLoader, TensorDataset
from hpcckpt import Checkpointer
hpcckpt.checkpointer.passes.LONG_TAIL_S = 0.2
torch.manual_seed(0)
ds = TensorDataset(torch.randn(48, 5), torch.randint(0, 3, (48,)))
loader = DataLoader(ds, batch_size=6, shuffle=True)
model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 3))
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.8)
ck = Checkpointer(sys.argv[1], every_steps=None)
ck.register(model=model, optimizer=opt, scheduler=sched)
log = open(sys.argv[2], "a")
for epoch in ck.epochs(5):
    model.train()
    for x, y in ck.batches(loader):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(); loss.backward(); opt.step()
        log.write(json.dumps(["train", epoch, float.hex(loss.item())]) + "\n"); log.flush()
    sched.step()
    model.eval()
    log.write(json.dumps(["eval", epoch]) + "\n"); log.flush()
    time.sleep(0.4)  # the evaluation
    while os.environ.get("HANG_IN_EVAL") == str(epoch):
        time.sleep(1)  # the killed run waits here for its SIGKILL, however slow the machine
    with torch.no_grad():
        log.write(json.dumps(["evaluated", epoch, float.hex(model(ds.tensors[0]).sum().item())]) + "\n"); log.flush()
torch.save(model.state_dict(), sys.argv[3])
"""


def _run(tmp_path: Path, name: str, err: str, **extra: str) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "HPCCKPT_"))} | extra
    with open(tmp_path / err, "ab") as stderr:  # the child keeps its own descriptor
        return subprocess.Popen([sys.executable, "-c", SCRIPT, str(tmp_path / "ck"), str(tmp_path / f"{name}.log"),
                                 str(tmp_path / f"{name}.pt")], env=env, stdout=subprocess.DEVNULL, stderr=stderr)


def _lines(path: Path) -> list[list]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_job_killed_in_its_evaluation_resumes_from_the_end_of_that_epochs_training(tmp_path: Path) -> None:
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    ref = _run(ref_dir, "ref", "ref.err")
    killed = _run(tmp_path, "run", "killed.err", HANG_IN_EVAL="2")
    deadline = time.monotonic() + 120
    while ["eval", 2] not in (_lines(tmp_path / "run.log") if (tmp_path / "run.log").exists() else []):
        assert killed.poll() is None and time.monotonic() < deadline, (tmp_path / "killed.err").read_text()
        time.sleep(0.02)
    # The end of epoch 2's training (8 batches an epoch: step 24) was checkpointed before the
    # evaluation; the default (concurrent) engine makes it durable in the background, so the
    # kill waits for its commit, as a real evaluation of LONG_TAIL_S or more would.
    committed_by = time.monotonic() + 120
    while not (tmp_path / "ck" / "step-24").is_dir():
        assert killed.poll() is None and time.monotonic() < committed_by, "step 24 was never committed"
        time.sleep(0.02)
    killed.send_signal(signal.SIGKILL)  # in epoch 2's evaluation (it waits there): no handler runs, nothing saved
    killed.wait()
    assert ref.wait(timeout=120) == 0
    resumed = _run(tmp_path, "run", "resumed.err")
    assert resumed.wait(timeout=120) == 0, (tmp_path / "resumed.err").read_text()
    assert "resumed from step 24" in (tmp_path / "resumed.err").read_text()
    run, ref_lines = _lines(tmp_path / "run.log"), _lines(ref_dir / "ref.log")
    cut = run.index(["eval", 2])
    assert run[:cut + 1] == ref_lines[:cut + 1]  # the killed run, up to its death
    # the resumed run trains nothing of epoch 2 again, evaluates it again, then goes on as the reference
    assert run[cut + 1:] == ref_lines[cut:]
    import torch
    got, want = torch.load(tmp_path / "run.pt"), torch.load(ref_dir / "ref.pt")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
