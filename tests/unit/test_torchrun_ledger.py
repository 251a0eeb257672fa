"""The batch script's question after torchrun returns: did the ranks stop for a requeue?
Answered from a real ledger written by hpcckpt's Ledger."""
from __future__ import annotations

from pathlib import Path

from hpcckpt.integrations.torchrun import main, should_requeue
from hpcckpt.lifecycle.ledger import Ledger


def test_requeue_only_after_a_committed_stop_of_the_newest_run(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path)
    assert should_requeue(tmp_path) == (False, f"no run recorded in {tmp_path}/ledger.jsonl")
    ledger.append("start", resumed_from=None)
    assert not should_requeue(tmp_path)[0]  # crashed before any stop
    ledger.append("stop", reason="signal", step=10, committed_step=10, requeue=True)
    ok, why = should_requeue(tmp_path)
    assert ok and "step 10" in why
    ledger.append("start", resumed_from=10)
    assert not should_requeue(tmp_path)[0]  # the newest run has not stopped: an older stop does not count
    ledger.append("stop", reason="signal", step=14, committed_step=12, requeue=True)
    ok, why = should_requeue(tmp_path)
    assert not ok and "last committed checkpoint is step 12" in why
    ledger.append("start", resumed_from=12)
    ledger.append("stop", reason="done", step=20, committed_step=20, requeue=False)
    assert main(["should-requeue", "--dir", str(tmp_path)]) == 1
