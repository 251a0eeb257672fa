"""``hpcckpt doctor`` for the job's own mode (issues 52, item 4, and 53, item 5).

- A script that keeps its own checkpoints (``hpcckpt run --mode own``, template ``own``) is
  told what it needs: its notice and whether it catches it, the notice's lead against its
  save, GraceTime and KillWait; never the in-process advice (every_steps, HPCCKPT_SIGNALS,
  HPCCKPT_POLL_S) nor CRIU's.
- A trial (``doctor --mode own|criu -- CMD``) has no side effects: the working directory and
  the directories its arguments name are as they were, and no process it started is left.
- CRIU mode: what the command does with TERM, and multi-node refused up front.

Trials need private mount + PID namespaces (root here; a user namespace elsewhere).
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from hpcckpt.cluster import render
from hpcckpt.cluster.env import JobEnv
from hpcckpt.doctor import DoctorContext, build_context, run_checks

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="trials use PID + mount namespaces (root here)")

# A script with its own checkpoints that never imports hpcckpt: appends to train.log, saves
# ckpt.pt every 5 steps (and OUT, when given), resumes from it; on TERM (when it catches it)
# it saves and exits 75. WORKER=1: a child process that takes TERM's default (dies of it).
SCRIPT = textwrap.dedent("""\
    import os, signal, sys, time
    stop = []
    if os.environ.get("CATCH", "1") == "1":
        signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    if os.environ.get("WORKER") == "1" and os.fork() == 0:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        time.sleep(600)
        os._exit(0)
    out = sys.argv[2] if len(sys.argv) > 2 else None
    step = int(open("ckpt.pt").read()) if os.path.exists("ckpt.pt") else 0
    log = open("train.log", "a")
    def save():
        for path in ["ckpt.pt"] + ([out] if out else []):
            with open(path, "w") as f:
                f.write(str(step))
    while True:
        step += 1
        log.write("step %d\\n" % step)
        log.flush()
        if step % 5 == 0:
            save()
        if stop:
            save()
            sys.exit(75)
        time.sleep(0.05)
    """)


def _tree_digest(*dirs: Path) -> dict[str, str]:
    out = {}
    for top in dirs:
        for root, subdirs, files in os.walk(top):
            out[root] = "dir:" + ",".join(sorted(subdirs + files))
            for name in files:
                path = Path(root) / name
                out[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def _alive_with(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return [p for p in found if p != os.getpid()]


def _workdir(tmp_path: Path) -> tuple[Path, Path]:
    work, other = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir()
    other.mkdir()
    (work / "train.py").write_text(SCRIPT)
    (work / "train.log").write_text("step 1\nstep 2\n")  # the real job's log so far
    (work / "ckpt.pt").write_text("2")
    (other / "keep.txt").write_text("unchanged")
    return work, other


def _doctor(args: list[str], cwd: Path, **env: str) -> tuple[int, dict, str]:
    proc = subprocess.run([sys.executable, "-m", "hpcckpt.cli", "doctor", "--no-plugins", "--json", *args],
                          capture_output=True, text=True, timeout=180, cwd=cwd, env={**os.environ, **env},
                          check=False)
    try:
        report = json.loads(proc.stdout)
    except ValueError:
        raise AssertionError(proc.stdout[-3000:] + proc.stderr[-3000:]) from None
    return proc.returncode, report, proc.stdout


def _own_script(tmp_path: Path, **overrides: str) -> str:
    values = {"COMMAND": "python train.py", "TIME": "01:00:00", "LEAD_S": "120", **overrides}
    return render.render("own", values)


IN_PROCESS = ("every_steps", "HPCCKPT_SIGNALS", "hpcckpt listens", "HPCCKPT_POLL_S", "criu dump", "--dump-every",
              "slurmctld may signal")


def _words(results: list) -> str:
    return json.dumps([c.as_dict() for c in results])


# -- own mode, from the script -------------------------------------------------------------------

PARTS = ({"PartitionName": "low", "PreemptMode": "REQUEUE", "GraceTime": "30", "PriorityTier": "1"},
         {"PartitionName": "zero", "PreemptMode": "REQUEUE", "GraceTime": "0", "PriorityTier": "1"},
         {"PartitionName": "high", "PreemptMode": "OFF", "GraceTime": "0", "PriorityTier": "10"})
CONFIG = {"KillWait": "30 sec", "JobRequeue": "1", "SLURM_VERSION": "23.02.7"}


def test_an_own_template_script_gets_the_own_advice_and_nothing_in_process(tmp_path: Path) -> None:
    text = _own_script(tmp_path, NOTICE="USR1")
    ctx = DoctorContext(script_text=text, env=JobEnv(environ={}), slurm_config=CONFIG, partitions=PARTS,
                        save_costs_s=(40.0,))
    assert ctx.run_mode == "own"
    results = run_checks(ctx, plugins=False)
    said = _words(results)
    for word in IN_PROCESS:
        assert word not in said, (word, said)
    names = {c.name: c for c in results}
    assert "USR1" in names["own notice"].detail and "catch" in names["own notice"].detail
    assert "120s before the end" in names["own notice lead"].detail
    assert {"GraceTime low", "GraceTime zero"} <= names.keys()
    assert "Own checkpoints" in names["preemption signal"].detail and "CRIU (" not in names["preemption signal"].detail


def test_the_notice_lead_against_the_scripts_save(tmp_path: Path) -> None:
    text = _own_script(tmp_path)
    (fine,) = [c for c in run_checks(DoctorContext(script_text=text, env=JobEnv(environ={}), save_s=20.0),
                                     plugins=False) if c.name == "own notice lead"]
    assert fine.ok and "20.0s (given (--save-s))" in fine.detail
    (short,) = [c for c in run_checks(DoctorContext(script_text=text, env=JobEnv(environ={}), save_s=60.0),
                                      plugins=False) if c.name == "own notice lead"]
    assert short.severity == "warn" and "LEAD_S=130" in short.fix  # 2 x 60 s + one 10-s read of the end time
    # Measured: how long the command took to exit after a notice, in the run's own records.
    (tmp_path / "ledger.jsonl").write_text(
        json.dumps({"event": "stop", "mode": "own", "reason": "preemption", "exit_code": 75,
                    "exit_after_notice_s": 70.0}) + "\n")
    script = tmp_path / "own.sbatch"
    script.write_text(text)
    ctx = build_context(script=script, ckpt_dir=tmp_path)
    (measured,) = [c for c in run_checks(ctx, plugins=False) if c.name == "own notice lead"]
    assert measured.severity == "warn" and "70.0s (measured" in measured.detail


@pytest.mark.parametrize(("term", "ok"), [("caught", True), ("default", False)])
def test_grace_and_kill_wait_for_a_script_with_its_own_save(term: str, ok: bool) -> None:
    """GraceTime=0: no notice before Slurm's TERM; a script that catches TERM still has KillWait
    (30 s) for a 10-s save, one that dies of TERM has nothing."""
    text = render.render("own", {"COMMAND": "python train.py", "NOTICE": "USR1"})
    ctx = DoctorContext(script_text=text, env=JobEnv(environ={}), slurm_config=CONFIG, partitions=PARTS,
                        save_s=10.0, term_disposition=term)
    (zero,) = [c for c in run_checks(ctx, plugins=False) if c.name == "GraceTime zero"]
    assert zero.ok is ok and "KillWait=30s" in zero.detail
    assert ok or "catch TERM" in zero.fix


def test_own_mode_skips_the_criu_plugin() -> None:
    ctx = DoctorContext(script_text=render.render("own", {"COMMAND": "python train.py"}), env=JobEnv(environ={}))
    assert not [c for c in run_checks(ctx, plugins=True) if c.name.startswith(("criu", "cuda", "pid+mount"))]


# -- CRIU mode: one node ---------------------------------------------------------------------------

@pytest.mark.parametrize("nodes", ["#SBATCH --nodes=2\n", "#SBATCH -N 2\n"])
def test_a_multi_node_criu_script_is_refused(nodes: str) -> None:
    text = f"#!/bin/bash\n{nodes}exec hpcckpt run --mode criu --dir d -- python train.py\n"
    (refused,) = [c for c in run_checks(DoctorContext(script_text=text, env=JobEnv(environ={})), plugins=False)
                  if c.name == "criu one node"]
    assert refused.severity == "fail" and "2 nodes" in refused.detail and "ddp" in refused.fix
    one = DoctorContext(script_text=text.replace("2", "1"), env=JobEnv(environ={}))
    assert not [c for c in run_checks(one, plugins=False) if c.name == "criu one node"]


@needs_root
def test_a_multi_node_criu_trial_is_not_run(tmp_path: Path) -> None:
    work, _ = _workdir(tmp_path)
    before = _tree_digest(work)
    code, report, _ = _doctor(["--mode", "criu", "--trial-s", "3", "--", sys.executable, "train.py"], work,
                              SLURM_NNODES="2", SLURM_JOB_NUM_NODES="2")
    (trial,) = [c for c in report["checks"] if c["name"] == "criu trial"]
    assert code == 1 and trial["level"] == "fail" and "not run" in trial["detail"]
    assert _tree_digest(work) == before


# -- trials: no side effects -------------------------------------------------------------------------

@needs_root
def test_a_criu_trial_leaves_the_working_directory_and_no_process(tmp_path: Path) -> None:
    """Before: the trial ran the command against the real paths (it appended to train.log and
    left checkpoint files the real job's --resume then picked up)."""
    work, other = _workdir(tmp_path)
    marker = f"trial-{uuid.uuid4().hex}"
    before = _tree_digest(work, other)
    code, report, text = _doctor(["--mode", "criu", "--trial-s", "3", "--", sys.executable, "train.py", marker,
                                  str(other / "ckpt-out.pt")], work, WORKER="1")
    assert _tree_digest(work, other) == before, text
    assert not _alive_with(marker)
    checks = {c["name"]: c for c in report["checks"]}
    sandbox = checks["criu trial sandbox"]
    assert sandbox["ok"] and str(work) in sandbox["redirected"] and str(other) in sandbox["redirected"]
    assert sandbox["written"] >= 2  # train.log and the checkpoints went to the scratch overlay
    term = checks["criu trial: TERM"]
    assert term["level"] == "warn" and "catches it" in term["detail"] and "dies of it" in term["detail"]
    assert "exit 75" in term["detail"] and "newest committed image" in term["detail"]
    assert checks["criu trial: stop"]["exit_code"] == 75, text
    assert code == 0


@needs_root
def test_a_criu_trial_of_a_job_that_ignores_term(tmp_path: Path) -> None:
    work, _ = _workdir(tmp_path)
    marker = f"trial-{uuid.uuid4().hex}"
    _, report, text = _doctor(["--mode", "criu", "--trial-s", "3", "--", sys.executable, "train.py", marker], work,
                              CATCH="0")
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["criu trial: TERM"]["ok"] and "ignores TERM" in checks["criu trial: TERM"]["detail"]
    assert "criu trial: stop" not in checks  # nothing hears TERM: nothing to rehearse
    assert not _alive_with(marker)


@needs_root
def test_an_own_trial_names_the_notice_caught_and_times_the_save(tmp_path: Path) -> None:
    work, other = _workdir(tmp_path)
    script = tmp_path / "own.sbatch"
    script.write_text(_own_script(tmp_path))
    marker = f"trial-{uuid.uuid4().hex}"
    before = _tree_digest(work, other)
    code, report, text = _doctor(["--script", str(script), "--mode", "own", "--trial-s", "3", "--", sys.executable,
                                  "train.py", marker, str(other / "ckpt-out.pt")], work)
    assert _tree_digest(work, other) == before, text
    assert not _alive_with(marker)
    checks = {c["name"]: c for c in report["checks"]}
    for word in IN_PROCESS:
        assert word not in text, word
    assert checks["own notice heard"]["ok"] and "catches TERM" in checks["own notice heard"]["detail"]
    assert checks["own notice rehearsal"]["exit_code"] == 75
    assert checks["own notice"]["ok"] and "measured" in checks["own notice lead"]["detail"]
    assert checks["own trial sandbox"]["ok"]
    assert code == 0


@needs_root
def test_an_own_trial_of_a_script_without_a_handler(tmp_path: Path) -> None:
    work, _ = _workdir(tmp_path)
    marker = f"trial-{uuid.uuid4().hex}"
    before = _tree_digest(work)
    _, report, text = _doctor(["--mode", "own", "--notice", "USR1", "--trial-s", "3", "--", sys.executable,
                               "train.py", marker], work, CATCH="0")
    checks = {c["name"]: c for c in report["checks"]}
    heard = checks["own notice heard"]
    assert heard["level"] == "warn" and "no process" in heard["detail"] and "USR1" in heard["detail"]
    assert "own notice rehearsal" not in checks  # the notice is not sent: it would kill the script
    assert checks["own TERM"]["level"] == "warn" and "dies of" in checks["own TERM"]["detail"]
    assert _tree_digest(work) == before and not _alive_with(marker)


@needs_root
def test_a_trial_blocks_slurm_commands_that_act_on_a_job(tmp_path: Path) -> None:
    """A script's own handler may requeue its job (Lightning's auto-requeue does): during a
    trial that would requeue the real one."""
    work, _ = _workdir(tmp_path)
    (work / "requeue.sh").write_text("scontrol requeue 4242; scancel 4242; echo asked >> asked.txt; sleep 60\n")
    _, report, _ = _doctor(["--mode", "own", "--trial-s", "3", "--stop-wait-s", "0", "--", "sh", "requeue.sh"], work)
    (sandbox,) = [c for c in report["checks"] if c["name"] == "own trial sandbox"]
    assert sandbox["slurm_calls"] == ["scontrol requeue 4242", "scancel 4242"]
    assert not (work / "asked.txt").exists()
