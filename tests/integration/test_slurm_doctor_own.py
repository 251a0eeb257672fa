"""``hpcckpt doctor --script`` on a rendered ``own`` template, against a real Slurm (issue 52,
item 4): it says what a script with its own checkpoints needs (its notice, the notice's lead,
each preemptable partition's GraceTime and KillWait, as this slurmctld has them), and none of
the in-process or CRIU advice (every_steps, HPCCKPT_SIGNALS, HPCCKPT_POLL_S, criu dumps).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from hpcckpt.cluster import render

if TYPE_CHECKING:
    from conftest import SlurmCluster

pytestmark = pytest.mark.slurm

IN_PROCESS = ("every_steps", "HPCCKPT_SIGNALS", "hpcckpt listens", "HPCCKPT_POLL_S", "criu dump", "--dump-every")


def test_doctor_on_the_own_template_says_what_its_jobs_need(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    script = tmp_path / "own.sbatch"
    script.write_text(render.render("own", {"COMMAND": "python train.py --resume ckpt.pt", "NOTICE": "USR1",
                                            "LEAD_S": "60", "TIME": "00:10:00"}))
    proc = subprocess.run([sys.executable, "-m", "hpcckpt.cli", "doctor", "--script", str(script),
                           "--json"], capture_output=True, text=True, timeout=120, check=False)
    report = json.loads(proc.stdout)
    checks = {c["name"]: c for c in report["checks"]}
    text = json.dumps(report)
    for word in IN_PROCESS:
        assert word not in text, word
    assert not [n for n in checks if n.startswith(("criu", "cuda", "pid+mount"))]  # no criu plug-in
    kill_wait = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=60,
                               check=True).stdout.split("KillWait", 1)[1].split("=", 1)[1].split()[0]
    assert "USR1" in checks["own notice"]["detail"]
    assert checks["own notice lead"]["ok"] and "60s before the end" in checks["own notice lead"]["detail"]
    graces = {n: c for n, c in checks.items() if n.startswith("GraceTime ")}
    assert graces, checks.keys()
    for check in graces.values():
        assert "CANCEL" in check["detail"] or f"KillWait={kill_wait}s" in check["detail"], check
    assert "Own checkpoints" in checks["preemption signal"]["detail"]
    assert proc.returncode == 0, proc.stdout[-2000:]
