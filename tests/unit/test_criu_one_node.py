"""CRIU mode takes one node: the template and the supervisor refuse more, naming the templates
that do (a 2-node criu job was dumped on one node only and ended FAILED at its preemption)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpcckpt.cluster import render
from hpcckpt.errors import ConfigError


def test_the_criu_template_refuses_several_nodes() -> None:
    with pytest.raises(ConfigError, match="one node.*hpcckpt template ddp"):
        render.render("criu", {"NODES": "2"})


def test_the_supervisor_runs_a_multi_node_job_untouched_and_says_why(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(SLURM_JOB_ID="4242", SLURM_JOB_NUM_NODES="2", SLURM_NNODES="2", SLURM_JOB_NODELIST="n[1-2]")
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "hpcckpt.cli", "run", "--mode", "criu", "--dir", str(run_dir), "--",
                           sys.executable, "-c", "print('the command ran')"], env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "the command ran" in proc.stdout
    assert "NOT IN CRIU MODE" in proc.stderr and "hpcckpt template ddp" in proc.stderr, proc.stderr
    events = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()]
    assert [e for e in events if e["event"] == "criu_refused"][0]["nodes"] == 2
    assert not (run_dir / "criu" / "images").exists() or not list((run_dir / "criu" / "images").iterdir())
