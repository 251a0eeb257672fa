"""``hpcckpt history DIR --plot FILE.png``: the requeue chain as a timeline. The figure's
elements are checked through matplotlib's objects, never its pixels: one training bar per
allocation, each stop labelled with its cause, the queue waits between allocations, goodput
in the title. Whatever the ledger holds, drawing it never raises."""
from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import pytest

from hpcckpt.cli.main import main
from hpcckpt.lifecycle.history import goodput
from hpcckpt.lifecycle.ledger import LEDGER
from hpcckpt.lifecycle.plot import plot


def _ev(event: str, t: float, **fields: Any) -> dict[str, Any]:
    return {"event": event, "time": t, "job_id": "41", "slurm_job_id": "41", "pid": 7, **fields}


# One job in three allocations: preempted (Slurm's TERM, requeue cause preemption), stopped at
# its time limit (the deadline), then done. The second run redoes nothing; the third resumes
# where the second stopped.
THREE = [
    _ev("start", 1010.0, process_start=1000.0, restore_s=0.0, resumed_from=None, restart_count=0),
    _ev("commit", 1500.0, step=100, final=False, save_s=3.0, stall_s=1.0),
    _ev("signal", 1800.0, step=150, signame="SIGTERM"),
    _ev("commit", 1803.0, step=150, final=True, save_s=2.0, stall_s=0.5),
    _ev("stop", 1804.0, reason="signal", step=150, committed_step=150),
    _ev("requeue", 1805.0, method="scontrol", requeued=True, cause="preemption"),
    _ev("start", 2400.0, process_start=2390.0, restore_s=3.0, resumed_from=150, restart_count=1),
    _ev("commit", 2900.0, step=250, final=False, save_s=1.0, stall_s=0.0),
    _ev("signal", 3500.0, step=330, signame="SIGUSR2"),
    _ev("commit", 3503.0, step=330, final=True, save_s=2.0, stall_s=0.5),
    _ev("stop", 3504.0, reason="deadline", step=330, committed_step=330),
    _ev("requeue", 3505.0, method="scontrol", requeued=True, cause="time_limit"),
    _ev("start", 3700.0, process_start=3690.0, restore_s=4.0, resumed_from=330, restart_count=2),
    _ev("commit", 4200.0, step=420, final=True, save_s=1.0, stall_s=0.2),
    _ev("stop", 4201.0, reason="done", step=420, committed_step=420),
]


def _by_gid(fig: Any, prefix: str) -> dict[str, Any]:
    ax = fig.axes[0]
    found = {a.get_gid(): a for a in [*ax.collections, *ax.texts] if (a.get_gid() or "").startswith(prefix)}
    return dict(sorted(found.items()))


def test_three_allocations_with_their_causes_waits_and_goodput(tmp_path: Path) -> None:
    out = tmp_path / "job.png"
    fig = plot(THREE, out, slurm=[])
    assert out.stat().st_size > 10_000 and out.read_bytes()[:4] == b"\x89PNG"
    bars = _by_gid(fig, "allocation-")
    assert list(bars) == ["allocation-1", "allocation-2", "allocation-3"]
    # each training bar starts where its run began training and ends at its stop (minutes here)
    spans = [tuple(b.get_paths()[0].vertices[:, 0].round(3)[[0, 2]]) for b in bars.values()]
    assert spans[0][0] < spans[0][1] <= spans[1][0] < spans[1][1] <= spans[2][0] < spans[2][1]
    causes = [t.get_text() for t in _by_gid(fig, "cause-").values()]
    assert causes == ["preemption", "time_limit", "done"]
    assert list(_by_gid(fig, "wait-")) == ["wait-1", "wait-2"]  # two queue waits between three allocations
    share = f"{100 * goodput(THREE, slurm=[])['goodput']:.1f}%"
    assert f"goodput {share}" in fig.get_suptitle() and "3 allocation(s)" in fig.get_suptitle()
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert labels == ["#3 job 41", "#2 job 41", "#1 job 41"]  # the first allocation on top
    assert fig.axes[0].get_xlabel().startswith("minutes")


def test_work_done_again_and_a_vanished_run_are_drawn(tmp_path: Path) -> None:
    # run 2 is killed without a stop after its commit of step 250; run 3 finds that checkpoint
    # damaged and resumes from step 150: 100 steps are trained again
    ledger = [e for e in THREE if e["time"] not in (3500.0, 3503.0, 3504.0, 3505.0)]
    ledger = [{**e, "resumed_from": 150} if e["time"] == 3700.0 else e for e in ledger]
    fig = plot(ledger, tmp_path / "job.svg", slurm=[])
    assert (tmp_path / "job.svg").read_text().lstrip().startswith("<?xml")
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert "100 step(s) lost" in texts and "resumed from step 150" in texts
    causes = [t.get_text() for t in _by_gid(fig, "cause-").values()]
    assert len(causes) == 3 and causes[0] == "preemption" and causes[2] == "done"
    assert len(_by_gid(fig, "allocation-")) == 3


def test_the_cli_writes_the_plot_and_still_prints_the_table(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    ckdir = tmp_path / "ckpt"
    ckdir.mkdir()
    (ckdir / LEDGER).write_text("".join(json.dumps(e) + "\n" for e in THREE))
    png = tmp_path / "job.png"
    assert main(["history", str(ckdir), "--plot", str(png)]) == 0
    captured = capsys.readouterr()
    assert png.stat().st_size > 0 and f"wrote {png}" in captured.err
    assert "2 interruption(s)" in captured.out
    assert main(["history", str(ckdir), "--plot", str(tmp_path / "job.txt")]) == 2
    assert ".png, .svg or .pdf" in capsys.readouterr().err
    assert main(["history", str(ckdir), "--plot", str(tmp_path / "no" / "job.png")]) == 2


def test_any_ledger_is_drawn_without_raising() -> None:
    odd: list[Any] = [None, "x", True, -5, 0, math.nan, math.inf, 1e308, [], {}, 3.5]
    names = ["start", "criu_restore", "commit", "signal", "stop", "requeue", "criu_dump", "rank_failure",
             "skip_corrupt", "superseded", "nonsense"]
    keys = ["time", "step", "restore_s", "resumed_from", "process_start", "stall_s", "save_s", "final", "reason",
            "deferred_s", "periodic", "dump_s", "lost_s", "committed_step", "mode", "cause", "requeued"]
    rng = random.Random(56)
    import matplotlib
    matplotlib.use("Agg")
    for _ in range(25):
        ledger = []
        for i in range(rng.randint(0, 10)):
            ev: dict[str, Any] = {"event": rng.choice(names), "time": 1000.0 + 10 * i}
            for k in rng.sample(keys, rng.randint(0, 6)):
                ev[k] = rng.choice(odd) if rng.random() < 0.6 else 1000.0 + rng.uniform(-50, 150)
            ledger.append(ev)
        fig = plot(ledger, slurm=[])
        assert fig.axes
