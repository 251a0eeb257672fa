"""Whatever reads the ledger on a job's path streams it (``Ledger.events``): a huge ledger
costs time, never memory. Each reader runs here with ``Ledger.read`` (the whole ledger as
a list) made to fail, and must still give its answer."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from hpcckpt.criu.dump import dump_margin_s
from hpcckpt.criu.restore import restarted
from hpcckpt.criu.watch import Progress
from hpcckpt.integrations.torchrun import should_requeue
from hpcckpt.lifecycle.ledger import Ledger


@pytest.fixture(autouse=True)
def no_whole_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    def whole(self: Ledger) -> list[dict[str, Any]]:
        raise AssertionError("the whole ledger was read into memory")
    monkeypatch.setattr(Ledger, "read", whole)


def _write(root: Path, events: list[dict[str, Any]]) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / "ledger.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))


def test_lost_since_folds_a_stream() -> None:
    events = [{"event": "start", "dump_every_s": 60}, {"event": "criu_dump", "progress_s": 50.0},
              {"event": "stop", "progress_s": 40.0},
              {"event": "criu_restore", "dump_every_s": 30}, {"event": "criu_dump", "progress_s": 90.0}]
    assert Progress.lost_since(iter(events), 60.0) == {"lost_s": 30.0, "lost_exact": False, "lost_at_most_s": 30}
    assert Progress.lost_since(iter(events[:3]), 45.0) == {"lost_s": 5.0, "lost_exact": True}
    assert Progress.lost_since(iter([{"event": "stop"}]), 0.0) == {}


def test_the_criu_supervisor_streams_its_ledger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "_HPCCKPT_LOCAL_RESTART", "HPCCKPT_LOCAL_RESTART"):
        monkeypatch.delenv(name, raising=False)
    ledger = Ledger(tmp_path)
    _write(tmp_path, [{"event": "start", "job_id": "7"}, {"event": "criu_dump", "dump_s": 20.0, "commit_s": 5.0},
                      {"event": "stop", "reason": "done"}, {"event": "criu_restore", "job_id": "8"}])
    assert restarted(ledger) == "an earlier run (job 8) in this directory did not finish"
    assert dump_margin_s(ledger) == 75.0
    _write(tmp_path, [{"event": "start", "job_id": "7"}, {"event": "stop", "reason": "error"}])
    assert restarted(ledger) is None


def test_torchrun_should_requeue_streams_the_ledger(tmp_path: Path) -> None:
    _write(tmp_path, [{"event": "start"}, {"event": "stop", "requeue": False, "reason": "done"},
                      {"event": "start"}, {"event": "stop", "requeue": True, "step": 5, "committed_step": 5}])
    ok, why = should_requeue(tmp_path)
    assert ok, why


CHILD = r'''
import json, sys, pathlib
ledger = pathlib.Path(sys.argv[1]) / "ledger.jsonl"
with ledger.open("a") as fh:
    fh.write(json.dumps({"event": "requeue", "requeued": False, "detail": "budget spent (test)"}) + "\n")
sys.exit(75)
'''


def test_hpcckpt_run_streams_the_ledger_for_a_refused_requeue(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from hpcckpt.app.supervise import AppOptions, restart_locally
    monkeypatch.delenv("HPCCKPT_DIR", raising=False)
    opts = AppOptions(cmd=(sys.executable, "-c", CHILD, str(tmp_path)), dir=tmp_path, max_restarts=5)
    assert restart_locally(opts)[0] == 75  # refused by the ledger's last requeue: not restarted 5 times
    assert (tmp_path / "ledger.jsonl").read_text().count('"requeue"') == 1
