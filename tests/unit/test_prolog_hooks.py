"""slurm/prolog and slurm/epilog run as Slurm runs them (environment only), with hostile
job names and paths. `scontrol` is replaced by a script printing a captured-format
job line: the hooks' parsing of it is what is under test."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PROLOG, EPILOG = REPO / "slurm" / "prolog", REPO / "slurm" / "epilog"
HOSTILE_NAME = 'evil "name"; rm -rf / $(touch pwned) `x`\nline2\ttab \\ UserId=fake'
HOSTILE_DIR = "we ird;\"dir'$(touch pwned)\nx"


def _fake_scontrol(bin_dir: Path, name: str, state: str) -> None:
    bin_dir.mkdir(exist_ok=True)
    line = (f"JobId=123 JobName={name} UserId=root(0) GroupId=root(0) MCS_label=N/A JobState={state} "
            "Reason=None Dependency=(null) Requeue=1 Restarts=1")
    script = bin_dir / "scontrol"
    script.write_text("#!/bin/bash\ncat <<'EOF_JOB'\n" + line + "\nEOF_JOB\n")
    script.chmod(0o755)


def _run(hook: Path | str, tmp: Path, root: Path, job_id: str = "123",
         state: str = "RUNNING") -> subprocess.CompletedProcess[str]:
    """Run a hook script, or with hook="prolog"/"epilog" the `hpcckpt` verb of that name."""
    bin_dir = tmp / "bin"
    _fake_scontrol(bin_dir, HOSTILE_NAME, state)
    work = tmp / HOSTILE_DIR
    work.mkdir(exist_ok=True)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": job_id, "SLURM_JOB_UID": str(os.getuid()),
           "SLURM_JOB_GID": str(os.getgid()), "SLURMD_NODENAME": "n1", "SLURM_JOB_RESTART_COUNT": "1",
           "SLURM_JOB_WORK_DIR": str(work), "SLURM_JOB_EXIT_CODE2": "0:15",
           "HPCCKPT_STAGING_ROOT": str(root)}
    if isinstance(hook, str):
        env["PYTHONPATH"] = str(REPO)
        cmd = [sys.executable, "-m", "hpcckpt.cli", hook, "--json"]
    else:
        cmd = [str(hook)]
    return subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True, timeout=60, check=False)


def _records(root: Path) -> list[dict[str, str]]:
    return [json.loads(line) for line in (root / "hooks.jsonl").read_text().splitlines()]


def test_prolog_prepares_staging_and_epilog_records_and_cleans(tmp_path: Path) -> None:
    root = tmp_path / "stage root; $x"
    assert _run(PROLOG, tmp_path, root).returncode == 0
    staging = root / "job-123"
    assert staging.is_dir() and stat.S_IMODE(staging.stat().st_mode) == 0o700
    (staging / "data.bin").write_bytes(b"x" * 10)

    assert _run(EPILOG, tmp_path, root, state="PENDING").returncode == 0
    assert not staging.exists()
    prolog, epilog = _records(root)
    assert prolog["event"] == "prolog" and prolog["staging"] == str(staging)
    assert prolog["job_name"] == epilog["job_name"] == HOSTILE_NAME
    assert epilog["work_dir"] == str(tmp_path / HOSTILE_DIR)
    assert (epilog["job_state"], epilog["exit_code"], epilog["restart_count"]) == ("PENDING", "0:15", "1")
    assert not list(tmp_path.rglob("pwned")), "a job name or path was evaluated by the shell"


def test_cli_verbs_find_and_run_the_hooks(tmp_path: Path) -> None:
    for name, script in (("prolog", PROLOG), ("epilog", EPILOG)):
        out = subprocess.run([sys.executable, "-m", "hpcckpt.cli", name, "--path", "--json"], cwd=tmp_path,
                             capture_output=True, text=True, timeout=60, check=True, env={**os.environ,
                                                                                          "PYTHONPATH": str(REPO)})
        assert Path(json.loads(out.stdout)["script"]).resolve() == script.resolve()
    root = tmp_path / "stage"
    ran = _run("prolog", tmp_path, root)
    assert ran.returncode == 0 and json.loads(ran.stdout)["returncode"] == 0, ran.stderr
    assert (root / "job-123").is_dir()
    ran = _run("epilog", tmp_path, root, state="PREEMPTED")
    assert ran.returncode == 0, ran.stderr
    assert not (root / "job-123").exists() and [r["event"] for r in _records(root)] == ["prolog", "epilog"]
    # an unusable staging root: the verb passes the hook's failure on
    blocker = tmp_path / "file-not-dir"
    blocker.write_text("x")
    assert _run("prolog", tmp_path, blocker).returncode != 0


def test_epilog_never_follows_a_symlinked_staging_dir(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_text("precious")
    (root / "job-123").symlink_to(victim)
    assert _run(EPILOG, tmp_path, root).returncode == 0
    assert (victim / "keep").read_text() == "precious"
    assert not (root / "job-123").exists()


def test_prolog_fails_only_when_staging_root_is_unusable(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    failed = _run(PROLOG, tmp_path, blocker)
    assert failed.returncode == 1 and "HPCCKPT_STAGING_ROOT" in failed.stderr
    assert _run(PROLOG, tmp_path, tmp_path / "r", job_id="../../etc").returncode == 0
    assert not (tmp_path / "r").exists()


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed (slurm/install-deps)")
def test_slurm_scripts_are_shellcheck_clean() -> None:
    scripts = [REPO / "slurm" / n for n in ("prolog", "epilog", "hooks-lib.sh", "localcluster", "install-deps")]
    proc = subprocess.run(["shellcheck", "-x", *map(str, scripts)], capture_output=True, text=True,
                          cwd=REPO, check=False)
    assert proc.returncode == 0, proc.stdout
