"""``hpcckpt doctor --mode criu -- srun ...`` ends its trial's Slurm job (issue 51, item 7).

The trial ends its instance by killing its PID namespace; a SIGKILLed srun cannot cancel
its step, so its allocation went on running on both nodes after doctor had exited (until its
time limit). Now doctor sends TERM to the trial's remote launchers first (srun cancels its
step and gives the allocation back) and waits for them, then kills the namespace.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from conftest import SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.skipif(os.geteuid() != 0, reason="PID + mount namespaces need root")]


def _live(name: str) -> list[str]:
    out = subprocess.run(["squeue", "-h", "-n", name, "-o", "%i %T"], capture_output=True, text=True, timeout=60,
                         check=True).stdout
    return [line for line in out.splitlines() if line.split()[1] in ("PENDING", "RUNNING", "CONFIGURING")]


@pytest.mark.parametrize("wrapped", [False, True], ids=["srun", "srun-under-a-shell"])
def test_doctors_criu_trial_leaves_no_slurm_job_running(slurm_cluster: SlurmCluster, wrapped: bool) -> None:
    name = f"hpcckpt-doctor-trial-{uuid.uuid4().hex[:8]}"
    srun = ["srun", "-N2", "-p", "low", "-J", name, "sleep", "300"]
    cmd = ["bash", "-c", " ".join(srun) + "; echo the shell goes on"] if wrapped else srun
    try:
        proc = subprocess.run([sys.executable, "-m", "hpcckpt.cli", "doctor", "--no-plugins", "--mode", "criu",
                               "--trial-s", "6", "--", *cmd], capture_output=True, text=True, timeout=180,
                              check=False)
        assert "criu trial" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "ended (status" not in proc.stdout, proc.stdout[-3000:]  # it was running when looked at
        slurm_cluster.wait_until(lambda: not _live(name), 30, f"the trial's job {name} to end")
    finally:
        left = _live(name)
        subprocess.run(["scancel", "-n", name], capture_output=True, timeout=60, check=False)
        time.sleep(0.5)
    assert not left
