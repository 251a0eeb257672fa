"""``hpcckpt run --mode app`` under Slurm (``hpcckpt.app``): the command runs as it is, every
signal the batch shell receives is passed on, its exit status is the run's, and nothing of
CRIU mode is made. (Outside Slurm app mode is the local restart loop: test_criu_parts and
test_scripts_supervisor.)"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path


def test_app_mode_under_slurm_passes_signals_on_and_the_exit_status_back(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "HPCCKPT_"))}
    env.update(SLURM_JOB_ID="4343", SLURM_JOB_NUM_NODES="1", SLURM_NNODES="1", SLURM_JOB_NODELIST="n1")
    flag = tmp_path / "got"
    script = ("import pathlib, signal, sys, time\n"
              "def stop(s, f):\n"
              f"    pathlib.Path({str(flag)!r}).write_text(signal.Signals(s).name)\n"
              "    sys.exit(42)\n"
              "signal.signal(signal.SIGUSR1, stop)\n"
              "print('ready', flush=True)\n"
              "time.sleep(60)\n")
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "hpcckpt.cli", "run", "--mode", "app", "--dir", str(run_dir),
                             "--json", "--", sys.executable, "-c", script], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGUSR1)  # not a --signal of the run: passed on all the same
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 42, err
    assert flag.read_text() == "SIGUSR1"
    assert "forwarding SIGUSR1 to the job" in err and "job exited with status 42" in err, err
    assert json.loads(out) == {"exit_code": 42, "action": "exited", "restored_from": None, "images": [],
                               "detail": ""}
    assert run_dir.is_dir() and not (run_dir / "criu").exists()
