"""A job CRIU cannot dump is told so at its start, not at its first preemption.

The job holds an io_uring instance (as torchrun's TCPStore does: criu fails on it with
"Unknown shit 600 (anon_inode:[io_uring])"). Within seconds of its start the supervisor
says so on stderr and in the ledger, naming the process, the resource and the in-process
alternative; the job is never killed by hpcckpt and ends with its own status.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .test_criu_local import criu_ok, finish, hpcckpt, local_env  # noqa: F401  (fixture)

pytestmark = [pytest.mark.criu, pytest.mark.slow]

URING_JOB = """
import ctypes, os, sys, time
fd = ctypes.CDLL(None).syscall(425, 4, ctypes.create_string_buffer(120))
print("io_uring fd", fd, flush=True)
deadline = time.time() + 120
while not os.path.exists(sys.argv[1]) and time.time() < deadline:
    time.sleep(0.1)
sys.exit(5 if fd >= 0 else 6)
"""


def test_an_undumpable_job_is_named_within_seconds_and_runs_on(criu_ok: None, tmp_path: Path) -> None:  # noqa: F811
    script, run_dir, flag = tmp_path / "uring.py", tmp_path / "run", tmp_path / "finish"
    script.write_text(URING_JOB)
    proc = subprocess.Popen(hpcckpt("run", "--mode", "criu", "--dir", str(run_dir), "--json", "--",
                                    sys.executable, str(script), str(flag)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=local_env())
    try:
        from .conftest import SlurmCluster

        def checked() -> bool:
            ledger = run_dir / "ledger.jsonl"
            return ledger.exists() and '"criu_check"' in ledger.read_text()

        SlurmCluster.wait_until(checked, 120, "the supervisor's dumpability check")
        assert proc.poll() is None  # looked at, never touched
    finally:
        flag.touch()
    code, _summary, stderr = finish(proc)
    if code == 6:
        pytest.skip("io_uring is disabled on this kernel")
    assert code == 5, stderr  # the job's own status
    [check] = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()
               if '"criu_check"' in line]
    assert check["ok"] is False and check["problems"][0]["inner_pid"] == 2, check
    assert "io_uring" in check["problems"][0]["what"] and "hpcckpt template torchrun" in check["fix"]
    assert "THIS JOB CANNOT BE DUMPED BY CRIU" in stderr and "io_uring" in stderr
