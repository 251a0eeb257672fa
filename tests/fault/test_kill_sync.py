"""kill -9 at random moments during saves never leaves a LATEST that fails to verify."""
from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest

from hpcckpt.store import catalog
from hpcckpt.store.commit import read_latest
from tests.conftest import REPO
from tests.prefork import Child

pytestmark = [pytest.mark.fault, pytest.mark.native, pytest.mark.slow]


def assert_newest_is_good(root: Path) -> int | None:
    latest = read_latest(root)
    if latest is not None:
        _, problems = catalog.check(root / latest, full=True)
        assert problems == [], f"LATEST={latest} fails verification: {problems}"
    committed = [i for i in catalog.scan(root) if i.status == "committed"]
    if committed:
        _, problems = catalog.check(committed[-1].path, full=True)
        assert problems == [], problems
        return committed[-1].step
    return None


@pytest.mark.parametrize("engine", ["sync"])
def test_kill9_during_saves(tmp_path: Path, engine: str) -> None:
    root = tmp_path / "ck"
    rng = random.Random(1234)
    steps_seen: list[int | None] = []
    for attempt in range(12):
        proc = Child(["-m", "tests.fault.kill_target", str(root), engine, "24"], cwd=REPO,
                     output=tmp_path / f"out-{attempt}.txt", errors=os.devnull)
        assert proc.first_line(300).strip() == "ready"
        time.sleep(rng.uniform(0.05, 1.5))
        if attempt == 11:
            # The last one is killed only once a newer step than the runs before it left is
            # committed, so the progress asserted below never depends on the machine's speed
            # (on a loaded machine no save may complete within the random delays).
            before = steps_seen[-1] or 0
            deadline = time.monotonic() + 300
            while not [i for i in catalog.scan(root) if i.status == "committed" and i.step > before]:
                assert proc.poll() is None and time.monotonic() < deadline, "no newer step was committed"
                time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(60)
        steps_seen.append(assert_newest_is_good(root))
    # the run made progress across restarts (each restart resumes from the newest good step)
    assert steps_seen[-1] is not None and steps_seen[-1] > (steps_seen[-2] or 0)
    # leftover temp dirs from killed saves are never treated as checkpoints
    assert all(i.status in ("committed", "incomplete") for i in catalog.scan(root))
