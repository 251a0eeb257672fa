"""Real-Slurm fixtures: a 2-node cluster on loopback (slurm/localcluster) for the session.

The cluster is started once per session and stopped at its end (slurmctld and both
slurmd) unless it was already up before the session: then it is the user's and is
left running. Under pytest-xdist every worker has a cluster of its own (its own state
directory and ports), so tests that wait on Slurm's clocks run side by side and never
see each other's jobs or preemptions; munged is shared, started once as a daemon that no
cluster's `down` stops. Jobs run the project's own venv Python, so nothing is mocked.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests import stacks
from tests.helpers import built_once

REPO = Path(__file__).resolve().parents[2]
LOCALCLUSTER = REPO / "slurm" / "localcluster"
PYTHON = sys.executable
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
            "BOOT_FAIL", "DEADLINE", "PREEMPTED"}


@dataclass(frozen=True)
class SlurmCluster:
    """A running local cluster and small helpers to drive it from tests."""

    conf: Path
    state_dir: Path

    def run(self, args: Sequence[str], check: bool = True) -> str:
        proc = subprocess.run(list(args), capture_output=True, text=True, timeout=60, check=False)
        if check and proc.returncode != 0:
            raise AssertionError(f"{shlex.join(args)} failed ({proc.returncode}): {proc.stderr or proc.stdout}")
        return proc.stdout

    def sbatch(self, script: Path, *options: str, cwd: Path | None = None) -> str:
        out = subprocess.run(["sbatch", "--parsable", *options, str(script)], capture_output=True,
                             text=True, timeout=60, cwd=cwd or script.parent, check=False)
        if out.returncode != 0:
            raise AssertionError(f"sbatch {script} failed: {out.stderr}")
        return out.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """The job's record as scontrol shows it, read so that its name cannot forge a field
        ({} once Slurm no longer knows it)."""
        from hpcckpt.cluster.scontrol import show_job
        from hpcckpt.errors import ClusterError

        try:
            return show_job(job_id, free_text=True, timeout_s=60)
        except ClusterError:
            return {}

    def state(self, job_id: str) -> str:
        from hpcckpt.cluster.scontrol import show_job
        from hpcckpt.errors import ClusterError

        try:
            return show_job(job_id, timeout_s=60).get("JobState", "UNKNOWN")  # one squeue call
        except ClusterError:
            return "UNKNOWN"

    def wait_for(self, job_id: str, states: set[str], timeout_s: float, out: Path | None = None) -> str:
        deadline = time.monotonic() + timeout_s
        state = ""
        while time.monotonic() < deadline:
            state = self.state(job_id)
            if state in states:
                return state
            time.sleep(0.5)
        tail = out.read_text(errors="replace")[-3000:] if out and out.exists() else "(no output)"
        raise AssertionError(f"job {job_id} still {state} after {timeout_s:.0f}s, wanted {states}\n{tail}\n"
                             + stacks.job_stacks(job_id))

    def wait_done(self, job_id: str, timeout_s: float, out: Path | None = None) -> str:
        return self.wait_for(job_id, TERMINAL, timeout_s, out)

    def wait_completed(self, job_id: str, timeout_s: float, out: Path | None = None) -> None:
        """``wait_done`` that must end COMPLETED; otherwise the failure shows the job's
        record, the tail of its output and of the ledger next to it (``out``'s ``ckpt/``)."""
        state = self.wait_done(job_id, timeout_s, out)
        if state == "COMPLETED":
            return
        record = {k: v for k, v in self.job(job_id).items()
                  if k in ("JobState", "Reason", "ExitCode", "Restarts", "RunTime", "TimeLimit", "EndTime")}
        tail = out.read_text(errors="replace")[-4000:] if out and out.exists() else "(no output)"
        ledger = out.parent / "ckpt" / "ledger.jsonl" if out else None
        events = ledger.read_text(errors="replace").splitlines()[-25:] if ledger and ledger.exists() else []
        raise AssertionError(f"job {job_id} ended {state}, not COMPLETED: {record}\n--- output ---\n{tail}"
                             "\n--- ledger ---\n" + "\n".join(events))

    def cancel(self, job_id: str) -> None:
        self.run(["scancel", job_id], check=False)

    @staticmethod
    def read_ledger(ckpt_dir: Path) -> list[dict[str, Any]]:
        path = ckpt_dir / "ledger.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    @staticmethod
    def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(0.3)
        raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")

    @staticmethod
    def trace_steps(run_dir: Path) -> int:
        trace = run_dir / "trace.jsonl"
        return len(trace.read_text().splitlines()) if trace.exists() else 0

    @staticmethod
    def render(name: str, out: Path, **params: str) -> Path:
        """``hpcckpt template NAME --out OUT --set K=V...`` (the real CLI)."""
        sets = [arg for key, value in params.items() for arg in ("--set", f"{key}={value}")]
        subprocess.run([PYTHON, "-m", "hpcckpt.cli", "template", name, "--out", str(out), *sets],
                       check=True, capture_output=True, text=True)
        return out

    def render_demo(self, name: str, run_dir: Path, *, steps: int, sleep_s: float = 0.25,
                    time_limit: str = "10:00", lead_s: int = 50, **params: str) -> Path:
        """A template rendered to run the demo training in ``run_dir`` (no periodic saves:
        only the final checkpoint at a stop, so lost steps would show)."""
        command = (f'{PYTHON} -m hpcckpt.demo.train --dir "$HPCCKPT_RUN_DIR" --steps {steps} '
                   f"--every 100000 --step-sleep {sleep_s}")
        return self.render(name, run_dir / f"{name}.sbatch", TIME=time_limit, LEAD_S=str(lead_s),
                           RUN_DIR=str(run_dir), OUTPUT=f"{run_dir}/slurm-%j.out", COMMAND=command,
                           JOB_NAME=f"hpcckpt-{name}", **params)

    def submit_demo(self, name: str, run_dir: Path, *sbatch_options: str, **render: Any) -> str:
        """Create ``run_dir``, render template ``name`` for the demo there (``render_demo``)
        and submit it; returns the job id."""
        run_dir.mkdir(parents=True, exist_ok=True)
        return self.sbatch(self.render_demo(name, run_dir, **render), *sbatch_options)

    def result_digest(self, run_dir: Path) -> str:
        path = run_dir / "result.json"
        assert path.exists(), f"no {path}: the training did not finish"
        return str(json.loads(path.read_text())["param_digest"])

    def history(self, ckpt_dir: Path) -> dict[str, Any]:
        proc = self.hpcckpt("history", str(ckpt_dir), "--json")
        assert proc.returncode == 0, proc.stderr
        return dict(json.loads(proc.stdout))

    def preempt(self, *, nodes: int = 2, seconds: int = 3) -> str:
        """Submit a high-priority job that needs every node: it preempts whatever runs in `low`."""
        out = self.run(["sbatch", "--parsable", "-p", "high", "--exclusive", f"-N{nodes}",
                        "-o", "/dev/null", "-J", "hpcckpt-preemptor", "--wrap", f"sleep {seconds}"])
        return out.strip().split(";")[0]

    @staticmethod
    def hpcckpt(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([PYTHON, "-m", "hpcckpt.cli", *args], capture_output=True, text=True,
                              timeout=120, check=False)


def _require_tools() -> None:
    missing = [t for t in ("slurmctld", "slurmd", "munged", "sbatch")
               if shutil.which(t) is None and shutil.which(t, path="/usr/sbin") is None]
    if missing:
        pytest.fail(f"Slurm tools missing ({', '.join(missing)}): run slurm/install-deps "
                    "(scripts/bootstrap does) before the slurm tier")
    if os.geteuid() != 0:
        pytest.skip("slurm/localcluster runs slurmctld/slurmd as root; run the slurm tier as root")


def _worker_index() -> int | None:
    """This pytest-xdist worker's number (gw3 -> 3), None outside xdist."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    return int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else None


# The cluster settings the suite was started with (HPCCKPT_CLUSTER_DIR, _PORT, _FIRST_JOB_ID):
# read at import, since each test's environment is cleared of HPCCKPT_* (tests/conftest.py),
# and a test that starts `slurm/localcluster` itself must meet the cluster its fixture started.
_OUTER_CLUSTER = {k: v for k, v in os.environ.items() if k.startswith("HPCCKPT_CLUSTER_")}


def _cluster_env() -> dict[str, str]:
    """The environment for slurm/localcluster: outside xdist its defaults (or what the
    user set); worker k gets /tmp/hpcckpt-localcluster-gwK, ports 100*(k+1) above the
    default ones and job ids from 1000*(k+1) (templates derive MASTER_PORT from the job
    id), so no two workers' daemons or jobs ever meet."""
    env = {**os.environ, **_OUTER_CLUSTER}
    index = _worker_index()
    if index is not None:
        env["HPCCKPT_CLUSTER_DIR"] = f"/tmp/hpcckpt-localcluster-gw{index}"
        env["HPCCKPT_CLUSTER_PORT"] = str(16817 + 100 * (index + 1))
        env["HPCCKPT_CLUSTER_FIRST_JOB_ID"] = str(1000 * (index + 1))
    return env


def _localcluster(*args: str, timeout_s: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(LOCALCLUSTER), *args], capture_output=True, text=True,
                          timeout=timeout_s, check=False, env=_cluster_env())


def _already_up() -> bool:
    """True when a local cluster is running before the suite touches it (status exits 0)."""
    return _localcluster("status", timeout_s=60).returncode == 0


def _down() -> None:
    """Stop what the suite started; a failure here is reported, not hidden."""
    proc = _localcluster("down")
    if proc.returncode != 0:
        pytest.fail(f"slurm/localcluster down failed:\n{proc.stdout}\n{proc.stderr}")


def _start_munge() -> None:
    """munged for every cluster of the run, started once (workers race for it: a file lock)."""
    from filelock import FileLock

    with FileLock("/tmp/hpcckpt-localcluster-munge.lock"):
        proc = _localcluster("munge", timeout_s=60)
    if proc.returncode != 0:
        pytest.fail(f"slurm/localcluster munge failed:\n{proc.stdout}\n{proc.stderr}")


@pytest.fixture(autouse=True)
def _poll_within_grace(_isolated_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The local partitions' GraceTime is 10 s: the jobs a test submits read their end time
    every 2 s (as a site with a short GraceTime sets HPCCKPT_POLL_S), not every 15 s, so a
    preemption is noticed early in its grace instead of after most of it."""
    monkeypatch.setenv("HPCCKPT_POLL_S", "2")


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    _require_tools()
    _start_munge()
    was_up = _already_up()
    try:
        yield from _cluster_up()
    finally:
        if not was_up:
            _down()


def _cluster_up() -> Iterator[SlurmCluster]:
    proc = _localcluster("up", "--nodes", "2")
    if proc.returncode != 0:
        pytest.fail(f"slurm/localcluster up failed:\n{proc.stdout}\n{proc.stderr}")
    env_lines = _localcluster("env", timeout_s=60).stdout
    for line in env_lines.splitlines():
        key, _, value = line.removeprefix("export ").partition("=")
        os.environ[key] = shlex.split(value)[0] if value else ""
    # Jobs inherit this environment (sbatch --export=ALL): the venv's python and
    # `hpcckpt` come first on PATH.
    os.environ["PATH"] = f"{Path(PYTHON).parent}:{os.environ.get('PATH', '')}"
    conf = Path(os.environ["SLURM_CONF"])
    yield SlurmCluster(conf=conf, state_dir=conf.parent.parent)


_REFERENCES: dict[int, str] = {}


@pytest.fixture(scope="session")
def reference_digest(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], str]:
    """``reference_digest(steps)``: digest of an uninterrupted demo run (cached per session)."""
    def build(out: Path, steps: int) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}
        subprocess.run([PYTHON, "-m", "hpcckpt.demo.train", "--dir", str(out), "--steps", str(steps),
                        "--no-checkpoint"], check=True, env=env, timeout=600, capture_output=True)

    def digest(steps: int) -> str:
        if steps not in _REFERENCES:
            out = built_once(tmp_path_factory, f"demo-reference-{steps}", lambda d: build(d, steps))
            _REFERENCES[steps] = json.loads((out / "result.json").read_text())["param_digest"]
        return _REFERENCES[steps]

    return digest


