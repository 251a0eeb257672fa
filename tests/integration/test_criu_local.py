"""CRIU mode end to end with a real criu, without Slurm.

A plain PyTorch job (criu_train.py, no hpcckpt code in it) runs under
``hpcckpt run --mode criu``; it is signalled, dumped (exit 75, the local
supervisor's "restart me"), restored by the next ``hpcckpt run`` and must finish
with parameters, optimizer state and loss trace bit-identical to a run that was
never interrupted.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcckpt.criu import check, find_criu
from hpcckpt.errors import CriuError
from tests.helpers import built_once

from .conftest import SlurmCluster

pytestmark = [pytest.mark.criu, pytest.mark.slow]

TRAIN = Path(__file__).with_name("criu_train.py")
STEPS = 40
EXIT_REQUEUE = 75


@pytest.fixture(scope="session")
def criu_ok() -> None:
    if os.geteuid() != 0:
        pytest.skip("CRIU dumps need root")
    try:
        criu = find_criu()
    except CriuError as exc:
        pytest.skip(f"no criu: {exc}")
    result = check(criu)
    assert result.ok, f"criu check failed on this machine: {result.output}"


def test_install_script_is_idempotent_and_yields_a_working_criu(criu_ok: None) -> None:
    script = Path(__file__).resolve().parents[2] / "scripts" / "install-criu"
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr
    path = proc.stdout.strip().splitlines()[-1]
    criu = find_criu(path)
    assert criu.major >= 4 and check(criu).ok


def hpcckpt(*args: str) -> list[str]:
    return [sys.executable, "-m", "hpcckpt.cli", *args]


def train_cmd(out: Path, *, steps: int = STEPS, seed: int = 1234, workers: int = 0,
              hold: Path | None = None) -> list[str]:
    return [sys.executable, str(TRAIN), "--steps", str(steps), "--out", str(out), "--seed", str(seed),
            "--workers", str(workers), *(["--hold-file", str(hold)] if hold else [])]


def hold_file(run_dir: Path) -> Path:
    """criu_train's ``--hold-file`` for the runs in ``run_dir`` (beside it, never dumped)."""
    return run_dir.parent / f"{run_dir.name}.hold"


def hold_at(run_dir: Path, step: int) -> None:
    """The job in ``run_dir`` parks after printing ``step`` (a restored one too), so a signal
    sent once that line is seen finds it running, however late the signal comes. The hold is
    a symlink whose target is the step: the job reads it without opening a file, so a dump
    never finds it holding the hold file open (a restore would then need that very file)."""
    tmp = hold_file(run_dir).with_suffix(".tmp")
    tmp.unlink(missing_ok=True)
    os.symlink(str(step), tmp)
    os.replace(tmp, hold_file(run_dir))  # never seen half-made


def release(run_dir: Path) -> None:
    """Let the job in ``run_dir`` run to its end."""
    hold_file(run_dir).unlink(missing_ok=True)


def uninterrupted(out: Path, *, workers: int = 0) -> dict:
    """The reference: the same command started directly (no supervisor, no dump)."""
    subprocess.run(train_cmd(out, workers=workers), check=True, stdout=subprocess.DEVNULL, timeout=600)
    return json.loads(out.read_text())


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = built_once(tmp_path_factory, "criu-local-reference", lambda d: uninterrupted(d / "ref.json"))
    return json.loads((out / "ref.json").read_text())


def job_output(run_dir: Path) -> str:
    return "".join(p.read_text() for p in sorted((run_dir / "criu" / "stdio").glob("*.out")))


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, *, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    needle = f"step {step} "
    while time.monotonic() < deadline:
        if (run_dir / "criu" / "stdio").is_dir() and needle in job_output(run_dir):
            return
        assert proc.poll() is None, f"supervisor exited early ({proc.returncode})"
        time.sleep(0.05)
    raise AssertionError(f"the job did not reach step {step} within {timeout_s} s")


def local_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment without Slurm's variables, on the local cluster backend: a test run
    inside an allocation must never ``scontrol requeue`` the allocation itself."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    return {**env, "HPCCKPT_CLUSTER": "local", **(extra or {})}


# A test's own job script parks like criu_train when it calls this (``PARK``), with the hold
# file in the environment (``start`` sets it for every command).
HOLD_ENV = "CRIU_TEST_HOLD"
PARK = f"""
def park(step):
    import os, time
    def limit():
        try:
            return int(os.readlink(os.environ["{HOLD_ENV}"]))
        except (KeyError, OSError, ValueError):
            return None
    while (held := limit()) is not None and step >= held:
        time.sleep(0.01)
"""


def start(run_dir: Path, out: Path, *extra: str, cmd: list[str] | None = None, workers: int = 0,
          env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(hpcckpt("run", "--mode", "criu", "--dir", str(run_dir), "--json", *extra, "--",
                                    *(cmd or train_cmd(out, workers=workers, hold=hold_file(run_dir)))),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=local_env({HOLD_ENV: str(hold_file(run_dir)), **(env or {})}))


def kill_supervised(proc: subprocess.Popen) -> None:
    """Kill a supervisor that is still running and everything under it (the job's
    namespace, a criu in flight); a no-op once it has finished. For ``finally`` blocks."""
    from hpcckpt.proc import tree as proctree

    if proc.returncode is not None or proc.poll() is not None:
        return
    below = proctree.tree(proc.pid)[1:]
    proc.kill()  # first, so that it starts nothing more
    for pid in below:  # SIGKILL to the namespace's init (nsinit) ends all inside it
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.communicate(timeout=60)


def finish(proc: subprocess.Popen, *, timeout_s: float = 600) -> tuple[int, dict, str]:
    stdout, stderr = proc.communicate(timeout=timeout_s)
    summary = json.loads(stdout) if stdout.strip() else {}
    return proc.returncode, summary, stderr


def dump_at(run_dir: Path, out: Path, step: int, *extra: str, cmd: list[str] | None = None, workers: int = 0,
            env: dict[str, str] | None = None) -> tuple[int, dict, str]:
    """One supervised run, signalled (SIGUSR2) once the job printed ``step``: (exit status,
    summary, stderr). The job is held at that step (``hold_at``: criu_train, and the scripts
    that call ``PARK``'s ``park``) until the supervisor has recorded the dump, or its failure,
    so the signal finds it running however late it comes, and a job that a failed dump leaves
    running then goes on to its end."""
    hold_at(run_dir, step)
    proc = start(run_dir, out, *extra, cmd=cmd, workers=workers, env=env)
    try:
        wait_for_step(run_dir, step, proc)
        return dump_held(run_dir, proc)
    finally:
        release(run_dir)
        kill_supervised(proc)


def dump_held(run_dir: Path, proc: subprocess.Popen) -> tuple[int, dict, str]:
    """SIGUSR2 to a supervised run whose job is held (``hold_at``); once the supervisor has
    recorded the dump or its failure, the hold is released and the run finished."""
    before = len(dump_events(run_dir))
    proc.send_signal(signal.SIGUSR2)
    SlurmCluster.wait_until(lambda: len(dump_events(run_dir)) > before or proc.poll() is not None, 300,
                            "the dump's outcome")
    release(run_dir)
    return finish(proc)


def run_with_dumps(run_dir: Path, out: Path, at_steps: list[int], *extra: str, workers: int = 0) -> list[dict]:
    """One supervised run per dump (signalled at each step), then a last one to the end."""
    summaries = []
    for step in at_steps:
        code, summary, stderr = dump_at(run_dir, out, step, *extra, workers=workers)
        assert code == EXIT_REQUEUE, f"expected exit 75 after the dump, got {code}: {stderr}"
        summaries.append(summary)
    code, summary, stderr = finish(start(run_dir, out, *extra, workers=workers))
    assert code == 0, f"final incarnation failed ({code}): {stderr}"
    summaries.append(summary)
    return summaries


def ledger(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()]


def dump_events(run_dir: Path) -> list[dict]:
    """The dumps and failed dumps recorded so far (whole lines only: the ledger may be growing)."""
    try:
        text = (run_dir / "ledger.jsonl").read_text()
    except FileNotFoundError:
        return []
    events = []
    for line in text.splitlines()[:text.count("\n")]:
        try:
            events.append(json.loads(line))
        except ValueError:
            continue  # a line an earlier crash left torn (the ledger's readers skip it too)
    return [e for e in events if isinstance(e, dict) and e.get("event") in ("criu_dump", "criu_dump_failed")]



def test_dump_restore_is_bit_identical(criu_ok: None, reference: dict, tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    summaries = run_with_dumps(tmp_path / "run", out, [15])
    result = json.loads(out.read_text())
    assert result["digest"] == reference["digest"]
    assert result["losses"] == reference["losses"]
    assert summaries[0]["action"] == "requeue" and summaries[0]["images"] == ["image-000001"]
    assert summaries[1]["restored_from"] == "image-000001"
    events = {e["event"]: e for e in ledger(tmp_path / "run")}
    assert events["criu_dump"]["bytes"] > 10 << 20 and events["criu_dump"]["dump_s"] > 0
    assert events["criu_restore"]["image"] == "image-000001" and events["criu_restore"]["restore_s"] > 0
    # The first incarnation's stdout stops at the dump; the restored job writes a new file.
    outs = sorted((tmp_path / "run" / "criu" / "stdio").glob("*.out"))
    assert len(outs) == 2 and "step 15 " in outs[0].read_text() and f"done {STEPS}" in outs[1].read_text()
    assert "step 16 " not in outs[0].read_text()  # parked at the hold when signalled: never a race with its end


def test_dataloader_worker_processes_are_dumped_too(criu_ok: None, tmp_path: Path) -> None:
    # Two persistent DataLoader workers: a process tree with pipes and shared memory.
    ref = uninterrupted(tmp_path / "ref.json", workers=2)
    out = tmp_path / "out.json"
    run_with_dumps(tmp_path / "run", out, [12], workers=2)
    result = json.loads(out.read_text())
    assert result["digest"] == ref["digest"]
    assert result["losses"] == ref["losses"]


def test_two_dumps_and_retention(criu_ok: None, reference: dict, tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    run_dir = tmp_path / "run"
    summaries = run_with_dumps(run_dir, out, [10, 25], "--keep", "1")
    result = json.loads(out.read_text())
    assert result["digest"] == reference["digest"]
    assert result["losses"] == reference["losses"]
    assert [s["restored_from"] for s in summaries] == [None, "image-000001", "image-000002"]
    kept = sorted(p.name for p in (run_dir / "criu").glob("image-*"))
    assert kept == ["image-000002"]
    assert [e["event"] for e in ledger(run_dir)].count("criu_dump") == 2
    # The run finished: its last image must not be restored into a later run.
    code, summary, _ = finish(start(run_dir, tmp_path / "again.json"))
    assert code == 0 and summary["restored_from"] is None


def flip_byte(image: Path) -> Path:
    victim = max(image.glob("pages-*.img"), key=lambda p: p.stat().st_size)
    with open(victim, "r+b") as f:
        f.seek(victim.stat().st_size // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x40]))
    return victim


def dumped_once(run_dir: Path, out: Path, cmd: list[str] | None = None, step: int = 10) -> None:
    code, _, stderr = dump_at(run_dir, out, step, cmd=cmd)
    assert code == EXIT_REQUEUE, stderr


def test_corrupt_image_falls_back_to_app(criu_ok: None, reference: dict, tmp_path: Path) -> None:
    run_dir, out = tmp_path / "run", tmp_path / "out.json"
    dumped_once(run_dir, out)
    victim = flip_byte(run_dir / "criu" / "image-000001")
    code, summary, stderr = finish(start(run_dir, out, "--on-restore-failure", "app"))
    assert code == 0, stderr
    assert summary["restored_from"] is None
    assert "crc32c" in stderr and victim.name in stderr
    failed = [e for e in ledger(run_dir) if e["event"] == "criu_restore_failed"]
    assert len(failed) == 1 and failed[0]["fallback"] == "app" and victim.name in failed[0]["error"]
    assert "criu_restore" not in [e["event"] for e in ledger(run_dir)]
    # The fresh start is a full, deterministic run.
    assert json.loads(out.read_text())["digest"] == reference["digest"]


ENV_PROBE = """
import os, sys
""" + PARK + """
print("step 1 ", flush=True)
park(1)
open(sys.argv[1], "w").write(os.environ.get("_HPCCKPT_CRIU_FALLBACK", "-"))
"""


def test_corrupt_image_fresh_and_fail(criu_ok: None, tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(ENV_PROBE)
    run_dir, out = tmp_path / "run", tmp_path / "seen.txt"
    cmd = [sys.executable, str(probe), str(out)]
    dumped_once(run_dir, out, cmd=cmd, step=1)
    flip_byte(run_dir / "criu" / "image-000001")

    code, summary, stderr = finish(start(run_dir, out, "--on-restore-failure", "fail", cmd=cmd))
    assert code == 1 and summary["action"] == "restore-failed" and "crc32c" in summary["detail"]
    assert not out.exists(), "with --on-restore-failure=fail the command must not run"

    code, summary, stderr = finish(start(run_dir, out, "--on-restore-failure", "fresh", cmd=cmd))
    assert code == 0, stderr
    assert out.read_text() == "fresh"


def _job_pids(marker: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if marker in cmdline and "unshare" not in cmdline and "hpcckpt.cli" not in cmdline:
                pids.append(int(entry.name))
    return sorted(pids)


def _occupy_pid(pid: int) -> subprocess.Popen | None:
    """Start a sleeper with exactly ``pid`` (ns_last_pid); None if another fork won the race."""
    for _ in range(20):
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(pid - 1))
        proc = subprocess.Popen(["sleep", "600"])
        if proc.pid == pid:
            return proc
        proc.kill()
        proc.wait()
    return None


def test_restore_while_pids_are_taken(criu_ok: None, reference: dict, tmp_path: Path) -> None:
    run_dir, out = tmp_path / "run", tmp_path / "out.json"
    hold_at(run_dir, 10)
    proc = start(run_dir, out)
    try:
        wait_for_step(run_dir, 10, proc)
        outer = _job_pids(str(out))
    finally:
        code, _, stderr = dump_held(run_dir, proc)
    assert len(outer) == 2, outer  # nsinit (PID 1 inside) and the training process (PID 2)
    assert code == EXIT_REQUEUE, stderr

    squatters = [p for p in (_occupy_pid(pid) for pid in outer) if p is not None]
    assert squatters, f"could not take any of the job's old PIDs {outer}"
    # A second CRIU-mode job runs meanwhile: its namespace has PIDs 1 and 2 too.
    other_dir, other_out = tmp_path / "other", tmp_path / "other.json"
    other = start(other_dir, other_out)
    try:
        wait_for_step(other_dir, 2, other)
        code, summary, stderr = finish(start(run_dir, out))
        assert code == 0, stderr
        assert summary["restored_from"] == "image-000001"
        assert json.loads(out.read_text())["digest"] == reference["digest"]
    finally:
        other.send_signal(signal.SIGTERM)
        for s in squatters:
            s.kill()
            s.wait()
        finish(other)


TERM_PROBE = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, lambda s, f: (open(sys.argv[1], "w").write(f"{os.getpid()} {os.getppid()}"),
                                            sys.exit(7)))
for i in range(1, 100000):
    print(f"step {i} ", flush=True)
    time.sleep(0.05)
"""


def test_restored_job_is_pid_2_under_nsinit_and_gets_forwarded_signals(criu_ok: None, tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(TERM_PROBE)
    run_dir, out = tmp_path / "run", tmp_path / "seen.txt"
    cmd = [sys.executable, str(probe), str(out)]
    dumped_once(run_dir, out, cmd=cmd, step=3)
    proc = start(run_dir, out, "--signal", "USR2", cmd=cmd)  # TERM is forwarded, not a dump trigger
    wait_for_step(run_dir, 20, proc)  # only the restored incarnation gets this far
    proc.send_signal(signal.SIGTERM)
    code, summary, stderr = finish(proc)
    assert summary["restored_from"] == "image-000001", stderr
    assert code == 7, stderr  # the job's own status, through nsinit and unshare
    # Inside its fresh namespaces the restored job is PID 2, child of nsinit (PID 1).
    assert out.read_text() == "2 1"


ENDS_ON_FLAG = """
import os, sys, time
i = 0
while not os.path.exists(sys.argv[1]):
    i += 1
    print(f"step {i} ", flush=True)
    time.sleep(0.05)
print("done by itself", flush=True)
sys.exit(3)
"""


@pytest.mark.parametrize("how", ["exits", "killed-by-TERM"])
def test_job_ending_during_the_dump(criu_ok: None, tmp_path: Path, how: str) -> None:
    # The race made deterministic at one seam: the criu that dumps first lets the job end
    # (a flag it polls; or SIGTERM, as Slurm sends every process of the step at the time
    # limit) and waits until PID 2 is gone inside the job's namespace, then the real criu
    # fails for want of a process. Its own exit is its natural end: no requeue, no stale
    # image, the job's status. Killed by TERM it did not end naturally: requeued.
    real = find_criu().path
    flag, run_dir = tmp_path / "finish-now", tmp_path / "run"
    wrapper = tmp_path / "criu-job-ends-first"
    end = f'touch "{flag}"' if how == "exits" else "kill -TERM 2"
    wrapper.write_text("#!/bin/sh\n"
                       f'if [ "$1" = dump ]; then {end}; n=0\n'
                       '  while [ -e /proc/2/stat ] && [ $n -lt 1200 ]; do sleep 0.05; n=$((n+1)); done\n'
                       "fi\n"
                       f'exec "{real}" "$@"\n')
    wrapper.chmod(0o755)
    script = tmp_path / "job.py"
    script.write_text(ENDS_ON_FLAG)
    # --signal USR2: TERM is then no dump signal, so the job does not ignore it and can be killed by it.
    proc = start(run_dir, flag, "--signal", "USR2", cmd=[sys.executable, str(script), str(flag)],
                 env={"HPCCKPT_CRIU": str(wrapper)})
    try:
        wait_for_step(run_dir, 3, proc)
        proc.send_signal(signal.SIGUSR2)
        code, summary, stderr = finish(proc)
    finally:
        kill_supervised(proc)
    events = ledger(run_dir)
    failed = [e for e in events if e["event"] == "criu_dump_failed"]
    assert summary["images"] == [] and len(failed) == 1 and failed[0]["job_ended"] is True, summary
    if how == "killed-by-TERM":
        assert code == EXIT_REQUEUE and summary["action"] == "requeue", stderr
        assert "status 143: killed by SIGTERM from outside" in stderr and "ended by itself" not in stderr
        assert "requeue" in [e["event"] for e in events] and not failed[0].get("exited_itself")
        return
    assert code == 3, stderr
    assert summary["action"] == "exited", summary
    assert "ended by itself (status 3)" in stderr and "requeue" not in stderr.replace("no requeue", "")
    assert "done by itself" in job_output(run_dir)
    assert "requeue" not in [e["event"] for e in events]
    assert failed[0]["exited_itself"] is True and failed[0]["exit_code"] == 3
    assert not (run_dir / "criu" / "STALE").exists()
