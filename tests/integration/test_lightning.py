"""PyTorch Lightning with HpcckptCallback: stopped mid-epoch and at an epoch's end, resumed
bit-identical to an uninterrupted plain Lightning run (loss trace and parameters); under
real Slurm, preempted by a `high` job, requeued exactly once, resumed identically.

Stops happen at a step the job reaches by construction (lightning_train.py --stop-at /
--hold-at), never by timing."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.helpers import built_once

if TYPE_CHECKING:
    from conftest import SlurmCluster


# Checked without importing the trainer into the test process.
_MISSING = importlib.util.find_spec("lightning") is None
pytestmark = [pytest.mark.skipif(_MISSING, reason="the lightning extra is not installed (scripts/bootstrap installs it)"),
              pytest.mark.slow]

JOB = Path(__file__).with_name("lightning_train.py")
STEPS = 40  # 8 batches an epoch: 5 epochs


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return env


def _train(run_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(JOB), "--dir", str(run_dir), "--steps", str(STEPS), *args],
                          env=_env(), capture_output=True, text=True, timeout=600, check=False)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted plain Lightning run (no hpcckpt)."""
    def build(out: Path) -> None:
        proc = _train(out, "--mode", "plain")
        assert proc.returncode == 0, proc.stderr[-3000:]
    return built_once(tmp_path_factory, "lightning-reference", build)


def _assert_identical(run_dir: Path, reference: Path) -> None:
    assert (run_dir / "trace.jsonl").read_text() == (reference / "trace.jsonl").read_text(), \
        "loss trace differs from the uninterrupted run"
    result = json.loads((run_dir / "result.json").read_text())
    expected = json.loads((reference / "result.json").read_text())
    assert result == expected, "final parameters differ from the uninterrupted run"


def _ledger(ckpt: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in (ckpt / "ledger.jsonl").read_text().splitlines() if line.strip()]


@pytest.mark.parametrize(("stop_at", "extra"), [(13, ("--every", "3")), (7, ())],
                         ids=["mid-epoch-with-periodic-saves", "last-batch-of-epoch"])
def test_stopped_and_resumed_matches_uninterrupted(tmp_path: Path, reference: Path, stop_at: int,
                                                    extra: tuple[str, ...]) -> None:
    run_dir = tmp_path / "run"
    first = _train(run_dir, "--stop-at", str(stop_at), *extra)
    assert first.returncode == 75, first.stderr[-3000:]
    assert not (run_dir / "result.json").exists()
    second = _train(run_dir, "--stop-at", str(stop_at), *extra)
    assert second.returncode == 0, second.stderr[-3000:]
    _assert_identical(run_dir, reference)
    ledger = _ledger(run_dir / "ckpt")
    stops = [e for e in ledger if e["event"] == "stop" and e["reason"] != "done"]
    # The signal arrives during step `stop_at`; the stop is at the boundary right after it.
    assert [(s["step"], s["committed_step"], s["reason"]) for s in stops] == [(stop_at + 1, stop_at + 1, "signal")]
    starts = [e for e in ledger if e["event"] == "start"]
    assert [s["resumed_from"] for s in starts] == [None, stop_at + 1]
    assert [e["engine"] for e in starts] == ["concurrent", "concurrent"]
    if extra:
        return
    # Run again once finished (a requeue that raced the end, a resubmitted script): Lightning
    # runs no step, and the run still begins and ends in the ledger, training nothing.
    third = _train(run_dir, *extra)
    assert third.returncode == 0, third.stderr[-3000:]
    assert (run_dir / "trace.jsonl").read_text() == (reference / "trace.jsonl").read_text()  # no step more
    result, expected = (json.loads((d / "result.json").read_text()) for d in (run_dir, reference))
    # (Lightning's restored loop reports the last epoch's index, one less than after the
    # training loop's end, in trainer.current_epoch: not compared here.)
    assert {k: v for k, v in result.items() if k != "epoch"} == {k: v for k, v in expected.items() if k != "epoch"}
    last = [(e["event"], e.get("resumed_from"), e.get("reason")) for e in _ledger(run_dir / "ckpt")][-3:]
    assert last == [("start", STEPS, None), ("nothing_left", None, None), ("stop", None, "done")], last


def test_stop_before_epoch_end_validation_resumes_identically(tmp_path: Path) -> None:
    """A signal in an epoch's last step, with validation (a shuffled loader, which draws
    from the global RNG) after it: the boundary waits until validation has ended, and the
    resumed run is bit-identical to a plain run that validates at every epoch's end."""
    reference = tmp_path / "reference"
    assert _train(reference, "--mode", "plain", "--val").returncode == 0
    run_dir = tmp_path / "run"
    assert _train(run_dir, "--stop-at", "7", "--val", "--every", "3").returncode == 75
    second = _train(run_dir, "--stop-at", "7", "--val", "--every", "3")
    assert second.returncode == 0, second.stderr[-3000:]
    _assert_identical(run_dir, reference)


def test_gradient_accumulation_stops_only_after_an_optimizer_step(tmp_path: Path) -> None:
    """With accumulate_grad_batches=3 the boundary runs only where the optimizer stepped: a
    signal during a micro-batch stops after that step's last micro-batch, never with
    half-accumulated gradients, and the resume is bit-identical."""
    reference = tmp_path / "reference"
    assert _train(reference, "--mode", "plain", "--accumulate", "3").returncode == 0
    run_dir = tmp_path / "run"
    assert _train(run_dir, "--stop-at", "6", "--accumulate", "3").returncode == 75
    second = _train(run_dir, "--stop-at", "6", "--accumulate", "3")
    assert second.returncode == 0, second.stderr[-3000:]
    _assert_identical(run_dir, reference)
    stops = [e for e in _ledger(run_dir / "ckpt") if e["event"] == "stop" and e["reason"] != "done"]
    assert [(s["step"], s["committed_step"]) for s in stops] == [(7, 7)]


def test_lightning_auto_requeue_is_turned_off(tmp_path: Path) -> None:
    """Inside a Slurm-looking environment Lightning would requeue on USR1 itself; the callback
    switches that off (one requeue, by hpcckpt) and says so."""
    code = (
        "import lightning.pytorch as pl\n"
        "from lightning.fabric.plugins.environments import SLURMEnvironment\n"
        "from hpcckpt.integrations.lightning import HpcckptCallback\n"
        f"cb = HpcckptCallback(dir={str(tmp_path / 'ckpt')!r})\n"
        "env = SLURMEnvironment(auto_requeue=True)\n"
        "t = pl.Trainer(plugins=[env], callbacks=[cb], logger=False, accelerator='cpu', devices=1)\n"
        "cb.setup(t, None, 'fit')\n"
        "print('auto_requeue', env.auto_requeue)\n")
    env = _env()
    env.update(SLURM_NTASKS="1", SLURM_JOB_NAME="train", SLURM_JOB_ID="1", SLURM_NODELIST="n1")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "auto_requeue False" in proc.stdout
    assert "turning off Lightning's SLURM auto-requeue" in proc.stderr


def test_a_loader_without_resumable_sampler_is_a_clear_error(tmp_path: Path) -> None:
    code = (
        "import torch, lightning.pytorch as pl\n"
        "from torch.utils.data import DataLoader, TensorDataset\n"
        "from hpcckpt.integrations.lightning import HpcckptCallback\n"
        "class M(pl.LightningModule):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.l = torch.nn.Linear(2, 1)\n"
        "    def training_step(self, b, i): return self.l(b[0]).sum()\n"
        "    def configure_optimizers(self): return torch.optim.SGD(self.parameters(), lr=0.1)\n"
        f"cb = HpcckptCallback(dir={str(tmp_path / 'ckpt')!r})\n"
        "t = pl.Trainer(max_steps=2, callbacks=[cb], logger=False, accelerator='cpu', devices=1,\n"
        "               enable_checkpointing=False, enable_progress_bar=False)\n"
        "try:\n"
        "    t.fit(M(), DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=4, shuffle=True))\n"
        "except Exception as exc:\n"
        "    print(type(exc).__name__, exc)\n")
    proc = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("ConfigError") and "sampler=ResumableSampler(" in proc.stdout, proc.stdout
    assert "RandomSampler" in proc.stdout


@pytest.mark.slurm
def test_lightning_preempted_under_sbatch_resumes_identically(
        slurm_cluster: SlurmCluster, tmp_path: Path, reference: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    # The first run waits inside step 13 (mid-epoch) until a signal reaches it: the
    # preemption always lands there, however slow the machine.
    command = f'{sys.executable} {JOB} --dir "$HPCCKPT_RUN_DIR" --steps {STEPS} --hold-at 13'
    script = slurm_cluster.render("lightning", run_dir / "lightning.sbatch", TIME="10:00", LEAD_S="50",
                                  RUN_DIR=str(run_dir), OUTPUT=f"{run_dir}/slurm-%j.out", COMMAND=command,
                                  JOB_NAME="hpcckpt-lightning")
    job = slurm_cluster.sbatch(script, "-p", "low", "--exclusive",
                               "--export=ALL,OMP_NUM_THREADS=1,PYTHONWARNINGS=ignore")
    out = run_dir / f"slurm-{job}.out"
    slurm_cluster.wait_until(lambda: out.exists() and "holding at step 13" in out.read_text(), 300,
                             "the job to reach step 13")
    slurm_cluster.preempt()
    slurm_cluster.wait_completed(job, 600, out)
    _assert_identical(run_dir, reference)

    ledger = _ledger(run_dir / "ckpt")
    assert [s["restart_count"] for s in ledger if s["event"] == "start"] == [0, 1]
    stops = [e for e in ledger if e["event"] == "stop" and e["reason"] != "done"]
    assert len(stops) == 1 and stops[0]["step"] == stops[0]["committed_step"] == 14, stops
    assert slurm_cluster.job(job)["Restarts"] == "1", "exactly one requeue for one preemption"
    history = slurm_cluster.history(run_dir / "ckpt")
    assert history["finished"] is True and history["lost_steps_total"] == 0
    assert [r["cause"] for r in history["rows"]] == ["preemption"], history["rows"]
    assert "Requeued SLURM job" not in out.read_text() and "Handling auto-requeue" not in out.read_text()
