"""The run records' one schema (hpcckpt/lifecycle/records.py): every mode writes its `start`
and `stop` through it, with the fields history reads."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from hpcckpt.lifecycle.ledger import Ledger
from hpcckpt.lifecycle.records import MODES, record_start, record_stop, stop_fields

PACKAGE = Path(__file__).resolve().parents[2] / "hpcckpt"


def test_a_start_and_a_stop_carry_the_fields_every_reader_needs(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path)
    record_start(ledger, mode="criu", resumed_from="image-000001", process_start=1.0, image="image-000001")
    record_stop(ledger, mode="criu", reason="preemption", step=None, progress_s=12.5)
    start, stop = list(ledger.events())[-2:]
    assert {k: start[k] for k in ("event", "mode", "resumed_from", "process_start")} == {
        "event": "start", "mode": "criu", "resumed_from": "image-000001", "process_start": 1.0}
    assert {k: stop[k] for k in ("event", "mode", "reason", "step", "progress_s")} == {
        "event": "stop", "mode": "criu", "reason": "preemption", "step": None, "progress_s": 12.5}


def test_an_unknown_mode_or_no_reason_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="unknown mode 'transparent'.*criu, inprocess, own"):
        stop_fields(mode="transparent", reason="done", step=None)
    with pytest.raises(ValueError, match="needs its reason"):
        stop_fields(mode="own", reason="", step=None)
    assert MODES == {"inprocess", "criu", "own"}


def test_no_module_writes_a_start_or_stop_record_by_itself() -> None:
    """Only lifecycle/records.py spells the two records; a mode that appended its own would drift."""
    spelled = re.compile(r"""\bappend\(\s*["'](start|stop)["']|bounded_append\([^)]*["'](start|stop)["']\s*,(?!\s*\*\*(start|stop)_fields)""")
    offenders = [f"{p.relative_to(PACKAGE.parent)}:{text.count(chr(10), 0, m.start()) + 1}"
                 for p in sorted(PACKAGE.rglob("*.py")) if p.name != "records.py"
                 for text in [p.read_text(encoding="utf-8")] for m in spelled.finditer(text)]
    assert offenders == [], f"write run records with hpcckpt.lifecycle.records: {offenders}"
