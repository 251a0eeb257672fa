"""Deterministic kill points: SIGKILL just before every fsync / rename / write of the
commit protocol in turn. Whatever the point, the newest committed checkpoint and the one
LATEST names verify, and the next run resumes from it."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hpcckpt.store import catalog
from hpcckpt.store.commit import read_latest
from tests.conftest import REPO

pytestmark = [pytest.mark.fault, pytest.mark.native, pytest.mark.slow]


def check_root(root: Path) -> int | None:
    latest = read_latest(root)
    if latest is not None:
        assert catalog.check(root / latest, full=True)[1] == [], latest
    committed = [i for i in catalog.scan(root) if i.status == "committed"]
    for info in committed:
        assert catalog.check(info.path, full=True)[1] == [], info.path
    return committed[-1].step if committed else None


@pytest.mark.parametrize("engine", ["sync", "concurrent"])
@pytest.mark.parametrize("func", ["os.fsync", "os.replace", "os.write"])
def test_kill_before_each_protocol_call(tmp_path: Path, engine: str, func: str) -> None:
    killed = 0
    for n in range(1, 36, 5):
        root = tmp_path / f"{func}-{n}"
        # a first run commits some checkpoints, then dies at the n-th call
        p = subprocess.run([sys.executable, "-m", "tests.fault.kill_at_call", str(root), engine, func, str(n)],
                           cwd=REPO, capture_output=True, text=True, timeout=300)
        before = check_root(root)
        if p.returncode == -9:
            killed += 1
        # the restarted run resumes from the newest good checkpoint and finishes its steps
        p2 = subprocess.run([sys.executable, "-m", "tests.fault.kill_at_call", str(root), engine, func, "0"],
                            cwd=REPO, capture_output=True, text=True, timeout=300)
        assert p2.returncode == 0 and "finished" in p2.stdout, p2.stderr[-2000:]
        after = check_root(root)
        assert after is not None and (before is None or after > before)
    assert killed >= 3, f"{func} was called too rarely to kill the process"
