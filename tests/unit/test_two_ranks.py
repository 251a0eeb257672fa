"""Two real ranks (gloo over loopback) and the concurrent engine: a save that fails
to start on one rank fails on both, without hanging, and the next save commits; ranks
that name different steps never produce a mixed checkpoint; a restart restores in
place on both ranks, and a checkpoint damaged on one rank sends both back together;
with every_steps="auto", ranks whose own timings pick different intervals still save
at the same steps."""
from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

import pytest

from hpcckpt.store import catalog
from tests.conftest import REPO
from tests.prefork import Child, wait_all

pytestmark = pytest.mark.native


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_failure_on_one_rank_fails_the_save_everywhere_and_the_next_commits(tmp_path: Path) -> None:
    outs = _run_ranks(tmp_path, hung="a rank hung in the commit exchange")
    results = [json.loads((tmp_path / f"result-{r}.json").read_text()) for r in range(2)]

    root = tmp_path / "ckpt"
    steps = sorted(i.step for i in catalog.scan(root) if i.status == "committed")
    # step 4 failed on rank 1, so on both; 8 is the end-of-training save; no step 20/21 (mismatch)
    assert steps == [2, 6, 8], steps
    assert all(r["committed_step"] == 8 for r in results)
    assert not [p for p in root.iterdir() if ".tmp-" in p.name], "a failed save left its temporary directory"
    assert catalog.check(catalog.find(root, None).path, full=True)[1] == []
    # rank 0 learnt why step 4 failed: rank 1's error, named
    assert "step 4 failed" in outs[0] and "injected" in outs[0], outs[0]
    for r in results:
        assert "rank 1 was committing step 21, not step 20" in r["errors"]["mismatch"], r
        assert set(r["errors"]) == {"mismatch"}, r
        assert "used after Checkpointer.close()" in r["after_close"], r
        assert r["restored"] == 8 and r["in_place"] and r["equal"], r
        assert r["fallback"] == 6, r  # rank 1's damaged step 8 made both ranks skip it


def _run_ranks(tmp_path: Path, *args: str, timeout: float = 120,
               hung: str = "the ranks hung (one saved alone?)") -> list[str]:
    """Both ranks of two_rank_worker with ``args``; their outputs once both exited 0."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HPCCKPT_", "SLURM_"))}
    env["HPCCKPT_CLUSTER"] = "local"
    procs = [Child(["-m", "tests.unit.two_rank_worker", str(r), str(port), str(tmp_path), *args], cwd=REPO, env=env,
                   output=tmp_path / f"worker-{'-'.join(args)}-r{r}.log") for r in range(2)]
    try:
        wait_all(procs, timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{hung}:\n" + "\n".join(q.read_output() for q in procs))
    outs = [p.read_output() for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outs)
    return outs


def test_auto_interval_ranks_with_different_timings_save_at_the_same_steps(tmp_path: Path) -> None:
    _run_ranks(tmp_path, "auto")
    results = [json.loads((tmp_path / f"auto-{r}.json").read_text()) for r in range(2)]
    # The injected timings make the ranks' own intervals differ (1 step against 10,000) ...
    assert (results[0]["interval"], results[1]["interval"]) == (1, 10_000), results
    # ... yet every boundary's decision is shared: the same saves, every one committed.
    assert results[0]["saved"] == results[1]["saved"], results
    assert results[0]["saved"][:2] == [2, 3], results  # step 3: rank 0 alone wanted it
    assert all(r["committed_step"] == 8 for r in results), results
    root = tmp_path / "ckpt"
    committed = sorted(i.step for i in catalog.scan(root) if i.status == "committed")
    assert committed == sorted(set(results[0]["saved"])), committed
