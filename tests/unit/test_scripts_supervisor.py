"""``hpcckpt run --mode app`` outside Slurm is the local supervisor: it restarts a command that
exits 75 ("requeue me"), counts the restarts, and gives up when told to."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Exits 75 on its first two runs (as a job stopped for a requeue does), then 0; prints the
# restart number the supervisor gives it.
SCRIPT = '''
import os, sys
from pathlib import Path
runs = Path(sys.argv[1])
n = int(runs.read_text()) if runs.exists() else 0
runs.write_text(str(n + 1))
print("restart", os.environ.get("_HPCCKPT_LOCAL_RESTART"), flush=True)
sys.exit(75 if n < 2 else 0)
'''


def supervise(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "HPCCKPT_"))}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run([sys.executable, "-m", "hpcckpt.cli", "run", "--mode", "app", "--dir", str(tmp_path / "run"),
                           *extra, "--", sys.executable, str(script), str(tmp_path / "runs")],
                          capture_output=True, text=True, env=env, timeout=120, check=False)


def test_a_script_that_exits_75_twice_runs_to_completion(tmp_path: Path) -> None:
    proc = supervise(tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "runs").read_text() == "3"
    assert proc.stdout.split() == ["restart", "0", "restart", "1", "restart", "2"]
    assert "restart 1 of at most 10" in proc.stderr and "restart 2 of at most 10" in proc.stderr


def test_restarts_are_budgeted(tmp_path: Path) -> None:
    proc = supervise(tmp_path, "--max-restarts", "1")
    assert proc.returncode == 75 and (tmp_path / "runs").read_text() == "2"
    assert "giving up" in proc.stderr and "--max-restarts" in proc.stderr


def test_a_signal_while_the_command_is_being_started_reaches_it_once_it_runs(monkeypatch) -> None:
    """A forwarded signal whose handler runs while ``run`` is starting the command (the
    supervisor's lock held by the code it interrupted, on the same thread) is sent once the
    command runs; waiting for the lock there hung the supervisor for ever."""
    import signal
    import threading

    from hpcckpt.lifecycle import restart as mod

    real_popen = subprocess.Popen

    def popen_interrupted(*args: object, **kwargs: object) -> subprocess.Popen:
        proc = real_popen(*args, **kwargs)  # type: ignore[call-overload]
        assert sup.signal(signal.SIGUSR2)  # as the handler would, inside run()'s lock
        return proc

    monkeypatch.setattr(mod.subprocess, "Popen", popen_interrupted)
    sup = mod.LocalSupervisor([sys.executable, "-c", "import time; time.sleep(60)"], max_restarts=0)
    got: list[int] = []
    runner = threading.Thread(target=lambda: got.append(sup.run()), daemon=True)
    runner.start()
    runner.join(30)
    assert not runner.is_alive(), "the supervisor hung on its own lock"
    assert got == [-signal.SIGUSR2]  # the command got the signal (and died of it: no handler yet)
