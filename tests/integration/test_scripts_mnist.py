"""pytorch/examples mnist/main.py, integrated with 5 changed lines, preempted and resumed.

``mnist_main.py`` is the script as written upstream (synthetic MNIST-shaped data);
``mnist_main_hpcckpt.py`` is the same file with hpcckpt added. The integrated script
uninterrupted must print and save exactly what the original does (same data order,
shuffled or not); stopped mid-epoch and exactly at an epoch's end (its test() and
scheduler.step() not yet run) under ``hpcckpt run --mode app`` (the local supervisor
restarts it on exit 75), its losses, its per-epoch evaluations and its final model must
be the original's, bit for bit.
"""
from __future__ import annotations

import difflib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
ORIGINAL = HERE / "mnist_main.py"
INTEGRATED = HERE / "mnist_main_hpcckpt.py"
# 10 batches per epoch, 3 epochs: steps 1-30
ARGS = ["--epochs", "3", "--batch-size", "16", "--train-size", "160", "--test-size", "100",
        "--test-batch-size", "100", "--log-interval", "1", "--save-model", "--no-accel"]

pytestmark = pytest.mark.native


def env(extra: dict[str, str] | None = None) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "HPCCKPT_"))}
    e["OMP_NUM_THREADS"] = "1"  # small tensors; a shared machine
    e["PYTHONPATH"] = os.pathsep.join([str(REPO), e.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return {**e, **(extra or {})}


def run(cmd: list[str], cwd: Path, extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    cwd.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(cmd, cwd=cwd, env=env(extra), capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, f"{cmd} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc


def losses(out: str) -> list[str]:
    return re.findall(r"Loss: (\S+)", out)


def evaluations(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("Test set:")]


def same_model(a: Path, b: Path) -> bool:
    x, y = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_the_integration_changes_at_most_six_lines() -> None:
    diff = difflib.unified_diff(ORIGINAL.read_text().splitlines(), INTEGRATED.read_text().splitlines(), n=0)
    added = [line for line in diff if line.startswith("+") and not line.startswith("+++")]
    assert 0 < len(added) <= 6, added


def test_integrated_uninterrupted_is_the_original(tmp_path: Path) -> None:
    args = ARGS + ["--shuffle"]
    ref = run([sys.executable, str(ORIGINAL), *args], tmp_path / "original")
    got = run([sys.executable, str(INTEGRATED), *args], tmp_path / "integrated",
              {"HPCCKPT_DIR": str(tmp_path / "ckpt")})
    assert got.stdout == ref.stdout  # every loss and evaluation, as printed
    assert len(losses(ref.stdout)) == 30
    assert same_model(tmp_path / "original" / "mnist_cnn.pt", tmp_path / "integrated" / "mnist_cnn.pt")


def test_stopped_mid_epoch_and_at_an_epoch_end_resumes_bit_identical(tmp_path: Path) -> None:
    args = ARGS + ["--shuffle"]
    ref = run([sys.executable, str(ORIGINAL), *args], tmp_path / "original")
    ckpt = tmp_path / "ckpt"
    # step 15: epoch 2, batch 5; step 20: the last batch of epoch 2 (its test() not yet run)
    got = run([sys.executable, "-m", "hpcckpt.cli", "run", "--mode", "app", "--dir", str(ckpt), "--",
               sys.executable, str(INTEGRATED), *args], tmp_path / "integrated",
              {"HPCCKPT_DIR": str(ckpt), "HPCCKPT_STOP_AT_STEPS": "15,20"})
    assert got.stderr.count("restarting") == 2, got.stderr[-3000:]
    assert losses(got.stdout) == losses(ref.stdout)  # each step trained once, in order
    assert evaluations(got.stdout) == evaluations(ref.stdout)  # each epoch's test() once, same result
    assert same_model(tmp_path / "original" / "mnist_cnn.pt", tmp_path / "integrated" / "mnist_cnn.pt")
    # a re-run of the finished job says so and trains nothing
    again = run([sys.executable, str(INTEGRATED), *args], tmp_path / "integrated", {"HPCCKPT_DIR": str(ckpt)})
    assert losses(again.stdout) == [] and "nothing left to train" in again.stderr, again.stderr
    assert same_model(tmp_path / "original" / "mnist_cnn.pt", tmp_path / "integrated" / "mnist_cnn.pt")
