"""CRIU-mode faults: a dump that cannot be written must leave the job running.

The run directory sits on a 4 MiB tmpfs, too small for the image: criu fails
part-way, resumes the frozen tree, and the supervisor forwards the signal to the
job (so an application with its own handler can still save). No image, and no
half-written temp directory, may be left behind.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from .test_criu_local import criu_ok, finish, ledger, start, wait_for_step  # noqa: F401  (fixture)

pytestmark = [pytest.mark.criu, pytest.mark.fault, pytest.mark.slow]

JOB = """
import signal, sys, time
got = []
signal.signal(signal.SIGUSR2, lambda s, f: got.append(s))
junk = bytearray(32 << 20)          # 32 MiB of memory: the image cannot fit in 4 MiB
for i in range(1, 100000):
    print(f"step {i} ", flush=True)
    if got:
        print("saved by the application", flush=True)
        open(sys.argv[1], "w").write("saved")
        sys.exit(0)
    time.sleep(0.05)
"""


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "small"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_dump_that_cannot_be_written_leaves_the_job_running(criu_ok: None, small_fs: Path,  # noqa: F811
                                                            tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    flag = tmp_path / "saved"
    run_dir = small_fs / "run"
    proc = start(run_dir, flag, cmd=[sys.executable, str(script), str(flag)])
    wait_for_step(run_dir, 5, proc)
    proc.send_signal(signal.SIGUSR2)
    code, summary, stderr = finish(proc)
    assert code == 0, stderr
    assert flag.read_text() == "saved"
    assert summary["images"] == [] and summary["action"] == "exited"
    assert "dump failed, the job keeps running" in stderr
    failed = [e for e in ledger(run_dir) if e["event"] == "criu_dump_failed"]
    assert len(failed) == 1 and failed[0]["job_ended"] is False
    leftovers = [p.name for p in (run_dir / "criu").iterdir() if p.name.startswith("image-")]
    assert leftovers == [], leftovers
    assert json.dumps(summary)
