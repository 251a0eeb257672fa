"""CRIU-mode faults: a failed dump must never cost the job its work.

- The run directory sits on a 4 MiB tmpfs, too small for the image: criu fails
  part-way, resumes the frozen tree, and the supervisor forwards the signal to the
  job, which catches it and saves itself. No image, and no half-written temp
  directory, may be left behind.
- A job that does NOT catch the signal, restored from an image, whose next dump is
  made to fail (a criu wrapper refusing ``dump``: one seam) keeps running to its end
  with the right result; nothing is forwarded, the failure is in the ledger and in
  ``hpcckpt history``, and no requeue from the older image happens.
- A CPU job that maps a libcuda (a stand-in here) whose driver says "no context"
  (the driver call's result: one seam) is dumped and restored as a CPU process.
"""
from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from hpcckpt.criu import find_criu

from ..unit.test_cuda_driver import build_fake
from .test_criu_local import EXIT_REQUEUE, PARK, criu_ok, dump_at, finish, job_output, ledger, start  # noqa: F401  (fixture)

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
    code, summary, stderr = dump_at(run_dir, flag, 5, cmd=[sys.executable, str(script), str(flag)])
    assert code == 0, stderr
    assert flag.read_text() == "saved"
    assert summary["images"] == [] and summary["action"] == "exited"
    assert "CRIU DUMP FAILED; the job keeps running" in stderr and "forwarded SIGUSR2" in stderr
    failed = [e for e in ledger(run_dir) if e["event"] == "criu_dump_failed"]
    assert len(failed) == 1 and failed[0]["job_ended"] is False and failed[0]["forwarded_to"] == [2]
    leftovers = [p.name for p in (run_dir / "criu").iterdir() if p.name.startswith("image-")]
    assert leftovers == [], leftovers
    assert json.dumps(summary)


# Counts to STEPS and writes a digest of its own progress; no handler for anything.
COUNTER = """
import hashlib, sys
""" + PARK + """
h = hashlib.sha256()
for i in range(1, int(sys.argv[2]) + 1):
    h.update(str(i).encode())
    print(f"step {i} ", flush=True)
    park(i)  # held at the step a test signals it at (dump_at)
open(sys.argv[1], "w").write(h.hexdigest())
"""
COUNT_TO = 120


def expected_digest(n: int) -> str:
    import hashlib

    h = hashlib.sha256()
    for i in range(1, n + 1):
        h.update(str(i).encode())
    return h.hexdigest()


def refusing_criu(tmp_path: Path) -> Path:
    """A criu that refuses to dump and passes everything else to the real one."""
    real = find_criu().path
    wrapper = tmp_path / "criu-refusing-dump"
    wrapper.write_text("#!/bin/sh\n"
                       'if [ "$1" = dump ]; then echo "Error (injected): dump refused for this test" >&2; exit 1; fi\n'
                       f'exec "{real}" "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


def test_failed_dump_of_a_job_without_handler_never_kills_it(criu_ok: None, tmp_path: Path) -> None:  # noqa: F811
    script = tmp_path / "counter.py"
    script.write_text(COUNTER)
    out, run_dir = tmp_path / "digest", tmp_path / "run"
    cmd = [sys.executable, str(script), str(out), str(COUNT_TO)]
    code, _, stderr = dump_at(run_dir, out, 5, cmd=cmd)
    assert code == EXIT_REQUEUE, stderr
    assert "step 5 " in job_output(run_dir) and "step 6 " not in job_output(run_dir)  # held there, then dumped

    # Restored (real criu), then the next dump fails: the job does not catch USR2.
    code, summary, stderr = dump_at(run_dir, out, 30, cmd=cmd, env={"HPCCKPT_CRIU": str(refusing_criu(tmp_path))})
    assert code == 0, stderr
    assert summary["restored_from"] == "image-000001" and summary["action"] == "exited"
    assert out.read_text() == expected_digest(COUNT_TO)
    assert "CRIU DUMP FAILED; the job keeps running" in stderr and "dump refused for this test" in stderr
    assert "NOT forwarding SIGUSR2" in stderr and "not requeueing from it" in stderr
    failed = [e for e in ledger(run_dir) if e["event"] == "criu_dump_failed"]
    assert len(failed) == 1
    assert failed[0]["forwarded_to"] == [] and failed[0]["older_image"] == "image-000001"
    assert failed[0]["requeue_from_older"] is False and "USR2" in failed[0]["fix"]
    history = subprocess.run([sys.executable, "-m", "hpcckpt.cli", "history", str(run_dir)], capture_output=True,
                             text=True, timeout=120)
    assert history.returncode == 0, history.stderr
    assert "CRIU dump failed" in history.stdout and "dump refused for this test" in history.stdout


MAPS_LIBCUDA = """
import ctypes, sys, time
ctypes.CDLL(sys.argv[3])   # maps .../libcuda.so.1 like a CUDA build of torch does
""" + COUNTER.split("\n", 1)[1]


def test_cpu_job_mapping_libcuda_without_context_is_dumped_as_cpu(criu_ok: None, tmp_path: Path) -> None:  # noqa: F811
    mapped = build_fake(tmp_path / "lib", version=12080, checkpoint=True, name="libcuda.so.1")
    no_context = build_fake(tmp_path / "drv", version=12080, checkpoint=True, state_rc=3)
    script = tmp_path / "cpu_job.py"
    script.write_text(MAPS_LIBCUDA)
    out, run_dir = tmp_path / "digest", tmp_path / "run"
    cmd = [sys.executable, str(script), str(out), str(COUNT_TO // 2), str(mapped)]
    env = {"HPCCKPT_LIBCUDA": str(no_context)}
    code, summary, stderr = dump_at(run_dir, out, 5, cmd=cmd, env=env)
    assert code == EXIT_REQUEUE, stderr
    assert "maps libcuda but has no CUDA context" in stderr
    dump = [e for e in ledger(run_dir) if e["event"] == "criu_dump"]
    assert len(dump) == 1 and dump[0]["cuda_pids"] == 0
    code, summary, stderr = finish(start(run_dir, out, cmd=cmd, env=env))
    assert code == 0, stderr
    assert summary["restored_from"] == "image-000001"
    assert out.read_text() == expected_digest(COUNT_TO // 2)


def criu_wrapper(tmp_path: Path, name: str, after_dump: str) -> Path:
    """A criu that runs the real dump, then does ``after_dump`` (shell, ``$D`` = the image
    directory, ``$rc`` = criu's status); everything else goes to the real criu."""
    real = find_criu().path
    wrapper = tmp_path / name
    wrapper.write_text("#!/bin/sh\n"
                       'if [ "$1" != dump ]; then exec "' + str(real) + '" "$@"; fi\n'
                       'D=""; prev=""; for a in "$@"; do [ "$prev" = -D ] && D="$a"; prev="$a"; done\n'
                       f'"{real}" "$@"; rc=$?\n' + after_dump + "\nexit $rc\n")
    wrapper.chmod(0o755)
    return wrapper


def counter_cmd(tmp_path: Path, out: Path, n: int = COUNT_TO) -> list[str]:
    script = tmp_path / "counter.py"
    script.write_text(COUNTER)
    return [sys.executable, str(script), str(out), str(n)]


def test_failed_commit_after_the_dump_never_rewinds_to_an_older_image(criu_ok: None,  # noqa: F811
                                                                      tmp_path: Path) -> None:
    out, run_dir = tmp_path / "digest", tmp_path / "run"
    cmd = counter_cmd(tmp_path, out)
    code, _, stderr = dump_at(run_dir, out, 5, cmd=cmd)
    assert code == EXIT_REQUEUE, stderr
    # Restored from image 1, the job runs on to step 30; the next dump ends it, but its
    # commit fails (a directory planted where the manifest goes).
    planting = criu_wrapper(tmp_path, "criu-commit-fails", '[ $rc = 0 ] && mkdir "$D/manifest.json"')
    code, summary, stderr = dump_at(run_dir, out, 30, cmd=cmd, env={"HPCCKPT_CRIU": str(planting)})
    assert code == EXIT_REQUEUE, stderr
    assert summary["restored_from"] == "image-000001" and summary["images"] == []
    assert "THE JOB HAS ENDED" in stderr and "image-000001 are now stale" in stderr
    assert "keeps running" not in stderr
    # The next run must not rewind to step 5: it falls back (app: a fresh start of the command).
    code, summary, stderr = finish(start(run_dir, out, cmd=cmd))
    assert code == 0, stderr
    assert summary["restored_from"] is None and "is stale" in stderr
    assert out.read_text() == expected_digest(COUNT_TO)
    events = ledger(run_dir)
    assert [e["job_ended"] for e in events if e["event"] == "criu_dump_failed"] == [True]
    assert [e["fallback"] for e in events if e["event"] == "criu_restore_failed"] == ["app"]


def test_image_committed_while_latest_could_not_be_rewritten_is_the_one_restored(criu_ok: None,  # noqa: F811
                                                                                 tmp_path: Path) -> None:
    out, run_dir = tmp_path / "digest", tmp_path / "run"
    cmd = counter_cmd(tmp_path, out)
    code, _, stderr = dump_at(run_dir, out, 5, cmd=cmd)
    assert code == EXIT_REQUEUE, stderr
    latest = run_dir / "criu" / "LATEST"
    assert latest.read_text().strip() == "image-000001"
    if subprocess.run(["chattr", "+i", str(latest)], capture_output=True).returncode != 0:
        pytest.skip("cannot make LATEST immutable on this filesystem")
    try:
        # Image 2 is renamed into place, then replacing LATEST fails: it still names image 1.
        code, summary, stderr = dump_at(run_dir, out, 30, cmd=cmd)
        assert code == EXIT_REQUEUE, stderr
        assert summary["images"] == ["image-000002"] and "could not update LATEST" in stderr
        assert latest.read_text().strip() == "image-000001"
        code, summary, stderr = finish(start(run_dir, out, cmd=cmd))
    finally:
        subprocess.run(["chattr", "-i", str(latest)], check=False)
    assert code == 0, stderr
    assert summary["restored_from"] == "image-000002"
    assert out.read_text() == expected_digest(COUNT_TO)


def test_dump_reported_failed_after_criu_ended_the_job_requeues(criu_ok: None, tmp_path: Path) -> None:  # noqa: F811
    # criu dumps (and so ends) the job, then reports failure, as after a timeout that
    # struck once the tree was already killed: the job must not be said to keep running.
    out, run_dir = tmp_path / "digest", tmp_path / "run"
    cmd = counter_cmd(tmp_path, out)
    late = criu_wrapper(tmp_path, "criu-fails-late", 'echo "Error (injected): failed after the dump" >&2; rc=1')
    code, summary, stderr = dump_at(run_dir, out, 5, cmd=cmd, env={"HPCCKPT_CRIU": str(late)})
    assert code == EXIT_REQUEUE, stderr
    assert "THE JOB HAS ENDED" in stderr and "criu dump failed (exit 1)" in stderr
    assert "keeps running" not in stderr and "forwarded" not in stderr
    assert summary["images"] == []
    failed = [e for e in ledger(run_dir) if e["event"] == "criu_dump_failed"]
    assert len(failed) == 1 and failed[0]["job_ended"] is True
    code, summary, stderr = finish(start(run_dir, out, cmd=cmd))
    assert code == 0, stderr
    assert out.read_text() == expected_digest(COUNT_TO)


QUICK_EXIT = """
import os, sys, time
print("started", flush=True)
i = 0
while not os.path.exists(sys.argv[1]):
    i += 1
    print(f"step {i} ", flush=True)
    time.sleep(0.05)
sys.exit(3)
"""


def test_restored_job_that_exits_at_once_is_not_run_again(criu_ok: None, tmp_path: Path) -> None:  # noqa: F811
    script = tmp_path / "quick.py"
    script.write_text(QUICK_EXIT)
    flag, run_dir = tmp_path / "done", tmp_path / "run"
    cmd = [sys.executable, str(script), str(flag)]
    code, _, stderr = dump_at(run_dir, flag, 5, cmd=cmd)
    assert code == EXIT_REQUEUE, stderr
    flag.touch()  # the restored job sees it at its next step and exits 3 at once
    code, summary, stderr = finish(start(run_dir, flag, cmd=cmd))
    assert code == 3, stderr
    assert summary["restored_from"] == "image-000001"
    outputs = "".join(p.read_text() for p in (run_dir / "criu" / "stdio").glob("*.out"))
    assert outputs.count("started") == 1, outputs  # never started a second time
