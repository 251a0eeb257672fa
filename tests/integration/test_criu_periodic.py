"""Periodic CRIU images (``--dump-every``) and a kill without any warning.

The job runs on after each periodic image (``criu dump --leave-running --track-mem``);
the second image takes its unchanged pages from the first (criu's parent link) where the
kernel has soft-dirty tracking, and is a full image where it has not. Then
everything is killed with SIGKILL, as a node failure or a GraceTime=0 preemption with a
short KillWait would: the next run restores the newest periodic image (through its
chain), finishes bit-identical to an uninterrupted run, and says how much it may have
lost: at most one interval.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hpcckpt.criu import find_criu
from hpcckpt.criu.locate import tracks_memory

from .test_criu_local import criu_ok, finish, hpcckpt, local_env  # noqa: F401  (fixture)
from .test_criu_preempt import PLAIN_TRAIN

pytestmark = [pytest.mark.criu, pytest.mark.slow]

STEPS = 200
EVERY_S = 2


def ledger(run_dir: Path, name: str) -> list[dict]:
    lines = (run_dir / "ledger.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == name]


def kill_everything(proc: subprocess.Popen) -> None:
    """SIGKILL the supervisor and every process under it at once: no signal to act on. All are
    stopped first, the supervisor before its job: killed one by one, the supervisor could see
    its job die and record a stop before its own turn (seen on a loaded machine)."""
    from hpcckpt.proc import tree as proctree

    pids = proctree.tree(proc.pid)  # the supervisor first
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
    proc.communicate(timeout=60)


def test_kill_without_warning_resumes_from_the_newest_periodic_image(criu_ok: None,  # noqa: F811
                                                                       tmp_path: Path) -> None:
    script, run_dir = tmp_path / "plain_train.py", tmp_path / "run"
    script.write_text(PLAIN_TRAIN)
    ref, out = tmp_path / "ref.json", tmp_path / "out.json"
    subprocess.run([sys.executable, str(script), str(STEPS), str(ref), "0"], check=True,
                   stdout=subprocess.DEVNULL, timeout=600)
    cmd = [sys.executable, str(script), str(STEPS), str(out), "0.1"]
    first = subprocess.Popen(hpcckpt("run", "--mode", "criu", "--dir", str(run_dir), "--json", "--dump-every",
                                     str(EVERY_S), "--", *cmd),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=local_env())
    try:
        from .conftest import SlurmCluster

        SlurmCluster.wait_until(lambda: (run_dir / "ledger.jsonl").exists()
                                and len(ledger(run_dir, "criu_dump")) >= 2, 300, "two periodic images")
    finally:
        kill_everything(first)
    dumps = ledger(run_dir, "criu_dump")
    assert all(d["periodic"] for d in dumps), dumps
    # Where the kernel tracks dirty pages the second image holds only what changed after the first.
    assert dumps[1]["parent"] == (dumps[0]["image"] if tracks_memory(find_criu()) else None), dumps
    assert not out.exists()  # it was killed mid-run

    code, summary, stderr = finish(subprocess.Popen(
        hpcckpt("run", "--mode", "criu", "--dir", str(run_dir), "--json", "--", *cmd),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=local_env()))
    assert code == 0, stderr
    newest = ledger(run_dir, "criu_dump")[-1]["image"]
    assert summary["restored_from"] == newest  # taken from the chain: its parent's pages included
    result, reference = json.loads(out.read_text()), json.loads(ref.read_text())
    assert result == reference
    [restore] = ledger(run_dir, "criu_restore")
    assert restore["lost_exact"] is False and restore["lost_at_most_s"] == EVERY_S, restore
    assert [s["reason"] for s in ledger(run_dir, "stop")] == ["done"]
