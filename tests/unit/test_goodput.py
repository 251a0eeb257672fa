"""``hpcckpt history --goodput``: the wall time split into productive training and badput.

A real preempted-and-resumed run (a real SIGUSR2 through the Checkpointer's handler, then a
resume) and ledgers written by hand with known times (exact buckets), and hostile records:
whatever the ledger holds, the buckets are never negative, always sum to the wall time, and
nothing raises. No assertion here depends on how long anything took.
"""
from __future__ import annotations

import json
import math
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from hpcckpt.cli.main import main
from hpcckpt.cluster.causes import RunRecord
from hpcckpt.lifecycle.history import BUCKETS, goodput, interruptions, load
from hpcckpt.lifecycle.ledger import LEDGER, process_start_time


def _check_sums(info: dict[str, Any]) -> None:
    """The invariants of every accounting: buckets >= 0, rows tile the wall time, totals add up."""
    assert set(info["buckets"]) == set(BUCKETS) == set(info["badput_types"])
    assert all(v >= 0 for v in info["buckets"].values()), info["buckets"]
    assert sum(info["buckets"].values()) == pytest.approx(info["wall_s"], abs=1e-6)
    for row in info["rows"]:
        assert all(v >= 0 for v in row["buckets"].values()), row
        assert sum(row["buckets"].values()) == pytest.approx(row["span_s"], abs=1e-6), row
    for b in BUCKETS:
        assert sum(r["buckets"][b] for r in info["rows"]) == pytest.approx(info["buckets"][b], abs=1e-6)
    assert sum(r["span_s"] for r in info["rows"]) == pytest.approx(info["wall_s"], abs=1e-6)
    if info["wall_s"] > 0:
        assert 0 <= info["goodput"] <= 1
    json.dumps(info, allow_nan=False)  # JSON-ready, no NaN or infinity


def _real_run(ckdir: Path, total: int, *, signal_at: int | None = None) -> None:
    from hpcckpt.api import Checkpointer
    from tests.helpers import tiny_state, train_step
    objs = tiny_state(0)
    with Checkpointer(ckdir, engine="sync", every_steps=3, keep=2) as ck:
        ck.register(**objs)
        for step in ck.steps(total):
            train_step(objs)
            if signal_at is not None and step + 1 == signal_at:
                os.kill(os.getpid(), signal.SIGUSR2)  # a real signal through the real handler


@pytest.mark.native
def test_a_preempted_and_resumed_run_shows_its_save_restore_and_requeue_time(
        ckdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from hpcckpt.api import RequeueExit
    with pytest.raises(RequeueExit):
        _real_run(ckdir, 12, signal_at=7)
    _real_run(ckdir, 12)
    info = goodput(load(ckdir), slurm=[])
    _check_sums(info)
    first, second = info["rows"]
    assert (first["ended"], second["ended"]) == ("signal", "done")
    assert (first["resumed_from"], first["reached_step"], second["resumed_from"]) == (0, 7, 7)
    assert first["lost_steps"] == 0 and info["buckets"]["wasted_progress"] == 0  # the stop's save kept step 7
    assert first["buckets"]["checkpoint_save"] > 0 and second["buckets"]["checkpoint_save"] > 0
    assert second["buckets"]["checkpoint_restore"] > 0 and first["buckets"]["checkpoint_restore"] >= 0
    assert first["buckets"]["requeue_and_queue_wait"] > 0  # the requeue, and the wait for the next start
    assert second["buckets"]["requeue_and_queue_wait"] == 0 and info["buckets"]["unaccounted"] == 0
    assert first["buckets"]["productive_training"] > 0 and second["buckets"]["productive_training"] > 0
    assert first["step_s"] > 0

    assert main(["history", str(ckdir), "--goodput", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["buckets"] == info["buckets"] and len(out["rows"]) == 2 and out["dir"] == str(ckdir)
    assert main(["history", str(ckdir), "--goodput"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("goodput ") and "wall time, 2 run(s)" in table[0], table
    assert table[1].split()[:4] == ["#", "job", "ended", "span"] and "requeue+q" in table[1]
    assert [line.split()[2] for line in table[2:4]] == ["signal", "done"]
    assert table[4].split()[0] == "total" and table[5].strip().endswith("%")
    assert main(["history", str(ckdir)]) == 0  # the interruption table is as before
    assert "1 interruption(s)" in capsys.readouterr().out


def _ev(event: str, t: Any, **fields: Any) -> dict[str, Any]:
    return {"event": event, "time": t, "job_id": "41", "slurm_job_id": "41", "pid": 7, **fields}


# Three runs: a preemption with its stop's save, a run killed without a stop (its newest
# checkpoint then damaged: the next run skips it and redoes 10 steps), and the end.
HAND_WRITTEN = [
    _ev("start", 1010.0, process_start=1000.0, restore_s=0.0, resumed_from=None, restart_count=0),
    _ev("commit", 1020.0, step=10, final=False, save_s=3.0, stall_s=1.0),
    _ev("commit", 1031.0, step=20, final=False, save_s=3.0, stall_s=1.0),
    _ev("signal", 1040.0, step=30, signame="SIGUSR2"),
    _ev("commit", 1042.0, step=30, final=True, save_s=2.0, stall_s=0.5),
    _ev("stop", 1043.0, reason="signal", step=30, committed_step=30),
    _ev("requeue", 1044.0, method="scontrol", requeued=True, cause="preemption"),
    _ev("start", 1100.0, process_start=1090.0, restore_s=3.0, resumed_from=30, restart_count=1),
    _ev("commit", 1110.0, step=40, final=False, save_s=1.0, stall_s=0.0),
    _ev("commit", 1120.0, step=50, final=False, save_s=1.0, stall_s=0.0),
    # killed here; the next run finds step 50 damaged before its start record
    _ev("skip_corrupt", 1196.0, step=50, problem="crc mismatch", restart_count=2, pid=8),
    _ev("start", 1200.0, process_start=1190.0, restore_s=5.0, resumed_from=40, restart_count=2, pid=8),
    _ev("commit", 1229.0, step=70, final=True, save_s=1.0, stall_s=0.2, pid=8),
    _ev("stop", 1230.0, reason="done", step=70, committed_step=70, pid=8),
]


def test_hand_written_ledger_gives_each_bucket_exactly() -> None:
    info = goodput(HAND_WRITTEN, slurm=[])
    _check_sums(info)
    assert info["wall_s"] == 230.0 and info["allocations"] == 3
    rows = [r["buckets"] for r in info["rows"]]
    # run 1: 10 s start-up; training 1010..1040 less 2 s of periodic stalls; the stop's save
    # 1040..1043; the requeue 1043..1044 and the wait until the next process began (1090)
    assert rows[0] == {**dict.fromkeys(BUCKETS, 0.0), "program_startup": 10.0, "checkpoint_save": 5.0,
                       "productive_training": 28.0, "requeue_and_queue_wait": 47.0}
    # run 2: start-up 1090..1097, restore 1097..1100; 20 steps in 20 s (1 s a step) of which
    # 10 were done again (resumed at 40, had reached 50); then 70 s nobody can account for
    assert rows[1] == {**dict.fromkeys(BUCKETS, 0.0), "program_startup": 7.0, "checkpoint_restore": 3.0,
                       "productive_training": 10.0, "wasted_progress": 10.0, "unaccounted": 70.0}
    assert (info["rows"][1]["lost_steps"], info["rows"][1]["step_s"], info["rows"][1]["ended"]) == (10, 1.0, "vanished")
    # run 3: its start-up ends where its restore begins (the skip_corrupt record is its own, not run 2's)
    assert rows[2] == {**dict.fromkeys(BUCKETS, 0.0), "program_startup": 5.0, "checkpoint_restore": 5.0,
                       "productive_training": 28.0, "checkpoint_save": 2.0}
    assert info["buckets"]["productive_training"] == 66.0 and info["goodput"] == round(66 / 230, 6)
    assert any("run #2 ended without a stop record" in n for n in info["notes"])
    assert not any("process_start" in n for n in info["notes"])  # every run's start-up was measured
    # history's table says "unknown" for run 2 (how far it got past step 50 is not known); the
    # goodput counts the 10 steps it knows of and leaves the rest unaccounted
    assert [r.lost_steps for r in interruptions(HAND_WRITTEN, slurm=[])] == [0, None]


def test_without_process_start_the_start_up_is_in_the_wait_unless_slurm_says_when_it_began() -> None:
    ledger = [{k: v for k, v in e.items() if k != "process_start"} for e in HAND_WRITTEN[:8]]
    ledger.append(_ev("stop", 1150.0, reason="done", step=80, committed_step=80))
    info = goodput(ledger, slurm=[])
    _check_sums(info)
    assert info["buckets"]["program_startup"] == 0.0 and info["wall_s"] == 1150.0 - 1010.0
    assert info["rows"][0]["buckets"]["requeue_and_queue_wait"] == 1097.0 - 1043.0
    assert any("process_start" in n for n in info["notes"])
    slurm = [RunRecord(job_id="41", state="REQUEUED", start_s=995.0, end_s=1045.0, time_limit_s=None, source="t"),
             RunRecord(job_id="41", state="COMPLETED", start_s=1080.0, end_s=1151.0, time_limit_s=None, source="t")]
    info = goodput(ledger, slurm=slurm)
    _check_sums(info)
    assert [r["buckets"]["program_startup"] for r in info["rows"]] == [15.0, 17.0]
    assert info["wall_s"] == 1150.0 - 995.0 and info["rows"][0]["buckets"]["requeue_and_queue_wait"] == 1080.0 - 1043.0


def test_criu_runs_count_frozen_dumps_as_save_and_lost_seconds_as_wasted() -> None:
    ledger = [
        _ev("start", 100.0, mode="criu", process_start=98.0, progress_s=0.0),
        _ev("criu_dump", 130.0, periodic=True, dump_s=2.0, progress_s=30.0),
        _ev("signal", 140.0, step=None, deferred_s=50.0, signame="SIGUSR1"),  # a warning: the dump comes later
        _ev("signal", 190.0, step=None, signame=None, cause="time_limit"),
        _ev("criu_dump", 194.0, periodic=False, dump_s=4.0, progress_s=94.0),
        _ev("stop", 195.0, reason="time_limit", step=None, progress_s=94.0),
        _ev("criu_restore", 210.0, process_start=200.0, restore_s=6.0, lost_s=0.0, lost_exact=True),
        _ev("criu_dump", 250.0, periodic=True, dump_s=1.0, progress_s=134.0),
        # killed without a dump; the next restore says 9 s of progress were lost
        _ev("criu_restore", 300.0, process_start=290.0, restore_s=6.0, lost_s=9.0, lost_exact=False),
        _ev("stop", 320.0, reason="done", step=None),
    ]
    info = goodput(ledger, slurm=[])
    _check_sums(info)
    rows = [r["buckets"] for r in info["rows"]]
    assert rows[0] == {**dict.fromkeys(BUCKETS, 0.0), "program_startup": 2.0, "productive_training": 88.0,
                       "checkpoint_save": 7.0, "requeue_and_queue_wait": 5.0}
    assert rows[1] == {**dict.fromkeys(BUCKETS, 0.0), "program_startup": 4.0, "checkpoint_restore": 6.0,
                       "checkpoint_save": 1.0, "wasted_progress": 9.0, "productive_training": 30.0,
                       "unaccounted": 290.0 - 250.0}
    assert rows[2] == {**dict.fromkeys(BUCKETS, 0.0), "program_startup": 4.0, "checkpoint_restore": 6.0,
                       "productive_training": 20.0}
    assert info["wall_s"] == 320.0 - 98.0


def test_damaged_records_never_raise_and_still_sum() -> None:
    odd: list[Any] = [None, "x", "", True, -5, -1e9, 0, math.nan, math.inf, -math.inf, 1e308, 10 ** 400,
                      [], {}, {"step_s": "x"}, {"step_s": -1.0}, {"step_s": 1e300}, [1, 2], 3.5, 7]
    names = ["start", "criu_restore", "commit", "signal", "stop", "requeue", "criu_dump", "rank_failure",
             "skip_corrupt", "fresh_start", "superseded", "nonsense", 5, None]
    keys = ["time", "step", "restore_s", "resumed_from", "process_start", "stall_s", "save_s", "final", "reason",
            "deferred_s", "periodic", "dump_s", "lost_s", "auto", "job_id", "slurm_job_id", "committed_step",
            "lost_step", "reached_step", "mode"]
    rng = random.Random(25)
    for _ in range(300):
        ledger = []
        for i in range(rng.randint(0, 12)):
            ev: dict[str, Any] = {"event": rng.choice(names), "time": 1000.0 + 10 * i}
            for k in rng.sample(keys, rng.randint(0, 6)):
                ev[k] = rng.choice(odd) if rng.random() < 0.7 else 1000.0 + rng.uniform(-50, 150)
            ledger.append(ev)
        _check_sums(goodput(ledger, slurm=[]))
    assert goodput([], slurm=[])["wall_s"] == 0 and goodput([], slurm=[])["goodput"] is None


def test_the_cli_reads_a_hostile_ledger_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with open(tmp_path / LEDGER, "w") as fh:
        fh.write(json.dumps(_ev("start", "yesterday", restore_s=-3, resumed_from="7")) + "\n")
        fh.write("{torn line\n[1, 2]\n")
        fh.write(json.dumps(_ev("commit", 1e300, step=[3], stall_s="x", final="yes")) + "\n")
        fh.write(json.dumps(_ev("stop", 1000.0, reason=None, step={"a": 1})) + "\n")
        fh.write(json.dumps(_ev("start", 900.0, process_start=1e12, restore_s=1e300, resumed_from=10 ** 30)) + "\n")
        fh.write(json.dumps(_ev("commit", 950.0, step=10 ** 30 + 5, stall_s=1e300, auto={"step_s": 1e300})) + "\n")
    assert main(["history", str(tmp_path), "--goodput", "--json"]) == 0
    _check_sums(json.loads(capsys.readouterr().out))
    assert main(["history", str(tmp_path), "--goodput"]) == 0
    assert capsys.readouterr().out.startswith("goodput ")


def test_process_start_time_is_when_this_process_began() -> None:
    began = process_start_time()
    assert began is not None and began <= time.time()
    assert process_start_time(os.getppid()) is not None
    assert process_start_time(2 ** 31) is None  # no such process
