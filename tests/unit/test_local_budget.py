"""The local supervisor's restarts are charged to the requeue budget, each one.

A real ``LocalSupervisor`` restarts a real process that asks the local backend for a
requeue (exit 75) every time: with a budget of two, the third run is refused and the
loop ends, instead of restarting until ``max_restarts``.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from hpcckpt.lifecycle.restart import LocalSupervisor

CHILD = r'''
import sys
from pathlib import Path
from hpcckpt.cluster import LocalCluster
from hpcckpt.lifecycle import requeue
out = requeue(cluster=LocalCluster(), state_dir=Path(sys.argv[1]), cause="signal", committed_step=None,
              source="test")
sys.exit(75 if out.requeued else 3)
'''


def test_every_local_restart_is_charged(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HPCCKPT_", "SLURM_"))}
    env["HPCCKPT_REQUEUE_MAX_SIGNAL"] = "2"
    sup = LocalSupervisor([sys.executable, "-c", CHILD, str(tmp_path)], max_restarts=10, env=env)
    assert sup.run() == 3
    assert sup.exit_codes == [75, 75, 3] and sup.restarts == 2
    budget = json.loads((tmp_path / "requeue-budget.json").read_text())
    assert budget["counts"] == {"signal": 2}
    assert [h["allowed"] for h in budget["history"]] == [True, True, False]
