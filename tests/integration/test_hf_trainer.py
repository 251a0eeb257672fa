"""Hugging Face Trainer with HpcckptTrainerCallback on a tiny GPT-2 built from a config
(nothing downloaded): stopped mid-epoch and at an epoch's end, resumed bit-identical to an
uninterrupted plain Trainer run; under real Slurm, preempted, requeued once, identical.

Stops happen at a step the job reaches by construction (hf_train.py --stop-at / --hold-at)."""

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
_MISSING = importlib.util.find_spec("transformers") is None or importlib.util.find_spec("accelerate") is None
pytestmark = [pytest.mark.skipif(_MISSING, reason="the hf extra is not installed (scripts/bootstrap installs it)"),
              pytest.mark.slow]

JOB = Path(__file__).with_name("hf_train.py")
STEPS = 30  # 8 batches an epoch


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", HF_HUB_OFFLINE="1")
    return env


def _train(run_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(JOB), "--dir", str(run_dir), "--steps", str(STEPS), *args],
                          env=_env(), capture_output=True, text=True, timeout=600, check=False)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    def build(out: Path) -> None:
        proc = _train(out, "--mode", "plain")
        assert proc.returncode == 0, proc.stderr[-3000:]
    return built_once(tmp_path_factory, "hf-reference", build)


def _assert_identical(run_dir: Path, reference: Path) -> None:
    assert (run_dir / "trace.jsonl").read_text() == (reference / "trace.jsonl").read_text(), \
        "loss trace differs from the uninterrupted run"
    assert json.loads((run_dir / "result.json").read_text()) == json.loads((reference / "result.json").read_text()), \
        "final parameters differ from the uninterrupted run"


def _ledger(ckpt: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in (ckpt / "ledger.jsonl").read_text().splitlines() if line.strip()]


@pytest.mark.parametrize(("stop_at", "extra"), [(11, ("--every", "3")), (7, ())],
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
    assert [(s["step"], s["committed_step"]) for s in stops] == [(stop_at + 1, stop_at + 1)]
    starts = [e for e in ledger if e["event"] == "start"]
    assert [s["resumed_from"] for s in starts] == [None, stop_at + 1]
    assert {e["engine"] for e in starts} == {"concurrent"}
    # Nothing of the Trainer's own pickled checkpoint format was written or read.
    assert not list((run_dir / "ckpt").rglob("*.pth")) and not list((run_dir / "ckpt").rglob("*.bin"))
    if extra:
        # Run again once finished (as after a stop in the code after train()): the Trainer,
        # resumed at max_steps, would take one more batch and step before it checks whether
        # to stop; it trains nothing and the script goes on to its end (it raised
        # StopIteration, then trained step 31).
        third = _train(run_dir, *extra)
        assert third.returncode == 0, third.stderr[-3000:]
        _assert_identical(run_dir, reference)  # no trace line, no step more, same parameters
        assert [e["event"] for e in _ledger(run_dir / "ckpt")][-2:] == ["nothing_left", "stop"]


def test_train_without_resume_point_is_a_clear_error(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        f"sys.path.insert(0, {str(JOB.parent)!r})\n"
        "from hf_train import GPT2Config, GPT2LMHeadModel, Tokens, Trainer, TrainingArguments\n"
        "from hpcckpt.integrations.hf import HpcckptTrainerCallback\n"
        "model = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=8, n_embd=8, n_layer=1, n_head=2,\n"
        "                                   bos_token_id=0, eos_token_id=0))\n"
        f"args = TrainingArguments(output_dir={str(tmp_path / 'out')!r}, max_steps=2, use_cpu=True,\n"
        "                         report_to=[], save_strategy='no', disable_tqdm=True)\n"
        f"cb = HpcckptTrainerCallback(dir={str(tmp_path / 'ckpt')!r})\n"
        "try:\n"
        "    Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[cb]).train()\n"
        "except Exception as exc:\n"
        "    print(type(exc).__name__, exc)\n")
    proc = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("ConfigError") and "resume_point(trainer)" in proc.stdout, proc.stdout


def test_stop_at_an_evaluation_step_resumes_identically(tmp_path: Path) -> None:
    """The Trainer evaluates every 4 steps (its eval loader draws from the global RNG); a stop
    at step 8 waits until that evaluation has ended and resumes bit-identical."""
    reference = tmp_path / "reference"
    assert _train(reference, "--mode", "plain", "--eval-every", "4").returncode == 0
    run_dir = tmp_path / "run"
    assert _train(run_dir, "--stop-at", "7", "--eval-every", "4", "--every", "3").returncode == 75
    second = _train(run_dir, "--stop-at", "7", "--eval-every", "4", "--every", "3")
    assert second.returncode == 0, second.stderr[-3000:]
    _assert_identical(run_dir, reference)


def test_two_ranks_under_torchrun_resume_identically(tmp_path: Path) -> None:
    """DDP (gloo) with ranks from torchrun's environment; torchrun itself exits 1 when its
    workers exit 75, so the ledger says whether they stopped for a requeue."""
    def torchrun(run_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                               str(JOB), "--dir", str(run_dir), "--steps", "16", *args], env=_env(),
                              capture_output=True, text=True, timeout=600, check=False)

    reference = tmp_path / "reference"
    assert torchrun(reference, "--mode", "plain").returncode == 0
    run_dir = tmp_path / "run"
    assert torchrun(run_dir, "--stop-at", "5").returncode != 0
    from hpcckpt.integrations.torchrun import should_requeue
    assert should_requeue(run_dir / "ckpt")[0]
    second = torchrun(run_dir, "--stop-at", "5")
    assert second.returncode == 0, second.stderr[-3000:]
    _assert_identical(run_dir, reference)
    assert json.loads((run_dir / "result.json").read_text())["world_size"] == 2
    assert sorted(p.stem for p in (run_dir / "ckpt" / "step-6").glob("rank-*")) == ["rank-0", "rank-1"]


@pytest.mark.slurm
def test_hf_trainer_preempted_under_sbatch_resumes_identically(
        slurm_cluster: SlurmCluster, tmp_path: Path, reference: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    command = f'{sys.executable} {JOB} --dir "$HPCCKPT_RUN_DIR" --steps {STEPS} --hold-at 11'
    script = slurm_cluster.render("single", run_dir / "hf.sbatch", TIME="10:00", LEAD_S="50",
                                  RUN_DIR=str(run_dir), OUTPUT=f"{run_dir}/slurm-%j.out", COMMAND=command,
                                  JOB_NAME="hpcckpt-hf")
    job = slurm_cluster.sbatch(script, "-p", "low", "--exclusive",
                               "--export=ALL,OMP_NUM_THREADS=1,PYTHONWARNINGS=ignore,HF_HUB_OFFLINE=1")
    out = run_dir / f"slurm-{job}.out"
    slurm_cluster.wait_until(lambda: out.exists() and "holding at step 11" in out.read_text(), 300,
                             "the job to reach step 11")
    slurm_cluster.preempt()
    slurm_cluster.wait_completed(job, 600, out)
    _assert_identical(run_dir, reference)
    ledger = _ledger(run_dir / "ckpt")
    assert [s["restart_count"] for s in ledger if s["event"] == "start"] == [0, 1]
    stops = [e for e in ledger if e["event"] == "stop" and e["reason"] != "done"]
    assert len(stops) == 1 and stops[0]["step"] == stops[0]["committed_step"] == 12, stops
    assert slurm_cluster.job(job)["Restarts"] == "1", "exactly one requeue for one preemption"
    history = slurm_cluster.history(run_dir / "ckpt")
    assert history["finished"] is True and history["lost_steps_total"] == 0
    assert [r["cause"] for r in history["rows"]] == ["preemption"], history["rows"]


def test_own_checkpoints_with_the_callback_under_the_own_supervisor(tmp_path: Path, reference: Path) -> None:
    """The Trainer keeping its own checkpoints (hpcckpt.own.hf_callback(), the script's own
    get_last_checkpoint resume) under `hpcckpt run --mode own` (the local supervisor): a TERM to
    the supervisor becomes the notice; the Trainer saves its checkpoint at the step's end, the
    script exits 75, is run again, resumes from its own checkpoint and ends as an uninterrupted
    run does."""
    import signal
    import time

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "hpcckpt.cli", "run", "--mode", "own", "--dir", str(run_dir / "own"),
                             "--notice", "TERM", "--", sys.executable, str(JOB), "--dir", str(run_dir), "--steps",
                             str(STEPS), "--mode", "own", "--step-sleep", "0.2"], env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        trace = run_dir / "trace.jsonl"
        deadline = time.monotonic() + 300
        while not (trace.exists() and len(trace.read_text().splitlines()) >= 5) and time.monotonic() < deadline:
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=600)
    finally:
        proc.kill()
    assert proc.returncode == 0, out[-3000:]
    assert "exited 75" in out and "hpcckpt run: the command exited with status 0" in out, out[-3000:]
    _assert_identical(run_dir, reference)
    events = _ledger(run_dir / "own")
    saved = [e for e in events if e["event"] == "saved"]
    assert len(saved) == 1 and str(saved[0]["path"]).endswith(f"checkpoint-{saved[0]['step']}"), saved
    assert [e["event"] for e in events].count("start") == 2
