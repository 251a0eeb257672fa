"""What hpcckpt quiets in the script's process ends with the script (issue 51, item 7).

The workers of a loader trained through ``ckpt.batches``/``loop`` ignore the stop signals
(``QuietWorkers``). multiprocessing ends the workers still running at the interpreter's exit
with a TERM and then joins them without a timeout: a loader with ``persistent_workers=True``
(timm's ``train.py`` with ``-j > 0``) kept its two workers to the end, and the process hung
for ever after its last line, after a normal end, after a stop's exit 75 and after an
exception alike (and ``hpcckpt check`` with it). Each case here is a fresh interpreter in a
session of its own; the timeouts are hang detectors, not timings: a run that hangs is killed
with its whole session and fails the test.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from hpcckpt.proc import workers

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.native

HANG_S = 60.0  # a run of a few seconds; past this it hangs (the bug: for ever)

# timm's train.py, reduced: persistent workers, epochs of ckpt.batches, a stop by SIGUSR2 at
# step STOP (Slurm's warning), an exception at step RAISE; the last line says when it ran.
SCRIPT = '''
import os, signal, sys, time
import torch
from torch.utils.data import DataLoader, TensorDataset
from hpcckpt import Checkpointer

STOP, RAISE, KEEP = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "keep"
torch.manual_seed(0)
loader = DataLoader(TensorDataset(torch.randn(256, 4), torch.randn(256, 1)), batch_size=8, shuffle=True,
                    num_workers=2, persistent_workers=not KEEP)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
ckpt = Checkpointer(every_steps=None)
ckpt.register(model=model, opt=opt)
for epoch in ckpt.epochs(2):
    for x, y in ckpt.batches(loader):
        loss = ((model(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if ckpt.step + 1 == STOP:
            os.kill(os.getpid(), signal.SIGUSR2)
        if ckpt.step + 1 == RAISE:
            raise ValueError("the script's own error")
if KEEP:  # an iterator of the (quieted) loader the script keeps to the end, outside hpcckpt
    kept = iter(loader)
    next(kept)
print("workers at the end:", len(__import__("multiprocessing").active_children()), file=sys.stderr)
print("LAST LINE", time.time(), file=sys.stderr, flush=True)
'''


def _run(tmp_path: Path, *, stop: int = 0, raise_at: int = 0, keep: bool = False,
         cmd: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HPCCKPT_", "SLURM_"))}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", HPCCKPT_DIR=str(tmp_path / "ckpt"))
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    args = cmd or [sys.executable, str(script), str(stop), str(raise_at), "keep" if keep else "-"]
    proc = subprocess.Popen(args, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=HANG_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(args[-4:])} hung at exit (still running after {HANG_S:.0f}s):\n{err[-3000:]}")
    ended = time.time()
    try:  # nothing of the session is left (the workers included)
        os.killpg(proc.pid, 0)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            os.killpg(proc.pid, 0)
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("processes of the script's session outlived it")
    except ProcessLookupError:
        pass
    if "LAST LINE" in err:
        last = float(err.rsplit("LAST LINE", 1)[1].split()[0])
        print(f"exit {ended - last:.2f}s after the last line")  # for the record; no timing is asserted
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def test_persistent_workers_end_with_the_script_after_a_normal_end(tmp_path: Path) -> None:
    done = _run(tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "workers at the end: 2" in done.stderr and "LAST LINE" in done.stderr  # they were alive to the end


def test_persistent_workers_end_with_the_script_after_a_stop(tmp_path: Path) -> None:
    stopped = _run(tmp_path, stop=13)
    assert stopped.returncode == 75, stopped.stderr[-3000:]
    assert "stopping at step 13" in stopped.stderr
    resumed = _run(tmp_path)  # the next allocation resumes and ends, and exits too
    assert resumed.returncode == 0 and "resumed from step 13" in resumed.stderr, resumed.stderr[-3000:]


def test_persistent_workers_end_with_the_script_after_an_exception(tmp_path: Path) -> None:
    failed = _run(tmp_path, raise_at=9)
    assert failed.returncode == 1 and "the script's own error" in failed.stderr, failed.stderr[-3000:]


def test_a_quieted_loaders_iterator_the_script_keeps_ends_too(tmp_path: Path) -> None:
    """An iterator of a quieted loader made outside hpcckpt (not persistent) and kept to the end."""
    done = _run(tmp_path, keep=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "workers at the end: 2" in done.stderr and "Traceback" not in done.stderr, done.stderr[-3000:]


def test_hpcckpt_check_returns_on_such_a_script(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    checked = _run(tmp_path, cmd=[sys.executable, "-m", "hpcckpt.cli", "check", "--stops", "1", "--",
                                  sys.executable, str(script), "0", "0", "-"])
    assert checked.returncode == 0, checked.stdout[-3000:] + checked.stderr[-3000:]
    assert "identical" in checked.stdout, checked.stdout[-3000:]


def test_the_exit_hook_ends_quieted_workers_in_this_process() -> None:
    """In process: a persistent loader's quieted workers end at ``end_workers`` (the exit hook),
    and the workers of a loader hpcckpt never quieted are left alone."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from hpcckpt.signals import quiet_workers
    ds = TensorDataset(torch.zeros(16, 2))
    quieted = DataLoader(ds, batch_size=4, num_workers=2, persistent_workers=True)
    quiet_workers(quieted, [signal.SIGTERM, signal.SIGUSR2])
    other = DataLoader(ds, batch_size=4, num_workers=1, persistent_workers=True)
    list(quieted)
    list(other)
    mine: Any = quieted._iterator
    theirs: Any = other._iterator
    assert all(w.is_alive() for w in mine._workers)
    try:
        assert workers.end_workers() == []  # told to end, they end: none had to be killed
        assert not any(w.is_alive() for w in mine._workers)
        assert theirs._workers[0].is_alive()
    finally:
        theirs._shutdown_workers()
        mine._shutdown_workers()
