"""Slurm's stop signal reaches every process of the job, DataLoader workers included.

torch's workers die of a TERM that is not their parent's, and torch's SIGCHLD handler then
raises RuntimeError in the main thread: pytorch/examples dcgan (two workers, the default),
its process group sent TERM as Slurm does, exited 1 mid-backward with no final checkpoint,
and under Slurm its requeue call failed with that error. Now the workers of a loader
trained through ``ckpt.batches``/``loop`` ignore the stop signals (the main process stops at
its step boundary and its exit ends them), and a worker death caused by a stop signal, or
any worker death once the job is stopping, no longer raises in the main thread."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hpcckpt.signals import QuietWorkers, SignalRecorder, quiet_workers

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.native

SCRIPT = '''
import multiprocessing, os, signal, sys, time
import torch
from torch.utils.data import DataLoader, TensorDataset
from hpcckpt import Checkpointer

STOP = int(sys.argv[1])
torch.manual_seed(0)
loader = DataLoader(TensorDataset(torch.randn(256, 4), torch.randn(256, 1)), batch_size=8, shuffle=True,
                    num_workers=2)
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
            os.killpg(0, signal.SIGTERM)  # every process of the job, as Slurm signals it
            time.sleep(1.0)  # a worker that died would be reported here, mid-step
            print("workers alive:", sum(p.is_alive() for p in multiprocessing.active_children()), file=sys.stderr)
torch.save(model.state_dict(), sys.argv[2])
'''


def _run(tmp_path: Path, stop: int, out: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HPCCKPT_", "SLURM_"))}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", HPCCKPT_DIR=str(tmp_path / "ckpt"))
    return subprocess.run([sys.executable, "-c", SCRIPT, str(stop), str(tmp_path / out)], env=env,
                          capture_output=True, text=True, timeout=300, start_new_session=True, check=False)


def test_term_to_the_whole_process_group_stops_at_the_boundary_and_the_run_comes_back(tmp_path: Path) -> None:
    stopped = _run(tmp_path, 13, "a.pt")
    assert stopped.returncode == 75, stopped.stderr[-3000:]
    assert "killed by signal" not in stopped.stderr and "exited unexpectedly" not in stopped.stderr
    assert "workers alive: 2" in stopped.stderr  # they ignored it; the main process's exit ended them
    ledger = [json.loads(line) for line in (tmp_path / "ckpt" / "ledger.jsonl").read_text().splitlines()]
    stop = next(e for e in ledger if e["event"] == "stop")
    assert stop["reason"] == "signal" and stop["step"] == 13 and stop["committed_step"] == 13, stop
    finished = _run(tmp_path, 0, "b.pt")  # the next allocation: resumes at 13 and ends
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert "resumed from step 13" in finished.stderr


def test_quiet_workers_wraps_the_loaders_own_init_once_and_leaves_loaders_without_workers() -> None:
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    seen: list[int] = []
    ds = TensorDataset(torch.zeros(4))
    with_workers = DataLoader(ds, num_workers=2, worker_init_fn=seen.append)
    quiet_workers(with_workers, [signal.SIGTERM, signal.SIGUSR2])
    quiet_workers(with_workers, [signal.SIGTERM, signal.SIGUSR2])
    fn = with_workers.worker_init_fn
    assert isinstance(fn, QuietWorkers) and fn.inner == seen.append, fn
    assert fn.signums == (signal.SIGTERM, signal.SIGUSR2)
    plain = DataLoader(ds)
    quiet_workers(plain, [signal.SIGTERM])
    assert plain.worker_init_fn is None

    class Wrapper:  # a script's own wrapper of its loader: no num_workers, left as it is
        def __iter__(self):  # type: ignore[no-untyped-def]
            yield from plain

    quiet_workers(Wrapper(), [signal.SIGTERM])  # before: AttributeError from reading num_workers


def test_quiet_workers_reaches_the_loader_an_accelerate_adapter_iterates() -> None:
    accelerate = pytest.importorskip("accelerate")
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    shard = accelerate.Accelerator(cpu=True).prepare(DataLoader(TensorDataset(torch.zeros(4)), num_workers=2))
    quiet_workers(shard, [signal.SIGTERM])
    assert isinstance(shard.base_dataloader.worker_init_fn, QuietWorkers)  # the workers' loader


def _torch_like(message: str) -> object:
    """A SIGCHLD handler that raises as torch's does when a DataLoader worker died (the seam)."""
    def handler(signum: int, frame: object) -> None:
        raise RuntimeError(message)
    return handler


@pytest.mark.parametrize("case", ["killed by a stop signal", "any death while stopping", "a crash"])
def test_a_workers_death_raises_in_the_main_thread_only_when_the_job_is_not_stopping(case: str) -> None:
    previous = signal.getsignal(signal.SIGCHLD)
    recorder = SignalRecorder([signal.SIGTERM, signal.SIGUSR2])
    said = ("DataLoader worker (pid 7) is killed by signal: Terminated. " if case == "killed by a stop signal"
            else "DataLoader worker (pid 7) is killed by signal: Segmentation fault. ")
    try:
        signal.signal(signal.SIGCHLD, _torch_like(said))  # type: ignore[arg-type]
        recorder.install()
        recorder.guard_children()
        if case == "any death while stopping":
            os.kill(os.getpid(), signal.SIGUSR2)
        handler = signal.getsignal(signal.SIGCHLD)
        assert callable(handler)
        if case == "a crash":
            with pytest.raises(RuntimeError, match="Segmentation fault"):
                handler(signal.SIGCHLD, None)
            assert recorder.received == []
        else:
            handler(signal.SIGCHLD, None)
            handler(signal.SIGCHLD, None)  # torch reports the dead worker again at every SIGCHLD
            stop = signal.SIGTERM if case == "killed by a stop signal" else signal.SIGUSR2
            assert [r.signum for r in recorder.received] == [stop]
            assert recorder.worker_errors == [said.strip()]
        recorder.uninstall()
        assert signal.getsignal(signal.SIGCHLD) is not handler  # torch's is back
    finally:
        recorder.uninstall()
        signal.signal(signal.SIGCHLD, previous)
