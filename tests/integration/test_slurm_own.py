"""Scripts that keep their own checkpoints, under `hpcckpt template own` (real Slurm): they
never import hpcckpt. One saves on the notice (TERM) and exits 75; one ignores it and saves
every 50 steps. Preempted and stopped by 1-minute time limits, both end COMPLETED; the first
is bit-identical with nothing lost, its save (5.5 s) longer than the local KillWait (5 s);
the second comes back from its own last save each time; `history` counts every stop with
Slurm's cause and what it lost."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from conftest import SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

OWN = Path(__file__).with_name("own_save_train.py")
STEPS = 1000


# Two preemptions, then more training than one 1-minute allocation holds (Slurm enforces the
# limit 55-85 s in: 560-850 steps here), so that a time limit stops it too.
STEPS_IGNORING = 1300


def _args(run_dir: str, *extra: str, steps: int = STEPS) -> list[str]:
    return ["--steps", str(steps), "--dir", f"{run_dir}/own", "--out", f"{run_dir}/result.json", *extra]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], dict]:
    made: dict[int, dict] = {}

    def result(steps: int) -> dict:
        if steps not in made:
            d = tmp_path_factory.mktemp(f"own-slurm-reference-{steps}")
            subprocess.run([sys.executable, str(OWN), *_args(str(d), "--every", "100000", steps=steps)], check=True,
                           stdout=subprocess.DEVNULL, timeout=600)
            made[steps] = dict(json.loads((d / "result.json").read_text()))
        return made[steps]
    return result


def _submit(cluster: SlurmCluster, run_dir: Path, *script_args: str, steps: int = STEPS) -> tuple[str, Path]:
    run_dir.mkdir(parents=True, exist_ok=True)
    command = " ".join([sys.executable, str(OWN), *_args('"$HPCCKPT_RUN_DIR"', *script_args, steps=steps)])
    script = cluster.render("own", run_dir / "own.sbatch", TIME="1", LEAD_S="20", RUN_DIR=str(run_dir),
                            OUTPUT=f"{run_dir}/slurm-%j.out", COMMAND=command, NOTICE="TERM",
                            SAVES="$HPCCKPT_RUN_DIR/own/ckpt-*.pt", JOB_NAME="hpcckpt-own")
    job = cluster.sbatch(script, "-p", "low", "--exclusive")
    return job, run_dir / f"slurm-{job}.out"


def _runs(out: Path, job: str) -> list[str]:
    """The job's output, one piece per allocation."""
    text = out.read_text(errors="replace") if out.exists() else ""
    return re.split(rf"^hpcckpt: job {job} run \d+ ", text, flags=re.M)[1:]


def _last_step(piece: str) -> int:
    steps = [int(m) for m in re.findall(r"^step (\d+) ", piece, flags=re.M)]
    return max(steps, default=0)


def _preempt_in_run(cluster: SlurmCluster, out: Path, job: str, run: int, steps: int) -> None:
    def far_enough() -> bool:
        runs = _runs(out, job)
        if len(runs) <= run:
            return False
        first = re.search(r"^step (\d+) ", runs[run], flags=re.M)
        return first is not None and _last_step(runs[run]) >= int(first.group(1)) + steps

    cluster.wait_until(far_enough, 300, f"job {job} run {run} to train {steps} steps")
    high = cluster.preempt()
    cluster.wait_for(high, {"RUNNING", "COMPLETING", "COMPLETED"}, 240)


def _own_stops(run_dir: Path) -> list[dict]:
    return [e for e in SlurmClusterLedger.read(run_dir) if e["event"] == "stop" and e.get("mode") == "own"]


class SlurmClusterLedger:
    @staticmethod
    def read(run_dir: Path) -> list[dict]:
        path = run_dir / "hpcckpt" / "ledger.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


@pytest.mark.long(300)
def test_a_script_saving_on_the_notice_loses_nothing(slurm_cluster: SlurmCluster, tmp_path: Path,
                                                     reference: Callable[[int], dict]) -> None:
    run_dir = tmp_path / "run"
    job, out = _submit(slurm_cluster, run_dir, "--every", "100000", "--step-sleep-s", "0.1", "--save-sleep-s", "5.5")
    try:
        _preempt_in_run(slurm_cluster, out, job, 0, 10)
        _preempt_in_run(slurm_cluster, out, job, 1, 10)
        slurm_cluster.wait_completed(job, 900, out)
    finally:
        slurm_cluster.cancel(job)
    assert json.loads((run_dir / "result.json").read_text()) == reference(STEPS), "not bit-identical"
    runs = _runs(out, job)
    # each allocation resumed exactly where the one before saved: no step trained twice
    starts = [int(m.group(1)) for r in runs[1:] if (m := re.search(r"resumed from ckpt-\d+\.pt at step (\d+)", r))]
    ends = [_last_step(r) for r in runs[:-1]]
    assert starts == ends, (starts, ends)
    stops = [s for s in _own_stops(run_dir) if s["reason"] != "done"]
    causes = [s["reason"] for s in stops]
    assert causes[:2] == ["preemption", "preemption"] and causes.count("time_limit") >= 2, causes
    # Saved on the notice: what the next allocation trains again began after the notice (the
    # file's ctime comes from the kernel's coarse clock, up to a tick behind time.time()).
    assert all(s["exit_code"] == 75 and s["lost_s"] is not None and s["exit_after_notice_s"] is not None
               and s["lost_s"] <= s["exit_after_notice_s"] + 0.05 for s in stops), stops
    history = slurm_cluster.history(run_dir / "hpcckpt")
    assert history["finished"] is True
    assert [r["cause"] for r in history["rows"]] == causes, history["rows"]
    assert int(slurm_cluster.job(job)["Restarts"]) == len(stops)
    goodput = slurm_cluster.hpcckpt("history", str(run_dir / "hpcckpt"), "--goodput", "--json")
    assert goodput.returncode == 0, goodput.stderr
    rows = json.loads(goodput.stdout)["rows"]
    assert [r["ended"] for r in rows] == [*causes, "done"], rows


@pytest.mark.long(240)
def test_a_script_ignoring_the_notice_comes_back_from_its_own_saves(slurm_cluster: SlurmCluster, tmp_path: Path,
                                                                    reference: Callable[[int], dict]) -> None:
    run_dir = tmp_path / "run"
    job, out = _submit(slurm_cluster, run_dir, "--ignore-term", "--every", "50", "--step-sleep-s", "0.1",
                       steps=STEPS_IGNORING)
    try:
        _preempt_in_run(slurm_cluster, out, job, 0, 70)
        _preempt_in_run(slurm_cluster, out, job, 1, 70)
        slurm_cluster.wait_completed(job, 900, out)
    finally:
        slurm_cluster.cancel(job)
    assert json.loads((run_dir / "result.json").read_text()) == reference(STEPS_IGNORING), "not bit-identical"
    runs = _runs(out, job)
    assert len(runs) >= 4, "two preemptions and a time limit"
    for piece in runs[1:]:
        assert re.search(r"resumed from ckpt-\d+\.pt", piece), piece[:500]
    stops = [s for s in _own_stops(run_dir) if s["reason"] != "done"]
    reasons = [s["reason"] for s in stops]  # a loaded machine may need another 1-minute allocation
    assert reasons[:2] == ["preemption", "preemption"] and reasons[2:] == ["time_limit"] * (len(reasons) - 2) \
        and len(reasons) >= 3, stops
    assert all(s["lost_s"] is not None and s["lost_s"] > 0 for s in stops), stops
    history = slurm_cluster.history(run_dir / "hpcckpt")
    assert history["finished"] is True and history["lost_s_total"] and history["lost_s_total"] > 0, history
    assert [r["cause"] for r in history["rows"]] == [s["reason"] for s in stops], history["rows"]
