"""CRIU mode on a GPU node (``pytest -m gpu``; needs root, a CUDA device, driver >= 570, criu >= 4).

- A CUDA training job (criu_train.py --device cuda, deterministic kernels) under
  ``hpcckpt run --mode criu``, signalled twice and restored twice into fresh
  namespaces: loss trace and final parameters bit-identical to an uninterrupted run.
- A CPU job on the same node likewise. Whether it has CUDA state is the driver's answer,
  and the test checks it against what the job holds: on the H200 node (torch
  2.11+cu130) the CPU job's first backward initialised the driver (it held /dev/nvidia*
  files), so it must go through the CUDA checkpoint like a CUDA job (criu cannot dump
  those files); a job that holds none is dumped as a CPU process.
- A process with libcuda mapped and no CUDA context is not a CUDA process for the
  real driver.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.test_criu_local import (  # noqa: F401
    EXIT_REQUEUE,
    TRAIN,
    criu_ok,
    finish,
    kill_supervised,
    ledger,
    local_env,
    start,
    wait_for_step,
)

pytestmark = [pytest.mark.gpu, pytest.mark.criu, pytest.mark.slow]

STEPS = 40
DETERMINISTIC = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
# The tiny model takes ~5-10 ms a step on an H100, less than the dump path (load the
# driver, cuInit, state query, lock: ~0.7 s): without a pause the job would end before it
# is locked. The pause changes no number (the reference runs without it).
STEP_SLEEP_S = 0.3


def train(out: Path, device: str, *, step_sleep_s: float = 0.0) -> list[str]:
    return [sys.executable, str(TRAIN), "--steps", str(STEPS), "--out", str(out), "--device", device,
            "--step-sleep-s", str(step_sleep_s)]


def uninterrupted(out: Path, device: str) -> dict:
    subprocess.run(train(out, device), check=True, stdout=subprocess.DEVNULL, timeout=900,
                   env=local_env(DETERMINISTIC))
    return json.loads(out.read_text())


def gpu_files_held(supervisor: int) -> bool:
    """Whether the training process under ``supervisor`` holds /dev/nvidia* files (driver state
    that criu cannot dump: the CUDA checkpoint must release it)."""
    from hpcckpt.proc import tree as proctree

    def argv(pid: int) -> list[str]:
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            return []
    jobs = [p for p in proctree.tree(supervisor) if len(argv(p)) > 1 and argv(p)[1].endswith("criu_train.py")]
    assert jobs, f"no criu_train.py process under PID {supervisor}"
    return bool(proctree.nvidia_handles(jobs[-1]))


def twice_interrupted(run_dir: Path, out: Path, device: str, at_steps: tuple[int, ...] = (10, 25),
                      held: list[bool] | None = None) -> list[dict]:
    """``held``: filled with gpu_files_held() of the job just before each signal."""
    summaries = []
    cmd = train(out, device, step_sleep_s=STEP_SLEEP_S)
    for n, step in enumerate(at_steps, start=1):
        proc = start(run_dir, out, cmd=cmd, env=DETERMINISTIC)
        try:
            wait_for_step(run_dir, step, proc)
            if held is not None:
                held.append(gpu_files_held(proc.pid))
            proc.send_signal(signal.SIGUSR2)
            code, summary, stderr = finish(proc)
        finally:
            kill_supervised(proc)  # an assertion or timeout above must not leave the job running
        assert code == EXIT_REQUEUE, f"expected exit 75 after dump {n}, got {code}: {stderr}"
        assert summary.get("images") == [f"image-{n:06d}"], \
            f"dump {n} (signalled at step {step}) committed no image: {summary}; {stderr}"
        summaries.append(summary)
    proc = start(run_dir, out, cmd=cmd, env=DETERMINISTIC)
    try:
        code, summary, stderr = finish(proc)
    finally:
        kill_supervised(proc)
    assert code == 0, f"final incarnation failed ({code}): {stderr}"
    return [*summaries, summary]


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_job_signalled_twice_restored_twice_is_bit_identical(criu_ok: None, tmp_path: Path,  # noqa: F811
                                                             device: str) -> None:
    reference = uninterrupted(tmp_path / "ref.json", device)
    out, run_dir = tmp_path / "out.json", tmp_path / "run"
    held: list[bool] = []
    summaries = twice_interrupted(run_dir, out, device, held=held)
    result = json.loads(out.read_text())
    assert result["losses"] == reference["losses"]
    assert result["digest"] == reference["digest"]
    assert [s["restored_from"] for s in summaries] == [None, "image-000001", "image-000002"]
    dumps = [e for e in ledger(run_dir) if e["event"] == "criu_dump"]
    # The supervisor's CUDA count (the driver's answer) agrees with what the job held.
    assert [d["cuda_pids"] for d in dumps] == [int(h) for h in held]
    if device == "cuda":
        assert held == [True, True]
        manifest = json.loads((run_dir / "criu" / "image-000002" / "manifest.json").read_text())
        assert manifest["cuda_pids"] == [2] and manifest["gpus"] and manifest["gpus"][0]["uuid"].startswith("GPU-")


NO_CONTEXT = "import torch, time\nprint('ready', flush=True)\ntime.sleep(120)\n"


def test_libcuda_mapped_without_context_is_skipped() -> None:
    from hpcckpt.cuda import CudaCheckpoint, cuda_pids
    from hpcckpt.cuda.group import driver_mappers

    with subprocess.Popen([sys.executable, "-c", NO_CONTEXT], stdout=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
            if proc.pid not in driver_mappers(proc.pid):
                pytest.skip("this torch build does not map libcuda until CUDA is used")
            assert CudaCheckpoint().probe(proc.pid) is None
            assert cuda_pids(proc.pid) == []
        finally:
            proc.kill()
