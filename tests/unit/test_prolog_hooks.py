"""slurm/prolog and slurm/epilog run as Slurm runs them (environment only), with hostile
job names and paths, and with staging roots and files a user planted (they run as
root: a planted file must never redirect a write, nor fail the hook, which would
drain the node). `scontrol` is replaced by a script printing a captured-format job
line: the hooks' parsing of it is what is under test."""

from __future__ import annotations

import json
import os
import shlex
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


def _fake_scontrol(bin_dir: Path, name: str | bytes, state: str, config: str = "") -> None:
    bin_dir.mkdir(exist_ok=True)
    raw = name if isinstance(name, bytes) else name.encode()
    line = (b"JobId=123 JobName=" + raw + b" UserId=root(0) GroupId=root(0) MCS_label=N/A JobState="
            + state.encode() + b" Reason=None Dependency=(null) Requeue=1 Restarts=1")
    script = bin_dir / "scontrol"
    script.write_bytes(b"#!/bin/bash\nif [ \"$2\" = config ]; then\ncat <<'EOF_CONF'\n" + config.encode()
                       + b"\nEOF_CONF\nexit 0\nfi\ncat <<'EOF_JOB'\n" + line + b"\nEOF_JOB\n")
    script.chmod(0o755)


def _run(hook: Path | str, tmp: Path, root: Path, job_id: str = "123", state: str = "RUNNING",
         name: str | bytes = HOSTILE_NAME, env_changes: dict[str, str | None] | None = None,
         config: str = "") -> subprocess.CompletedProcess[str]:
    """Run a hook script, or with hook="prolog"/"epilog" the `hpcckpt` verb of that name.
    ``env_changes``: variables to set (a value) or to leave out (None); ``config``: what
    `scontrol show config` prints."""
    bin_dir = tmp / "bin"
    _fake_scontrol(bin_dir, name, state, config)
    work = tmp / HOSTILE_DIR
    work.mkdir(exist_ok=True)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": job_id, "SLURM_JOB_UID": str(os.getuid()),
           "SLURM_JOB_GID": str(os.getgid()), "SLURMD_NODENAME": "n1", "SLURM_JOB_RESTART_COUNT": "1",
           "SLURM_JOB_WORK_DIR": str(work), "SLURM_JOB_EXIT_CODE2": "0:15",
           "HPCCKPT_STAGING_ROOT": str(root)}
    for key, value in (env_changes or {}).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    if isinstance(hook, str):
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
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
                             "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])})
        assert Path(json.loads(out.stdout)["script"]).resolve() == script.resolve()
    root = tmp_path / "stage"
    ran = _run("prolog", tmp_path, root)
    assert ran.returncode == 0 and json.loads(ran.stdout)["returncode"] == 0, ran.stderr
    assert (root / "job-123").is_dir()
    ran = _run("epilog", tmp_path, root, state="PREEMPTED")
    assert ran.returncode == 0, ran.stderr
    assert not (root / "job-123").exists() and [r["event"] for r in _records(root)] == ["prolog", "epilog"]
    # an unusable staging root: logged, and the node is not drained over it
    blocker = tmp_path / "file-not-dir"
    blocker.write_text("x")
    ran = _run("prolog", tmp_path, blocker)
    assert ran.returncode == 0 and "refusing staging root" in ran.stderr, ran.stderr


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


def test_prolog_never_fails_over_an_unusable_staging_root(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    ran = _run(PROLOG, tmp_path, blocker)
    assert ran.returncode == 0 and "refusing staging root" in ran.stderr and "HPCCKPT_STAGING_ROOT" in ran.stderr
    assert blocker.read_text() == ""
    assert _run(PROLOG, tmp_path, tmp_path / "r", job_id="../../etc").returncode == 0
    assert not (tmp_path / "r").exists()


def _refused(tmp_path: Path, root: Path) -> None:
    """Both hooks exit 0, say why, and write nothing into ``root``."""
    before = sorted(p.name for p in root.iterdir())
    for hook in (PROLOG, EPILOG):
        ran = _run(hook, tmp_path, root)
        assert ran.returncode == 0 and "refusing staging root" in ran.stderr, (hook, ran.stderr)
    assert sorted(p.name for p in root.iterdir()) == before


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root (the hooks run as root)")
def test_a_root_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "planted"
    root.mkdir(mode=0o755)
    os.chown(root, 65534, 65534)  # nobody pre-created the default /tmp/hpcckpt-staging
    _refused(tmp_path, root)


def test_a_root_others_can_write_is_refused_unless_sticky(tmp_path: Path) -> None:
    open_root = tmp_path / "open"
    open_root.mkdir()
    open_root.chmod(0o777)
    _refused(tmp_path, open_root)
    assert stat.S_IMODE(open_root.stat().st_mode) == 0o777

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)  # a shared scratch like /tmp: used, and its mode left alone
    assert _run(PROLOG, tmp_path, shared).returncode == 0
    assert stat.S_IMODE(shared.stat().st_mode) == 0o1777
    assert (shared / "job-123").is_dir() and _records(shared)[0]["event"] == "prolog"


def test_records_never_go_through_a_planted_symlink(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    victim = tmp_path / "root-only"
    victim.write_text("secret\n")
    victim.chmod(0o600)
    (root / "hooks.jsonl").symlink_to(victim)
    for hook in (PROLOG, EPILOG):
        ran = _run(hook, tmp_path, root)
        assert ran.returncode == 0 and "not writing to" in ran.stderr, ran.stderr
    assert victim.read_text() == "secret\n"
    assert (root / "hooks.jsonl").is_symlink()


def test_records_skip_a_planted_file_or_directory(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (root / "hooks.jsonl").mkdir()
    ran = _run(PROLOG, tmp_path, root)
    assert ran.returncode == 0 and "not a regular file" in ran.stderr
    assert (root / "job-123").is_dir(), "a planted record file must not cost the job its staging"
    (root / "hooks.jsonl").rmdir()
    (root / "hooks.jsonl").write_text("")
    os.link(root / "hooks.jsonl", tmp_path / "second-link")
    ran = _run(EPILOG, tmp_path, root)
    assert ran.returncode == 0 and "2 link(s)" in ran.stderr, ran.stderr
    assert (tmp_path / "second-link").read_text() == ""


def test_record_file_is_private_and_staging_of_another_user_is_left_alone(tmp_path: Path) -> None:
    root = tmp_path / "root"
    assert _run(PROLOG, tmp_path, root).returncode == 0
    assert stat.S_IMODE((root / "hooks.jsonl").stat().st_mode) == 0o600
    assert stat.S_IMODE(root.stat().st_mode) == 0o755
    # A job-<id> entry that is not the job user's directory: logged, not taken over.
    (root / "job-124").write_text("planted")
    ran = _run(PROLOG, tmp_path, root, job_id="124")
    assert ran.returncode == 0 and "runs without staging" in ran.stderr
    assert (root / "job-124").read_text() == "planted"
    assert _records(root)[-1]["staging"] == ""


@pytest.mark.parametrize("name", [b"caf\xe9 \xff\xfe latin-1", "caf\u00e9 \u65e5\u672c".encode()])
def test_job_names_of_any_bytes_give_valid_json(tmp_path: Path, name: bytes) -> None:
    root = tmp_path / "root"
    for hook in (PROLOG, EPILOG):
        assert _run(hook, tmp_path, root, name=name).returncode == 0
    lines = (root / "hooks.jsonl").read_bytes().splitlines()
    names = [json.loads(line.decode("utf-8"))["job_name"] for line in lines]  # strict UTF-8, valid JSON
    expected = name.decode("utf-8") if name.startswith(b"caf\xc3") else name.decode("latin-1")
    assert names == [expected, expected]


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed (slurm/install-deps)")
def test_slurm_scripts_are_shellcheck_clean() -> None:
    scripts = [REPO / "slurm" / n for n in ("prolog", "epilog", "hooks-lib.sh", "localcluster", "install-deps")]
    proc = subprocess.run(["shellcheck", "-x", *map(str, scripts)], capture_output=True, text=True,
                          cwd=REPO, check=False)
    assert proc.returncode == 0, proc.stdout


def test_prolog_checks_every_parent_before_creating_the_root(tmp_path: Path) -> None:
    """A symlink in a missing parent of the root is refused before root creates anything
    (``mkdir -p`` would have created directories at the link's target)."""
    target = tmp_path / "elsewhere"
    target.mkdir()
    (tmp_path / "shared").symlink_to(target)
    ran = _run(PROLOG, tmp_path, tmp_path / "shared" / "sub" / "stage")
    assert ran.returncode == 0 and "refusing staging root" in ran.stderr and "symbolic link" in ran.stderr
    assert list(target.iterdir()) == []
    made = tmp_path / "new" / "deeper" / "stage"  # missing parents of a safe path are made, 0755
    assert _run(PROLOG, tmp_path, made).returncode == 0
    assert (made / "job-123").is_dir() and stat.S_IMODE((tmp_path / "new").stat().st_mode) == 0o755


def test_a_fifo_record_file_never_blocks_a_hook(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    os.mkfifo(root / "hooks.jsonl")
    for hook in (PROLOG, EPILOG):  # no reader: a blocking open would wait for ever
        ran = _run(hook, tmp_path, root)
        assert ran.returncode == 0 and "not a regular file" in ran.stderr, ran.stderr
    assert stat.S_ISFIFO(os.lstat(root / "hooks.jsonl").st_mode)


def test_staging_dir_is_told_only_when_the_prolog_made_it(tmp_path: Path) -> None:
    from hpcckpt.cluster.env import JobEnv
    root = tmp_path / "root"
    env = JobEnv(environ={"SLURM_JOB_ID": "123", "HPCCKPT_STAGING_ROOT": str(root)})
    assert env.staging_dir() is None  # no prolog ran
    assert _run(PROLOG, tmp_path, root).returncode == 0
    assert env.staging_dir() == root / "job-123"
    (root / "job-123").chmod(0o777)  # open to everybody: the prolog would refuse to reuse it
    assert env.staging_dir() is None
    ran = _run(PROLOG, tmp_path, root)
    assert "runs without staging" in ran.stderr and _records(root)[-1]["staging"] == ""
    (root / "job-123").rmdir()
    (root / "job-123").symlink_to(tmp_path)
    assert env.staging_dir() is None


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root (the hooks run as root)")
def test_staging_planted_by_another_user_is_not_told(tmp_path: Path) -> None:
    from hpcckpt.cluster.env import JobEnv
    root = tmp_path / "root"
    root.mkdir()
    root.chmod(0o1777)
    planted = root / "job-123"
    planted.mkdir(mode=0o700)
    os.chown(planted, 65534, 65534)
    ran = _run(PROLOG, tmp_path, root)
    assert "runs without staging" in ran.stderr
    assert JobEnv(environ={"SLURM_JOB_ID": "123", "HPCCKPT_STAGING_ROOT": str(root)}).staging_dir() is None


def test_doctor_reports_protected_symlinks(tmp_path: Path) -> None:
    from hpcckpt.doctor import protected_symlinks
    for name, value in (("protected_symlinks", "0"), ("protected_regular", "2"), ("protected_fifos", "1")):
        (tmp_path / name).write_text(value + "\n")
    (check,) = protected_symlinks(None, tmp_path)  # type: ignore[arg-type]
    assert check.severity == "warn" and "fs.protected_symlinks=0" in check.detail and "sysctl" in check.fix
    (tmp_path / "protected_symlinks").write_text("1\n")
    (check,) = protected_symlinks(None, tmp_path)  # type: ignore[arg-type]
    assert check.ok and check.data["sysctl"]["protected_regular"] == "2"


# --- the scavenge (issue 25, item 3): node-local checkpoints the shared level lacks ---

def _fake_python(path: Path, record: Path) -> Path:
    """A "python" that records who ran it with what, and answers like the verb."""
    path.write_text(f'#!/bin/sh\necho "$(id -u) $*" >> {shlex.quote(str(record))}\necho "committed: (fake)"\n')
    path.chmod(0o755)
    return path


def _pointed_root(staging: Path, key: str, python: Path, shared: Path) -> Path:
    root = staging / "levels" / key
    root.mkdir(parents=True)
    (root / ".hpcckpt-level.json").write_text(json.dumps({"shared": str(shared), "python": str(python)}))
    return root


@pytest.mark.native
def test_epilog_scavenges_a_node_local_checkpoint_the_shared_level_lacks(tmp_path: Path) -> None:
    """Node-local every step, shared every 5, killed after step 9 (its shared copy never made):
    the epilog commits node-local step 9 to the shared level, then removes the staging."""
    from hpcckpt.api import Checkpointer
    from hpcckpt.store import catalog
    from tests.helpers import tiny_state, train_step
    root = tmp_path / "stage"
    assert _run(PROLOG, tmp_path, root).returncode == 0
    staging, shared = root / "job-123", tmp_path / "shared ckpt" / "run"
    objs = tiny_state(0)
    with Checkpointer(shared, every_steps=5, local_every_steps=1, local_dir=str(staging / "levels")) as ck:
        ck.register(**objs)
        for _ in ck.steps(9):
            train_step(objs)
    shutil.rmtree(shared / "step-9", ignore_errors=True)  # the kill came before the shared level had it
    assert [i.step for i in catalog.committed_newest_first(shared)][:1] == [5]
    (local,) = (staging / "levels").iterdir()
    assert [i.step for i in catalog.committed_newest_first(local)][:1] == [9]

    ran = _run(EPILOG, tmp_path, root, state="PREEMPTED")
    assert ran.returncode == 0, ran.stderr
    (line,) = [x for x in ran.stderr.splitlines() if "scavenge" in x]
    assert f"job 123: scavenge {local}: committed: committed node-local step 9" in line and "(exit 0)" in line, line
    assert [i.step for i in catalog.committed_newest_first(shared)][:1] == [9]
    full = catalog.inspect_step(shared, 9, full=True)
    assert full is not None and full.status == "committed" and not full.problems
    assert not staging.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="running as another user needs root (the hooks run as root)")
def test_epilog_scavenges_as_the_jobs_user_never_as_root(tmp_path: Path) -> None:
    import tempfile
    base = Path(tempfile.mkdtemp(prefix="hpcckpt-scavenge-", dir="/tmp"))  # pytest's tmp is root's alone
    try:
        base.chmod(0o755)
        root, out = base / "stage", base / "out"
        out.mkdir(mode=0o777)
        out.chmod(0o777)
        nobody = {"SLURM_JOB_UID": "65534", "SLURM_JOB_GID": "65534"}
        assert _run(PROLOG, tmp_path, root, env_changes=nobody).returncode == 0
        staging = root / "job-123"
        assert staging.stat().st_uid == 65534
        record = out / "ran"
        python = _fake_python(base / "python", record)
        mine = _pointed_root(staging, "a" * 16, python, base / "shared")
        # A root-only directory the user points at: read, if ever, with the user's rights only.
        secret = base / "root-only"
        secret.mkdir(mode=0o700)
        _pointed_root(secret, "b" * 16, python, base / "shared")
        (staging / "levels" / ("b" * 16)).symlink_to(secret / "levels" / ("b" * 16))
        for dirpath, dirs, files in os.walk(staging):
            for name in [dirpath, *(os.path.join(dirpath, n) for n in dirs + files)]:
                os.chown(name, 65534, 65534, follow_symlinks=False)

        ran = _run(EPILOG, tmp_path, root, env_changes=nobody)
        assert ran.returncode == 0, ran.stderr
        assert record.read_text().splitlines() == [f"65534 -I -m hpcckpt.cli scavenge {mine}"], ran.stderr
        assert f"scavenge {mine}: committed: (fake) (exit 0)" in ran.stderr
        assert not staging.exists() and (secret / "levels").is_dir()
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_epilog_without_a_job_uid_or_with_scavenge_off_runs_no_python(tmp_path: Path) -> None:
    root = tmp_path / "stage"
    record = tmp_path / "ran"
    python = _fake_python(tmp_path / "python", record)
    for changes, said in (({"SLURM_JOB_UID": None}, "not scavenged"), ({"HPCCKPT_SCAVENGE": "0"}, "")):
        assert _run(PROLOG, tmp_path, root).returncode == 0
        _pointed_root(root / "job-123", "c" * 16, python, tmp_path / "shared")
        ran = _run(EPILOG, tmp_path, root, env_changes=changes)
        assert ran.returncode == 0 and said in ran.stderr, ran.stderr
        assert not record.exists() and not (root / "job-123").exists()
    # and with both: the pointer's Python runs, once, as this user (root: through setpriv)
    assert _run(PROLOG, tmp_path, root).returncode == 0
    root_dir = _pointed_root(root / "job-123", "c" * 16, python, tmp_path / "shared")
    ran = _run(EPILOG, tmp_path, root)
    assert record.read_text().splitlines() == [f"{os.getuid()} -I -m hpcckpt.cli scavenge {root_dir}"], ran.stderr


def test_epilog_scavenges_only_within_slurmds_prolog_epilog_timeout(tmp_path: Path) -> None:
    """slurmd drains a node whose epilog it has to kill: the scavenge keeps within the timeout."""
    root = tmp_path / "stage"
    record = tmp_path / "ran"
    python = _fake_python(tmp_path / "python", record)
    assert _run(PROLOG, tmp_path, root).returncode == 0
    _pointed_root(root / "job-123", "d" * 16, python, tmp_path / "shared")
    ran = _run(EPILOG, tmp_path, root, config="PrologEpilogTimeout     = 30")
    assert ran.returncode == 0 and "PrologEpilogTimeout=30 leaves no time" in ran.stderr, ran.stderr
    assert not record.exists() and not (root / "job-123").exists()
    assert _run(PROLOG, tmp_path, root).returncode == 0
    _pointed_root(root / "job-123", "d" * 16, python, tmp_path / "shared")
    ran = _run(EPILOG, tmp_path, root, config="EpilogMsgTime = 2000 usec\nPrologEpilogTimeout     = 120")
    assert ran.returncode == 0 and len(record.read_text().splitlines()) == 1, ran.stderr
