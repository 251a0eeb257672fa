"""Root's epilog scavenge with a hostile job user (issue 51, item 6). The scavenge runs, as
the job's user, the "python" her node-local pointer file (``.hpcckpt-level.json``) names,
from her staging. Here she plants a "python" that daemonizes (a child in a session of its
own that keeps the output open and sleeps long), and ``hpcckpt/`` and ``numpy/`` packages
that write a marker when imported. The epilog must return within its per-directory limit
plus a margin (a generous hang detector, not a tight timing), leave nothing of hers running,
never import a planted module, and log a line naming each directory it gave up on.

Needs root (useradd, setpriv) and /usr/bin/python3 (the test user cannot reach the venv's
interpreter under /root)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.localusers import local_user

pytestmark = [pytest.mark.fault]

PROLOG, EPILOG = REPO / "slurm" / "prolog", REPO / "slurm" / "epilog"
USER = "hpcktest-epilog"
SYSTEM_PYTHON = "/usr/bin/python3"
LIMIT_S = 3  # HPCCKPT_SCAVENGE_TIMEOUT: the limit of each directory's scavenge
MARGIN_S = 30  # what the epilog may take beyond the limit (recording, cleaning, a loaded machine)
HANG_S = 100  # the hang detector: far above any correct run, below a daemon's sleep
KEY = "a" * 16

# A "python" that daemonizes: a child in a session of its own (setsid) keeps the output pipe
# open and sleeps long. "stays": the "python" then sleeps too (the limit ends it); "leaves": it
# answers and exits at once (only its daemon is left); "hides": its daemon forks again, closes
# every descriptor and drops its environment (only a PID namespace or a cgroup can find it).
DAEMONS = {
    "stays": "setsid sh -c 'exec sleep 600' &\necho daemonized\nexec sleep 600\n",
    "leaves": "setsid sh -c 'exec sleep 600' &\necho 'committed: (fake)'\nexit 0\n",
    "hides": "setsid -f env -i sh -c 'exec sleep 600' </dev/null >/dev/null 2>&1\n"
             "echo 'committed: (fake)'\nexit 0\n",
}

PLANTED = "import os\nopen({marker!r}, 'a').write({where!r} + '\\n')\n"
PLANTED_HPCCKPT = PLANTED + "import numpy  # as the real package does\n"


def _running_as(uid: int) -> dict[int, str]:
    """pid -> command line of every process whose real uid is ``uid`` (zombies are not running)."""
    found: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status = Path(f"/proc/{entry}/status").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if int(fields["Uid"].split()[0]) == uid and not fields["State"].strip().startswith(("Z", "X")):
            found[int(entry)] = cmdline.replace(b"\0", b" ").decode(errors="replace").strip()
    return found


def _end_processes_of(uid: int) -> None:
    """SIGKILL, by pid, what the test user still runs (only this test starts processes as her)."""
    for _ in range(50):
        pids = _running_as(uid)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)


def _pid_namespaces() -> bool:
    return shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "--pid", "--fork", "--kill-child", "--", "true"], capture_output=True, check=False
    ).returncode == 0


@pytest.fixture(scope="module")
def guest() -> Iterator[tuple[int, int]]:
    if os.geteuid() != 0:
        pytest.skip("a second local user and root's epilog need root (useradd, setpriv)")
    if shutil.which("useradd") is None or shutil.which("setpriv") is None or not os.access(SYSTEM_PYTHON, os.X_OK):
        pytest.skip(f"needs useradd, setpriv and {SYSTEM_PYTHON}")
    with local_user(USER) as user:
        _end_processes_of(user.uid)
        try:
            yield user.uid, user.gid
        finally:
            _end_processes_of(user.uid)


@pytest.fixture
def base(guest: tuple[int, int]) -> Iterator[Path]:
    """A root-owned 0755 directory the test user can reach (pytest's tmp_path is root's alone)."""
    path = Path(tempfile.mkdtemp(prefix="hpcckpt-epilog-", dir="/tmp"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        _end_processes_of(guest[0])
        shutil.rmtree(path, ignore_errors=True)


def _epilog(base: Path, uid: int, gid: int, **env_changes: str) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run the epilog as slurmd does (root, Slurm's environment only): (its result, seconds)."""
    bin_dir = base / "bin"
    bin_dir.mkdir(exist_ok=True)
    scontrol = bin_dir / "scontrol"  # no controller: the hooks record empty fields and go on
    scontrol.write_text("#!/bin/sh\nexit 1\n")
    scontrol.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin:/usr/sbin:/sbin", "SLURM_JOB_ID": "123", "SLURM_JOB_UID": str(uid),
           "SLURM_JOB_GID": str(gid), "SLURMD_NODENAME": "n1", "HPCCKPT_STAGING_ROOT": str(base / "stage"),
           "HPCCKPT_SCAVENGE_TIMEOUT": str(LIMIT_S), **env_changes}
    start = time.monotonic()
    proc = subprocess.Popen([str(EPILOG)], env=env, cwd="/", stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=HANG_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        try:
            out, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:  # a pipe still held by what escaped
            out, err = "", "(its output still held open)"
        pytest.fail(f"the epilog hung: still running after {HANG_S}s; stderr: {err}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), time.monotonic() - start


def _staging_with_pointer(base: Path, uid: int, gid: int, python: str) -> tuple[Path, Path]:
    """The prolog's staging of job 123 for the user, one node-local root in it whose pointer
    names ``python``: (the staging, the node-local root)."""
    env = {"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "SLURM_JOB_ID": "123", "SLURM_JOB_UID": str(uid),
           "SLURM_JOB_GID": str(gid), "SLURMD_NODENAME": "n1", "HPCCKPT_STAGING_ROOT": str(base / "stage")}
    assert subprocess.run([str(PROLOG)], env=env, cwd="/", capture_output=True, timeout=60).returncode == 0
    staging = base / "stage" / "job-123"
    assert staging.is_dir() and staging.stat().st_uid == uid
    local = staging / "levels" / KEY
    local.mkdir(parents=True)
    (local / ".hpcckpt-level.json").write_text(json.dumps({"shared": str(base / "shared"), "python": python}))
    return staging, local


def _give_to(path: Path, uid: int, gid: int) -> None:
    for dirpath, dirs, files in os.walk(path):
        for name in [dirpath, *(os.path.join(dirpath, n) for n in dirs + files)]:
            os.chown(name, uid, gid, follow_symlinks=False)


def _log_lines(err: str, local: Path) -> list[str]:
    return [line for line in err.splitlines() if "scavenge" in line and str(local) in line]


@pytest.mark.parametrize("pidns", [True, False], ids=["pid-namespace", "no-pid-namespace"])
@pytest.mark.parametrize("daemon", sorted(DAEMONS))
def test_a_daemonizing_python_is_ended_whole_within_the_limit(guest: tuple[int, int], base: Path,
                                                               daemon: str, pidns: bool) -> None:
    """Ended whole, within the limit, logged; and a process of the same user that the scavenge
    did not start (her job on another allocation of the node) is left alone."""
    uid, gid = guest
    if pidns and not _pid_namespaces():
        pytest.skip("unshare --pid does not work here")
    if daemon == "hides" and not pidns:
        pytest.skip("a daemon that leaves its session, output and environment is found only in a PID namespace")
    python = base / "stage" / "job-123" / "levels" / KEY / "python"  # in her own node-local root
    staging, local = _staging_with_pointer(base, uid, gid, str(python))
    python.write_text("#!/bin/sh\n" + DAEMONS[daemon])
    python.chmod(0o755)
    _give_to(staging, uid, gid)
    if not pidns:  # a node without PID namespaces (a container without CAP_SYS_ADMIN, an old util-linux)
        (base / "bin").mkdir()
        (base / "bin" / "unshare").write_text("#!/bin/sh\necho 'unshare: unshare failed: Operation not permitted' >&2\n"
                                             "exit 1\n")
        (base / "bin" / "unshare").chmod(0o755)
    assert not _running_as(uid)
    bystander = subprocess.Popen(["sleep", "600"], user=uid, group=gid, extra_groups=[], cwd="/",
                                 start_new_session=True, env={"PATH": "/usr/bin:/bin"})
    try:
        ran, took = _epilog(base, uid, gid)
        left = _running_as(uid)
        assert bystander.poll() is None, "the epilog killed a process of the user that its scavenge did not start"
    finally:
        bystander.kill()
        bystander.wait()
    left.pop(bystander.pid, None)
    assert ran.returncode == 0, ran.stderr
    assert not left, f"the scavenge left processes of uid {uid} running: {left}; stderr: {ran.stderr}"
    assert took < LIMIT_S + MARGIN_S, f"the epilog took {took:.0f}s with a {LIMIT_S}s limit: {ran.stderr}"
    lines = _log_lines(ran.stderr, local)
    assert lines, f"no log line names {local}: {ran.stderr}"
    if daemon == "stays":
        assert any("gave up" in line for line in lines), lines
    assert ("no PID namespace" in ran.stderr) != pidns, ran.stderr
    assert not staging.exists()


@pytest.mark.parametrize("site", [False, True], ids=["pointer-python", "site-python"])
def test_modules_planted_in_the_staging_are_never_imported(guest: tuple[int, int], base: Path,
                                                            site: bool) -> None:
    """The pointer names a real Python (or the site forces one with HPCCKPT_SCAVENGE_PYTHON):
    an ``hpcckpt/`` or ``numpy/`` the user planted in her staging, its levels/ or the
    node-local root itself is never on its import path."""
    uid, gid = guest
    out = base / "out"
    out.mkdir(mode=0o777)
    out.chmod(0o777)
    marker = out / "imported"
    staging, local = _staging_with_pointer(base, uid, gid, "/nonexistent/python" if site else SYSTEM_PYTHON)
    for where in (staging, staging / "levels", local):
        for module, text in (("hpcckpt", PLANTED_HPCCKPT), ("numpy", PLANTED)):
            (where / module).mkdir()
            (where / module / "__init__.py").write_text(text.format(marker=str(marker), where=f"{where}/{module}"))
        (where / "hpcckpt" / "cli.py").write_text(PLANTED.format(marker=str(marker), where=f"{where}/hpcckpt.cli"))
    _give_to(staging, uid, gid)

    ran, took = _epilog(base, uid, gid, **({"HPCCKPT_SCAVENGE_PYTHON": SYSTEM_PYTHON} if site else {}))
    assert ran.returncode == 0, ran.stderr
    assert not marker.exists(), f"a planted module was imported: {marker.read_text()}; stderr: {ran.stderr}"
    assert _log_lines(ran.stderr, local), f"no log line names {local}: {ran.stderr}"
    assert not _running_as(uid)
    assert took < LIMIT_S + MARGIN_S, ran.stderr
    assert not staging.exists()
