"""The job environment table, requeue budgets (persisted across restarts), the local
backend and the interruption history built from a ledger."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from hpcckpt.cluster import EXIT_REQUEUE, Cluster, LocalCluster, SlurmCli, detect
from hpcckpt.cluster.base import Cause
from hpcckpt.cluster.env import JobEnv, staging_root
from hpcckpt.errors import ConfigError
from hpcckpt.lifecycle import requeue
from hpcckpt.lifecycle.budget import BUDGET_FILE, BudgetOptions, charge
from hpcckpt.lifecycle.history import interruptions, summary
from hpcckpt.lifecycle.ledger import Ledger
from hpcckpt.policy import StopReason


def test_env_table_reads_slurm_variables() -> None:
    env = JobEnv(environ={"SLURM_JOB_ID": "41", "SLURM_RESTART_COUNT": "2", "SLURM_PROCID": "3",
                          "SLURM_LOCALID": "1", "SLURM_NTASKS": "4", "SLURM_JOB_NUM_NODES": "2",
                          "SLURM_JOB_NODELIST": "n[1-2]", "SLURMD_NODENAME": "n2",
                          "SLURM_SUBMIT_DIR": "/a b", "SLURM_STEP_ID": "0"})
    assert (env.job_id, env.restart_count, env.global_rank, env.local_rank) == ("41", 2, 3, 1)
    assert (env.world_size, env.num_nodes, env.hostnames) == (4, 2, ["n1", "n2"])
    assert env.node_name == "n2" and env.submit_dir == Path("/a b")
    assert env.in_slurm and env.in_step and not env.is_coordinator


def test_env_outside_slurm_and_arrays() -> None:
    empty = JobEnv(environ={})
    assert (empty.job_id, empty.restart_count, empty.world_size, empty.is_coordinator) == (None, 0, 1, True)
    assert not empty.in_slurm and empty.hostnames == [] and empty.staging_dir() is None
    array = JobEnv(environ={"SLURM_JOB_ID": "101", "SLURM_ARRAY_JOB_ID": "100", "SLURM_ARRAY_TASK_ID": "1"})
    assert array.job_id == "100_1" and array.raw_job_id == "101"
    with pytest.raises(ConfigError, match="SLURM_RESTART_COUNT"):
        _ = JobEnv(environ={"SLURM_RESTART_COUNT": "x"}).restart_count


def test_staging_root_rule(tmp_path: Path) -> None:
    conf = tmp_path / "etc" / "slurm.conf"
    conf.parent.mkdir()
    (conf.parent / "hpcckpt-staging-root").write_text("/stage/%n\n")
    assert staging_root({"SLURM_CONF": str(conf), "SLURMD_NODENAME": "n7"}) == Path("/stage/n7")
    assert staging_root({"HPCCKPT_STAGING_ROOT": "/x", "SLURM_CONF": str(conf)}) == Path("/x")
    assert staging_root({}) == Path("/tmp/hpcckpt-staging")
    root = tmp_path / "stage"
    root.mkdir(mode=0o700)
    env = JobEnv(environ={"SLURM_JOB_ID": "5", "HPCCKPT_STAGING_ROOT": str(root)})
    assert env.staging_dir() is None  # the prolog did not make it
    (root / "job-5").mkdir(mode=0o700)
    assert env.staging_dir() == root / "job-5"


def test_budget_counts_per_cause_and_persists(tmp_path: Path) -> None:
    opts = BudgetOptions(max_preemption=2, max_time_limit=1)
    assert charge(tmp_path, "preemption", attempt="9:0", options=opts).allowed
    # A signal storm in the same run is charged once.
    assert charge(tmp_path, "preemption", attempt="9:0", options=opts).allowed
    assert charge(tmp_path, "maintenance", attempt="9:1", options=opts).allowed  # shares preemption's
    refused = charge(tmp_path, "preemption", attempt="9:2", options=opts)
    assert not refused.allowed and "exhausted (2/2)" in refused.reason
    assert "HPCCKPT_REQUEUE_MAX_PREEMPTION" in refused.reason
    assert charge(tmp_path, "time_limit", attempt="9:2", options=opts).allowed
    saved = json.loads((tmp_path / BUDGET_FILE).read_text())
    assert saved["counts"] == {"preemption": 2, "time_limit": 1}


def test_crash_loop_stops_requeueing(tmp_path: Path) -> None:
    opts = BudgetOptions(max_failure=10, max_failures_without_progress=2)
    assert charge(tmp_path, "failure", attempt="1:0", committed_step=100, options=opts).allowed
    assert charge(tmp_path, "failure", attempt="1:1", committed_step=200, options=opts).allowed
    assert charge(tmp_path, "failure", attempt="1:2", committed_step=200, options=opts).allowed
    stuck = charge(tmp_path, "failure", attempt="1:3", committed_step=200, options=opts)
    assert not stuck.allowed and "crash loop" in stuck.reason and "step 200" in stuck.reason


def test_rank_failures_without_progress_stop_requeueing(tmp_path: Path) -> None:
    """A rank that fails at the same step again and again (a bug on its data) is a crash loop too."""
    opts = BudgetOptions(max_rank_failure=20, max_failures_without_progress=2)
    assert charge(tmp_path, "rank_failure", attempt="2:0", committed_step=50, options=opts).allowed
    assert charge(tmp_path, "rank_fail", attempt="2:1", committed_step=50, options=opts).allowed
    stuck = charge(tmp_path, "rank_failure", attempt="2:2", committed_step=50, options=opts)
    assert not stuck.allowed and "crash loop" in stuck.reason and "step 50" in stuck.reason
    saved = json.loads((tmp_path / BUDGET_FILE).read_text())
    assert saved["counts"] == {"rank_failure": 2}  # its own budget, not preemption's


def test_budget_env_override(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HPCCKPT_REQUEUE_MAX_SIGNAL", "0")
    assert not charge(tmp_path, "signal", attempt="a").allowed
    monkeypatch.setenv("HPCCKPT_REQUEUE_MAX_SIGNAL", "many")
    with pytest.raises(ConfigError, match="HPCCKPT_REQUEUE_MAX_SIGNAL"):
        charge(tmp_path, "signal", attempt="b")


def test_budget_files_are_private(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        charge(tmp_path, "signal", attempt="m:0", options=BudgetOptions())
    finally:
        os.umask(old)
    for name in (BUDGET_FILE, BUDGET_FILE + ".lock"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o600, name


def test_one_exit_requeue_and_stop_reasons_map_to_causes() -> None:
    import hpcckpt.api
    import hpcckpt.criu.supervisor
    import hpcckpt.lifecycle.restart
    from hpcckpt import exitcodes

    assert (hpcckpt.api.EXIT_REQUEUE is hpcckpt.lifecycle.restart.EXIT_REQUEUE is hpcckpt.criu.supervisor.EXIT_REQUEUE
            is EXIT_REQUEUE is exitcodes.EXIT_REQUEUE)
    assert StopReason.DEADLINE.cause is Cause.TIME_LIMIT and StopReason.DRAIN.cause is Cause.MAINTENANCE
    # A Cause reads as its value wherever text is expected (logs, budgets, JSON).
    assert f"{StopReason.SIGNAL.cause}" == "signal" and json.dumps([Cause.PREEMPTION]) == '["preemption"]'


def test_local_backend_requeues_by_exit_status(tmp_path: Path) -> None:
    cluster = LocalCluster(JobEnv(environ={}))
    assert isinstance(cluster, Cluster)
    out = requeue(cluster=cluster, state_dir=tmp_path, cause="signal", committed_step=3, source="test")
    assert out.requeued and out.method == "exit" and out.exit_code == EXIT_REQUEUE == 75
    recorded = [e for e in Ledger(tmp_path).events() if e["event"] == "requeue"]
    assert [(e["requeued"], e["method"], e["source"]) for e in recorded] == [(True, "exit", "test")]
    assert cluster.reservations() == [] and cluster.node_state() == ""


def test_detect_picks_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HPCCKPT_CLUSTER", raising=False)
    assert isinstance(detect(JobEnv(environ={})), LocalCluster)
    monkeypatch.setenv("HPCCKPT_CLUSTER", "slurm-cli")
    assert isinstance(detect(JobEnv(environ={"SLURM_JOB_ID": "3"})), SlurmCli)
    monkeypatch.setenv("HPCCKPT_CLUSTER", "local")
    assert isinstance(detect(JobEnv(environ={"SLURM_JOB_ID": "3"})), LocalCluster)
    monkeypatch.setenv("HPCCKPT_CLUSTER", "slurm")  # a typo must not silently pick a backend
    with pytest.raises(ConfigError, match="HPCCKPT_CLUSTER.*slurm-cli"):
        detect(JobEnv(environ={"SLURM_JOB_ID": "3"}))


def _ev(event: str, t: float, **fields: object) -> dict[str, object]:
    return {"event": event, "time": t, "job_id": "7", **fields}


def test_history_rows_from_a_ledger() -> None:
    ledger = [
        _ev("start", 100.0, restart_count=0, resumed_from=None, restore_s=0.0),
        _ev("commit", 110.0, step=10, save_s=0.5),
        _ev("signal", 120.0, signame="SIGUSR2", step=14, signal_time=119.5),
        _ev("commit", 121.0, step=14, save_s=0.7),
        _ev("stop", 121.5, reason="signal", step=14, committed_step=14),
        _ev("requeue", 121.6, method="scontrol", cause="signal"),
        _ev("start", 140.0, restart_count=1, resumed_from=14, restore_s=0.2),
        _ev("commit", 150.0, step=20, save_s=0.5),
        # killed (node failure): no stop; resumes from the periodic checkpoint at 20
        _ev("signal", 155.0, signame="SIGTERM", step=23, signal_time=155.0),
        _ev("start", 190.0, restart_count=2, resumed_from=20, restore_s=0.3),
        _ev("stop", 200.0, reason="done", step=30, committed_step=30),
    ]
    rows = interruptions(ledger, slurm=[])
    assert len(rows) == 2
    first, second = rows
    assert (first.cause, first.signal, first.step_at_signal, first.committed_step) == ("signal", "SIGUSR2", 14, 14)
    assert (first.lost_steps, first.save_s, first.restore_s) == (0, 0.7, 0.2)
    assert first.queue_wait_s == pytest.approx(18.4)
    # It was killed without a stop: it got past step 23, but how far is unknown (not 3, not 0).
    assert (second.cause, second.lost_steps, second.committed_step) == ("preemption", None, 20)
    assert summary(ledger, rows) == {"interruptions": 2, "finished": True, "lost_steps_total": 0,
                                     "lost_steps_unknown": 1, "lost_s_total": None,
                                     "causes": ["preemption", "signal"]}


def test_history_ignores_a_run_still_going() -> None:
    assert interruptions([_ev("start", 1.0, resumed_from=None)], slurm=[]) == []
