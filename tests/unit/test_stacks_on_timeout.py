"""A test's wait on a process that runs out carries that process's stacks (tests/stacks.py)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests import stacks
from tests.stacks import TimeoutWithStacks


def test_a_hung_child_explains_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stacks, "MIN_TIMEOUT_S", 2.0)
    code = "import time\ndef parked_here():\n    time.sleep(300)\nparked_here()\n"
    with pytest.raises(subprocess.TimeoutExpired) as info:
        subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=3)
    assert isinstance(info.value, TimeoutWithStacks)
    assert "parked_here" in str(info.value), str(info.value)


def test_short_polling_timeouts_are_left_alone() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
    try:
        with pytest.raises(subprocess.TimeoutExpired) as info:
            proc.wait(timeout=0.1)
        assert not isinstance(info.value, TimeoutWithStacks)
    finally:
        proc.kill()
        proc.wait()
