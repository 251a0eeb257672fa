"""`hpcckpt doctor` checks on scripts and ledgers (no Slurm needed for these)."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

from hpcckpt.cluster import render
from hpcckpt.cluster.env import JobEnv
from hpcckpt.doctor import (
    Check,
    DoctorContext,
    SignalSpec,
    check_grace_time,
    check_signal_choice,
    check_signal_delivery,
    check_signal_lead,
    plugin_checks,
    sbatch_option,
)


def _ctx(script: str, **kw: object) -> DoctorContext:
    return DoctorContext(script_text=script, env=JobEnv(environ={}), **kw)  # type: ignore[arg-type]


def test_signal_spec_and_options() -> None:
    assert SignalSpec.parse("B:USR2@180") == SignalSpec(name="USR2", lead_s=180, batch_only=True)
    assert SignalSpec.parse("R:SIGUSR1@30") == SignalSpec(name="USR1", lead_s=30, batch_only=False)
    assert SignalSpec.parse("12") == SignalSpec(name="USR2", lead_s=60, batch_only=False)
    script = "#!/bin/bash\n#SBATCH --signal=B:USR2@90\n#SBATCH --requeue\n#SBATCH --output \"a b\"\n"
    assert sbatch_option(script, "signal") == "B:USR2@90"
    assert sbatch_option(script, "requeue") == "" and sbatch_option(script, "no-requeue") is None


def test_templates_pass_delivery_checks() -> None:
    for name in ("single", "ddp"):
        (result,) = check_signal_delivery(_ctx(render.render(name)))
        assert result.ok, result.detail


def test_delivery_mismatches_are_failures_with_a_fix() -> None:
    (no_step,) = check_signal_delivery(_ctx("#SBATCH --signal=USR2@120\npython train.py\n"))
    assert not no_step.ok and "B:USR2@120" in no_step.fix
    (unforwarded,) = check_signal_delivery(_ctx("#SBATCH --signal=B:USR2@120\nsrun python train.py\n"))
    assert not unforwarded.ok and "drop B:" in unforwarded.fix


def test_lead_time_against_measured_save_cost() -> None:
    script = "#SBATCH --signal=B:USR2@90\n"
    (fine,) = check_signal_lead(_ctx(script, save_costs_s=(5.0,)))
    assert fine.ok
    (short,) = check_signal_lead(_ctx(script, save_costs_s=(20.0, 40.0)))
    assert not short.ok and short.severity == "warn" and "B:USR2@140" in short.fix
    (missing,) = check_signal_lead(_ctx("#SBATCH --time=10\n"))
    assert not missing.ok and "--signal=B:USR2" in missing.fix


def test_usr1_clash_and_unhandled_signal(monkeypatch: object) -> None:
    results = check_signal_choice(_ctx("#SBATCH --signal=B:USR1@120\nexport HPCCKPT_SIGNALS=SIGUSR2\n"))
    names = {r.name: r for r in results}
    assert not names["NCCL/USR1"].ok and "USR2" in names["NCCL/USR1"].fix
    assert not names["signal handled"].ok


def test_grace_time_vs_notice_and_save_cost() -> None:
    """A GraceTime preemption must be noticed (one end-time read, HPCCKPT_POLL_S, unless its
    start sends the --signal), then saved (x1.5) and requeued within the grace."""
    parts = ({"PartitionName": "low", "PreemptMode": "REQUEUE", "GraceTime": "10", "PriorityTier": "1"},
             {"PartitionName": "high", "PreemptMode": "OFF", "GraceTime": "0", "PriorityTier": "10"})
    signalled = {"PreemptParameters": "send_user_signal"}
    (low,) = check_grace_time(_ctx("", partitions=parts, save_costs_s=(30.0,), slurm_config=signalled))
    assert not low.ok and "GraceTime>=48" in low.fix and "HPCCKPT_POLL_S" not in low.fix
    (ok,) = check_grace_time(_ctx("", partitions=parts, save_costs_s=(2.0,), slurm_config=signalled))
    assert ok.ok
    # Without the signal a 2 s save still misses a 10 s grace when the end time is read every 15 s...
    (slow,) = check_grace_time(_ctx("", partitions=parts, save_costs_s=(2.0,), slurm_config={}))
    assert not slow.ok and "HPCCKPT_POLL_S=15" in slow.detail and slow.fix.startswith("read the end time more often: "
                                                                                      "HPCCKPT_POLL_S=5 ")
    assert "GraceTime>=21" in slow.fix
    # ... and fits when it is read every 2 s.
    fast = DoctorContext(script_text="", env=JobEnv(environ={"HPCCKPT_POLL_S": "2"}), partitions=parts,
                         save_costs_s=(2.0,), slurm_config={})
    (good,) = check_grace_time(fast)
    assert good.ok and "HPCCKPT_POLL_S=2s" in good.detail
    # CRIU mode reads its own interval from the script.
    criu = "hpcckpt run --mode criu --end-poll-s 1 -- python train.py\n"
    (img,) = check_grace_time(_ctx(criu, partitions=parts, save_costs_s=(2.0,), slurm_config={}))
    assert img.ok and "--end-poll-s=1s" in img.detail


def test_foreign_checks_are_adopted() -> None:
    assert all(isinstance(c, Check) for c in plugin_checks(("hpcckpt.criu.doctor",)))
    (broken,) = plugin_checks(("hpcckpt.no_such_module",))
    assert not broken.ok and broken.severity == "warn"


def test_a_plugin_must_return_the_one_check_type(monkeypatch: pytest.MonkeyPatch) -> None:
    import hpcckpt.criu.doctor

    assert hpcckpt.criu.doctor.Check is Check  # one framework, not a look-alike
    fake = types.ModuleType("fake_doctor_plugin")
    fake.checks = lambda: [Check(name="fine", ok=True, detail="x"), {"name": "dict", "ok": True}]  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fake_doctor_plugin", fake)
    good, odd = plugin_checks(("fake_doctor_plugin",))
    assert good.name == "fine" and not odd.ok and "not an hpcckpt.doctor.Check" in odd.detail


def test_an_invalid_hpcckpt_signals_is_a_failed_check(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HPCCKPT_SIGNALS", "SIGKILL")
    results = check_signal_choice(_ctx("#SBATCH --signal=B:USR2@120\n"))
    (bad,) = [r for r in results if r.name == "HPCCKPT_SIGNALS"]
    assert not bad.ok and "SIGKILL" in bad.detail and "SIGUSR2" in bad.fix


def test_cli_json_reads_save_cost_from_ledger(tmp_path: Path) -> None:
    (tmp_path / "ledger.jsonl").write_text(json.dumps({"event": "commit", "step": 5, "save_s": 70.0}) + "\n")
    script = tmp_path / "job.sbatch"
    script.write_text(render.render("single"))
    proc = subprocess.run([sys.executable, "-m", "hpcckpt.cli", "doctor", "--script", str(script), "--dir",
                           str(tmp_path), "--no-plugins", "--json"], capture_output=True, text=True, check=False)
    report = json.loads(proc.stdout)
    lead = next(c for c in report["checks"] if c["name"] == "signal lead time")
    assert lead["ok"] is False and "measured save cost 70.0s" in lead["detail"]
