"""CRIU mode's parts that need no criu: version parsing and lookup errors, the image
store (real Transactions, real files), the namespace init's signal forwarding, the
run verb's options, and ``--mode app``."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hpcckpt.criu import images
from hpcckpt.criu.locate import find_criu, parse_version
from hpcckpt.criu.ops import NSINIT
from hpcckpt.criu.supervisor import RunOptions
from hpcckpt.errors import CheckpointCorrupt, ConfigError, CriuError, NoCheckpoint
from hpcckpt.store.commit import Transaction


@pytest.mark.parametrize("text, expected", [
    ("Version: 4.1.1\nGitID: v4.1.1\n", (4, 1, 1)),
    ("Version: 3.17\n", (3, 17, 0)),
    ("Warn (criu/kerndat.c:1285): x\nVersion: 4.0\n", (4, 0, 0)),
    ("criu: command not found", None),
])
def test_parse_version(text: str, expected: tuple[int, int, int] | None) -> None:
    assert parse_version(text) == expected


def test_missing_criu_names_the_path_and_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HPCCKPT_CRIU", str(tmp_path / "criu"))
    with pytest.raises(CriuError, match=r"not found.*scripts/install-criu"):
        find_criu()


def test_too_old_criu_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    old = tmp_path / "criu"
    old.write_text("#!/bin/sh\necho 'Version: 3.17.1'\n")
    old.chmod(0o755)
    monkeypatch.setenv("HPCCKPT_CRIU", str(old))
    with pytest.raises(CriuError, match=r"criu 3\.17\.1, CRIU mode needs >= 4"):
        find_criu()


def commit_image(root: Path, seq: int, payload: bytes = b"pages" * 1000) -> images.Image:
    with Transaction(root, images.image_name(seq)) as tx:
        (tx.path / "pages-1.img").write_bytes(payload)
        (tx.path / "core-1.img").write_bytes(b"core")
        tx.commit({"kind": images.KIND, "seq": seq})
    return images.Image(path=root / images.image_name(seq), seq=seq)


def test_newest_verify_and_bytes(tmp_path: Path) -> None:
    root = tmp_path / "criu"
    with pytest.raises(NoCheckpoint):
        images.newest(root)
    commit_image(root, 1)
    im = commit_image(root, 2)
    assert images.newest(root) == im
    assert images.next_seq(root) == 3
    assert images.verify(im)["seq"] == 2
    assert im.bytes_total() == 5000 + 4


def test_flipped_byte_and_truncation_are_caught(tmp_path: Path) -> None:
    root = tmp_path / "criu"
    im = commit_image(root, 1)
    pages = im.path / "pages-1.img"
    data = bytearray(pages.read_bytes())
    data[1234] ^= 0x01
    pages.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorrupt, match=r"pages-1\.img: crc32c"):
        images.verify(im)
    pages.write_bytes(bytes(data[:100]))
    with pytest.raises(CheckpointCorrupt, match=r"pages-1\.img: size 100 bytes"):
        images.verify(im)


def test_a_checkpoint_that_is_not_an_image_is_refused(tmp_path: Path) -> None:
    with Transaction(tmp_path, "image-000001") as tx:
        (tx.path / "x").write_bytes(b"x")
        tx.commit({"kind": "step"})
    with pytest.raises(CheckpointCorrupt, match="not a CRIU image"):
        images.verify(images.Image(path=tmp_path / "image-000001", seq=1))


def test_prune_keeps_newest_and_latest_and_drops_stale_temp_dirs(tmp_path: Path) -> None:
    root = tmp_path / "criu"
    for seq in (1, 2, 3):
        commit_image(root, seq)
    stale = root / "image-000004.tmp-deadbeef"
    stale.mkdir()
    removed = images.prune(root, keep=2)
    assert sorted(p.name for p in removed) == ["image-000001", "image-000004.tmp-deadbeef"]
    assert [im.seq for im in images.committed(root)] == [2, 3]
    # LATEST is never deleted, even when retention alone would drop it.
    (root / "LATEST").write_text("image-000002\n")
    images.prune(root, keep=1)
    assert [im.seq for im in images.committed(root)] == [2, 3]


def _blocking(*signums: int) -> list[str]:
    """A command prefix that starts what follows with ``signums`` blocked, as a launcher that
    blocked them would (the mask is kept across exec; no ``preexec_fn`` in a threaded worker)."""
    if not signums:
        return []
    code = ("import os, signal, sys; signal.pthread_sigmask(signal.SIG_BLOCK, {{{}}}); "
            "os.execv(sys.argv[1], sys.argv[1:])".format(", ".join(str(int(n)) for n in signums)))
    return [sys.executable, "-c", code]


def _nsinit(tmp_path: Path, script: str, *, blocked: tuple[int, ...] = ()) -> tuple[subprocess.Popen, Path]:
    body = tmp_path / "child.py"
    body.write_text(script)
    out = tmp_path / "out"
    proc = subprocess.Popen([*_blocking(*blocked), sys.executable, "-I", "-S", str(NSINIT), "start", str(out),
                             str(tmp_path / "err"), "--", sys.executable, str(body)])
    deadline = time.monotonic() + 30
    while "ready" not in (out.read_text() if out.exists() else ""):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.02)
    return proc, out


def _signal_masks(pid: int) -> str:
    """The signal masks of ``pid`` and its children, to say why a signal was not acted on (this
    test timed out once in a fresh-clone CI run, in 8 runs)."""
    lines = []
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        kids = []
    for p in [str(pid), *kids]:
        try:
            status = Path(f"/proc/{p}/status").read_text().splitlines()
        except OSError:
            continue
        lines.append(f"{p}: " + " ".join(ln for ln in status if ln.startswith(("State", "Sig", "ShdPnd"))))
    return "; ".join(lines)


def _wait_or_explain(proc: subprocess.Popen, timeout: float) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        why = _signal_masks(proc.pid)
        proc.kill()
        raise AssertionError(f"no exit {timeout} s after the signal; {why}") from None


@pytest.mark.parametrize("blocked", [(), (signal.SIGTERM, signal.SIGCHLD)], ids=["mask-clear", "started-blocked"])
def test_nsinit_forwards_signals_and_returns_the_status(tmp_path: Path, blocked: tuple[int, ...]) -> None:
    # Started with SIGTERM blocked (inherited from a launcher), PID 1 unblocks what it forwards
    # and reaps; the job inherits the cleared mask and sees the signal too.
    proc, out = _nsinit(tmp_path, "import signal, sys, time\n"
                                  "signal.signal(signal.SIGTERM, lambda s, f: sys.exit(7))\n"
                                  "print('ready', flush=True)\n"
                                  "time.sleep(60)\n", blocked=blocked)
    proc.send_signal(signal.SIGTERM)
    assert _wait_or_explain(proc, 30) == 7


def test_nsinit_reports_death_by_signal_as_128_plus(tmp_path: Path) -> None:
    proc, out = _nsinit(tmp_path, "import time\nprint('ready', flush=True)\ntime.sleep(60)\n")
    proc.send_signal(signal.SIGUSR1)  # default action: terminate
    assert proc.wait(timeout=30) == 128 + signal.SIGUSR1


@pytest.mark.parametrize("kw, match", [
    ({"mode": "docker"}, "unknown --mode"),
    ({"on_restore_failure": "retry"}, "unknown --on-restore-failure"),
    ({"keep": 0}, "--keep must be >= 1"),
    ({"cmd": ()}, "no command given"),
    ({"dump_signals": (signal.SIGKILL,)}, "SIGKILL cannot trigger a dump"),
])
def test_run_options_are_validated(tmp_path: Path, kw: dict, match: str) -> None:
    args = {"dir": tmp_path, "cmd": ("true",), **kw}
    with pytest.raises(ConfigError, match=match):
        RunOptions(**args)


def test_run_cli_parses_options() -> None:
    from hpcckpt.cli.main import build_parser
    from hpcckpt.cli.run import options_from_args

    args = build_parser().parse_args(["run", "--dir", "/tmp/x", "--signal", "USR1,TERM", "--keep", "3",
                                      "--on-restore-failure", "fresh", "--", "python", "-c", "pass"])
    opts = options_from_args(args)
    assert opts.cmd == ("python", "-c", "pass")
    assert opts.dump_signals == (signal.SIGUSR1, signal.SIGTERM)
    assert (opts.keep, opts.on_restore_failure, opts.mode) == (3, "fresh", "criu")


@pytest.mark.parametrize("blocked", [(), (signal.SIGUSR2,)], ids=["mask-clear", "started-blocked"])
def test_app_mode_forwards_signals_and_passes_the_exit_status(tmp_path: Path, blocked: tuple[int, ...]) -> None:
    flag = tmp_path / "got"
    script = ("import signal, sys, time, pathlib\n"
              f"signal.signal(signal.SIGUSR2, lambda s, f: (pathlib.Path({str(flag)!r}).write_text('x'), sys.exit(42)))\n"
              "print('ready', flush=True)\n"
              "time.sleep(60)\n")
    proc = subprocess.Popen([*_blocking(*blocked), sys.executable, "-m", "hpcckpt.cli", "run", "--mode", "app",
                             "--dir", str(tmp_path), "--json", "--", sys.executable, "-c", script],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGUSR2)
    _wait_or_explain(proc, 60)  # the summary is one short JSON line: the pipe never fills
    with proc.stdout:
        out = proc.stdout.read()
    assert proc.returncode == 42 and flag.exists()
    assert json.loads(out)["exit_code"] == 42
    assert not (tmp_path / "criu").exists()
    assert os.path.isdir(tmp_path)


CATCHER = ("import signal, sys, time\n"
           "if sys.argv[1] == 'catch':\n"
           "    signal.signal(signal.SIGUSR2, lambda s, f: None)\n"
           "print('ready', flush=True)\n"
           "time.sleep(60)\n")


def _live(*args: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", CATCHER, *args], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


@pytest.mark.parametrize("mode, expected", [("catch", True), ("ignore", False)])
def test_sigcgt_says_whether_a_process_catches_the_signal(mode: str, expected: bool) -> None:
    from hpcckpt.criu.failure import catchers
    from hpcckpt.criu.ops import Job
    from hpcckpt.proc import tree as proctree

    with _live(mode) as proc:
        try:
            assert proctree.catches(proc.pid, signal.SIGUSR2) is expected
            job = Job(init_pid=proc.pid, app_pid=proc.pid, wait_pid=proc.pid, stdout=Path("x"), stderr=Path("y"))
            assert catchers(job, signal.SIGUSR2) == ([proc.pid] if expected else [])
        finally:
            proc.kill()


def test_failure_report_says_what_happened_and_what_to_change(tmp_path: Path) -> None:
    from hpcckpt.criu.failure import report
    from hpcckpt.criu.ops import Job

    commit_image(tmp_path, 3)
    with _live("ignore") as proc:
        try:
            job = Job(init_pid=proc.pid, app_pid=proc.pid, wait_pid=proc.pid, stdout=Path("x"), stderr=Path("y"))
            rep = report(job, signal.SIGUSR2, CriuError("criu dump failed (exit 1): no space"), root=tmp_path,
                         consumed=None)
        finally:
            proc.kill()
    text = "\n".join(rep.lines())
    assert "NOT forwarding SIGUSR2" in text and "image-000003" in text and "not requeueing" in text
    assert "too little space" in rep.fix and rep.as_dict()["requeue_from_older"] is False


def test_max_task_id_reads_the_core_images(tmp_path: Path) -> None:
    for tid in (2, 3, 17, 9):
        (tmp_path / f"core-{tid}.img").write_bytes(b"x")
    (tmp_path / "pages-1.img").write_bytes(b"x")
    assert images.max_task_id(tmp_path) == 17
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointCorrupt, match="no core"):
        images.max_task_id(empty)


def _pstree_entry(pid: int, ppid: int, pgid: int, sid: int, threads: list[int]) -> bytes:
    msg = b"".join(bytes([key << 3]) + _varint(v) for key, v in ((1, pid), (2, ppid), (3, pgid), (4, sid)))
    msg += b"".join(bytes([5 << 3]) + _varint(t) for t in threads)
    return len(msg).to_bytes(4, "little") + msg


def _varint(v: int) -> bytes:
    out = b""
    while True:
        byte, v = v & 0x7F, v >> 7
        out += bytes([byte | (0x80 if v else 0)])
        if not v:
            return out


def test_max_task_id_includes_session_and_group_ids_from_pstree(tmp_path: Path) -> None:
    # criu writes pstree.img as two magics, then size-prefixed PstreeEntry messages.
    # PID 3 is in a process group (300) whose leader exited: criu recreates that ID too.
    for tid in (2, 3, 4):
        (tmp_path / f"core-{tid}.img").write_bytes(b"x")
    head = (0x54564319).to_bytes(4, "little") + (0x50273030).to_bytes(4, "little")
    (tmp_path / "pstree.img").write_bytes(head + _pstree_entry(2, 0, 2, 2, [2, 4])
                                          + _pstree_entry(3, 2, 300, 2, [3]))
    assert images.pstree_ids(tmp_path / "pstree.img") == [2, 0, 2, 2, 2, 4, 3, 2, 300, 2, 3]
    assert images.max_task_id(tmp_path) == 300
    (tmp_path / "pstree.img").write_bytes(head + b"\x40\x00\x00\x00\x08")
    with pytest.raises(CheckpointCorrupt, match="pstree.img cannot be read"):
        images.max_task_id(tmp_path)


def test_doctor_sees_nccl_in_a_process_tree(tmp_path: Path) -> None:
    from hpcckpt.criu.doctor import unsupported

    from .test_cuda_driver import _mapper, build_fake

    with _mapper(build_fake(tmp_path, version=12080, name="libnccl.so.2")) as pid:
        assert any("uses NCCL" in p for p in unsupported(pid))
    with _live("ignore") as proc:
        try:
            assert not any("NCCL" in p for p in unsupported(proc.pid))
        finally:
            proc.kill()


def test_doctor_names_a_process_holding_gpu_files_without_libcuda(monkeypatch: pytest.MonkeyPatch) -> None:
    from hpcckpt.criu import doctor

    with _live("ignore") as proc:
        try:
            monkeypatch.setattr(doctor.proctree, "nvidia_handles",
                                lambda p: ["/dev/nvidiactl"] if p == proc.pid else [])
            said = doctor.unsupported(proc.pid)
            assert any(f"PID {proc.pid} (" in p and "without the CUDA driver" in p for p in said), said
        finally:
            proc.kill()


@pytest.mark.skipif(os.geteuid() != 0, reason="fresh PID + mount namespaces need root")
def test_doctor_starts_fresh_pid_and_mount_namespaces() -> None:
    from hpcckpt.criu.doctor import _namespace_check

    found = _namespace_check()
    assert found.ok and "--mount-proc" in found.detail


# -- newest image, stale images after a failed commit --------------------------------------

def test_newest_prefers_the_highest_committed_sequence_over_a_stale_latest(tmp_path: Path) -> None:
    # image 2 was renamed into place, then rewriting LATEST failed: LATEST still names 1.
    root = tmp_path / "criu"
    commit_image(root, 1)
    im2 = commit_image(root, 2)
    (root / "LATEST").write_text("image-000001\n")
    assert images.newest(root) == im2


def _supervisor(tmp_path: Path, **kw: object) -> tuple[object, list[str]]:
    from hpcckpt.criu.supervisor import Supervisor

    said: list[str] = []
    opts = RunOptions(dir=tmp_path, cmd=("true",), **kw)  # type: ignore[arg-type]
    return Supervisor(opts, log=said.append, cuda_driver=FakeCuda.shared), said


def test_images_behind_a_failed_commit_are_never_restored(tmp_path: Path) -> None:
    from hpcckpt.criu.supervisor import STALE

    root = tmp_path / "criu"
    commit_image(root, 1)
    commit_image(root, 2)
    sup, said = _supervisor(tmp_path, on_restore_failure="fail")
    assert images.mark(root, STALE) == "image-000002"
    assert (root / STALE).read_text().strip() == "image-000002"
    assert sup._restore_or_start() is None  # type: ignore[attr-defined]
    assert sup.outcome.action == "restore-failed" and "stale" in sup.outcome.detail  # type: ignore[attr-defined]
    assert "would rewind" in sup.outcome.detail  # type: ignore[attr-defined]
    failed = [json.loads(x) for x in (tmp_path / "ledger.jsonl").read_text().splitlines()]
    assert [e["image"] for e in failed if e["event"] == "criu_restore_failed"] == ["image-000002"]
    from hpcckpt.criu.failure import _older_image

    assert _older_image(root, None) is None  # a failed dump never offers a stale image as a fallback
    # A later successful dump is newer than the failed one: it is restorable again.
    commit_image(root, 3)
    assert _older_image(root, None) == "image-000003"
    assert not images.stale(root, images.newest(root))
    assert images.stale(root, images.Image(path=root / "image-000002", seq=2))


# -- a dump that fails after the CUDA checkpoint gives the GPUs back ----------------------

class FakeCuda:
    """Stands in for the driver's checkpoint API (no GPU here) and records every call."""

    instance: FakeCuda | None = None

    def __init__(self, *, fail_restore: tuple[int, ...] = ()) -> None:
        from hpcckpt.cuda import ProcessState

        self.calls: list[tuple[str, int]] = []
        self.states: dict[int, ProcessState] = {}
        self.fail_restore = fail_restore

    @classmethod
    def shared(cls) -> FakeCuda:
        assert cls.instance is not None
        return cls.instance

    def gpus(self) -> list:
        return []

    def probe(self, pid: int) -> object:
        return self.state(pid)

    def state(self, pid: int) -> object:
        from hpcckpt.cuda import ProcessState

        return self.states.get(pid, ProcessState.RUNNING)

    def lock(self, pid: int, *, timeout_ms: int = 0) -> None:
        from hpcckpt.cuda import ProcessState

        self.calls.append(("lock", pid))
        self.states[pid] = ProcessState.LOCKED

    def checkpoint(self, pid: int) -> None:
        from hpcckpt.cuda import ProcessState

        self.calls.append(("checkpoint", pid))
        self.states[pid] = ProcessState.CHECKPOINTED

    def restore(self, pid: int, pairs: object = None) -> None:
        from hpcckpt.cuda import CudaCallFailed, ProcessState

        self.calls.append(("restore", pid))
        if pid in self.fail_restore:
            raise CudaCallFailed(f"cuCheckpointProcessRestore(pid={pid}) failed: CUDA_ERROR_UNKNOWN (999)",
                                 code=999, name="CUDA_ERROR_UNKNOWN")
        self.states[pid] = ProcessState.LOCKED

    def unlock(self, pid: int) -> None:
        from hpcckpt.cuda import ProcessState

        self.calls.append(("unlock", pid))
        self.states[pid] = ProcessState.RUNNING


def test_resume_all_tries_every_pid_and_says_the_job_is_stuck() -> None:
    from hpcckpt.cuda import ProcessState
    from hpcckpt.cuda.group import resume_all
    from hpcckpt.errors import CudaCheckpointError

    cu = FakeCuda(fail_restore=(101,))
    for pid in (101, 102):
        cu.lock(pid)
        cu.checkpoint(pid)
    with pytest.raises(CudaCheckpointError, match=r"STUCK.*PID 101.*hpcckpt cuda restore"):
        resume_all(cu, [101, 102])  # type: ignore[arg-type]
    assert ("restore", 102) in cu.calls and ("unlock", 102) in cu.calls  # the failure did not stop the rest
    assert cu.states[102] is ProcessState.RUNNING and cu.states[101] is ProcessState.CHECKPOINTED


def _job_mapping_libcuda(tmp_path: Path, script: str) -> Iterator[object]:
    """``script`` run with a (stand-in) libcuda.so.1 it maps, as the supervisor's Job, once it
    says "ready"; killed afterwards."""
    from hpcckpt.criu.ops import Job

    from .test_cuda_driver import build_fake

    lib = build_fake(tmp_path / "m", version=12080, checkpoint=True, name="libcuda.so.1")
    with subprocess.Popen([sys.executable, "-c", script, str(lib)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True) as proc:
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
            yield Job(init_pid=proc.pid, app_pid=proc.pid, wait_pid=proc.pid, stdout=Path("o"), stderr=Path("e"),
                      proc=proc)
        finally:
            proc.kill()


@pytest.fixture
def cuda_job(tmp_path: Path) -> Iterator[object]:
    """A live process that maps a (stand-in) libcuda.so.1, as the supervisor's Job."""
    from .test_cuda_driver import MAPPER

    yield from _job_mapping_libcuda(tmp_path, MAPPER)


@pytest.mark.parametrize("restore_fails", [False, True], ids=["resumed", "stuck"])
def test_a_dump_failing_with_oserror_after_the_cuda_checkpoint_gives_the_gpu_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cuda_job: object, restore_fails: bool) -> None:
    import errno

    from hpcckpt.criu import dump
    from hpcckpt.criu.locate import Criu
    from hpcckpt.cuda import ProcessState

    pid = cuda_job.app_pid  # type: ignore[attr-defined]
    FakeCuda.instance = cu = FakeCuda(fail_restore=(pid,) if restore_fails else ())

    def no_space(*_a: object, **_k: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "criu" / "image-000001.tmp-x"))

    monkeypatch.setattr(dump, "Transaction", no_space)
    sup, said = _supervisor(tmp_path / "run")
    sup.tools.found = Criu(path=Path("/bin/false"), version="4.1.1", major=4, source="explicit")  # type: ignore[attr-defined]
    assert sup._on_dump_signal(cuda_job, signal.SIGUSR2) is None  # type: ignore[attr-defined]
    assert cu.calls[:2] == [("lock", pid), ("checkpoint", pid)]
    assert ("restore", pid) in cu.calls
    text = "\n".join(said)
    assert "No space left on device" in text
    if restore_fails:
        assert "CRIU DUMP FAILED; THE JOB MAY BE STUCK" in text and "keeps running" not in text
        assert "STUCK" in text and cu.states[pid] is ProcessState.CHECKPOINTED
    else:
        assert "CRIU DUMP FAILED; the job keeps running" in text
        assert cu.calls[2:] == [("restore", pid), ("unlock", pid)] and cu.states[pid] is ProcessState.RUNNING
        assert "restored and unlocked after the failed dump" in text
    assert cuda_job.poll() is None  # type: ignore[attr-defined]  # the job runs on
    failed = [json.loads(x) for x in (tmp_path / "run" / "ledger.jsonl").read_text().splitlines()
              if json.loads(x)["event"] == "criu_dump_failed"]
    assert len(failed) == 1 and failed[0]["job_ended"] is False


# -- the job's exit status is the supervisor's to collect ----------------------------------

@pytest.mark.skipif(os.geteuid() != 0, reason="fresh PID + mount namespaces need root")
def test_job_status_survives_a_later_subprocess(tmp_path: Path) -> None:
    from hpcckpt.criu import ops
    from hpcckpt.proc import tree as proctree

    flag = tmp_path / "go"
    job = ops.launch(["sh", "-c", f"while [ ! -e {flag} ]; do sleep 0.05; done; exit 7"],
                     stdout=tmp_path / "o", stderr=tmp_path / "e", log=tmp_path / "log")
    sup, _ = _supervisor(tmp_path / "run")
    assert sup._reap(job) is None  # type: ignore[attr-defined]
    flag.touch()
    deadline = time.monotonic() + 60
    while proctree.alive(job.wait_pid) and time.monotonic() < deadline:  # exits, not yet collected
        time.sleep(0.02)
    # Any Popen reaps the children of Popen objects that were dropped: it must not find the job's.
    subprocess.run(["true"], check=True)
    code = None
    while code is None and time.monotonic() < deadline:
        code = sup._reap(job)  # type: ignore[attr-defined]
        time.sleep(0.02)
    assert code == 7


@pytest.mark.skipif(os.geteuid() != 0, reason="fresh PID + mount namespaces need root")
def test_run_passes_a_failed_jobs_status(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "hpcckpt.cli", "run", "--mode", "criu", "--dir", str(tmp_path),
                           "--json", "--", "sh", "-c", "exit 7"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 7, proc.stderr
    assert json.loads(proc.stdout)["exit_code"] == 7


CTX_FAKE = r"""
int cuInit(unsigned f) { (void)f; return 0; }
int cuDeviceGetCount(int *n) { *n = 1; return 0; }
int cuDeviceGet(int *d, int i) { *d = i; return 0; }
int cuDevicePrimaryCtxRetain(void **c, int d) { (void)d; *c = 0; return CTX_RC; }
int cuDevicePrimaryCtxRelease(int d) { (void)d; return 0; }
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="fresh PID + mount namespaces need root")
@pytest.mark.parametrize("ctx_rc", [0, 304])
def test_doctor_probe_creates_a_context_in_the_job_namespaces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                ctx_rc: int) -> None:
    # cuInit and the device count succeed either way; error 304 came from creating a context.
    import shutil

    from hpcckpt.criu.doctor import _cuda_in_namespaces

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the stand-in libcuda")
    (tmp_path / "ctx.c").write_text(CTX_FAKE)
    lib = tmp_path / "libcuda-ctx.so"
    subprocess.run([cc, "-shared", "-fPIC", f"-DCTX_RC={ctx_rc}", "-o", str(lib), str(tmp_path / "ctx.c")], check=True)
    monkeypatch.setenv("HPCCKPT_LIBCUDA", str(lib))
    found = _cuda_in_namespaces()
    assert found.ok is (ctx_rc == 0), found.detail
    assert ("a context on device 0" in found.detail) if ctx_rc == 0 else ("304" in found.detail and found.fix)


@pytest.mark.skipif(os.geteuid() != 0, reason="fresh PID + mount namespaces need root")
def test_nsinit_writes_to_its_log_never_to_the_jobs_files(tmp_path: Path) -> None:
    from hpcckpt.criu import ops

    out, err, log = tmp_path / "job.out", tmp_path / "job.err", tmp_path / "unshare.log"
    job = ops.launch(["sh", "-c", "echo hello; echo oops >&2; exec sleep 60"], stdout=out, stderr=err, log=log)
    try:
        deadline = time.monotonic() + 60
        while not (err.exists() and err.read_text()) and time.monotonic() < deadline:  # the job is up
            time.sleep(0.02)
        assert {os.readlink(f"/proc/{job.init_pid}/fd/{fd}") for fd in (1, 2)} == {str(log)}
        assert os.readlink(f"/proc/{job.app_pid}/fd/1") == str(out)
        assert os.readlink(f"/proc/{job.app_pid}/fd/2") == str(err)
    finally:
        ops.kill_tree(job)
        assert job.proc is not None
        job.proc.wait(timeout=60)
    assert out.read_text() == "hello\n" and err.read_text() == "oops\n"


# A process that maps a stand-in libcuda and exits with the status written to its stdin.
EXITER = ("import ctypes, sys, time\nctypes.CDLL(sys.argv[1])\nprint('ready', flush=True)\n"
          "sys.exit(int(sys.stdin.readline()))\n")


@pytest.fixture
def exiting_job(tmp_path: Path) -> Iterator[object]:
    yield from _job_mapping_libcuda(tmp_path, EXITER)


@pytest.mark.parametrize("how", ["exits-3", "exits-0-while-TERM-pending", "killed-by-TERM"])
def test_job_that_ends_during_the_cuda_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exiting_job: object,
                                            how: str) -> None:
    # The seam: the driver's lock. The job ends while it is being locked and the driver then
    # fails. A normal exit is its natural end (no requeue, nothing stale); killed by TERM from
    # outside (Slurm's time limit or preemption), or exiting while a TERM is pending here, it
    # did not end naturally: images STALE and a requeue, so the next run falls back.
    from hpcckpt.criu.locate import Criu
    from hpcckpt.cuda import CudaCallFailed

    proc = exiting_job.proc  # type: ignore[attr-defined]

    class EndsDuringLock(FakeCuda):
        def lock(self, pid: int, *, timeout_ms: int = 0) -> None:
            if how == "killed-by-TERM":
                os.kill(pid, signal.SIGTERM)
            else:
                proc.stdin.write("3\n" if how == "exits-3" else "0\n")
                proc.stdin.flush()
            proc.wait(timeout=60)
            raise CudaCallFailed(f"cuCheckpointProcessLock(pid={pid}) failed: CUDA_ERROR_UNKNOWN (999)",
                                 code=999, name="CUDA_ERROR_UNKNOWN")

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    FakeCuda.instance = EndsDuringLock()
    commit_image(tmp_path / "run" / "criu", 1)
    sup, said = _supervisor(tmp_path / "run")
    sup.tools.found = Criu(path=Path("/bin/false"), version="4.1.1", major=4, source="explicit")  # type: ignore[attr-defined]
    if how == "exits-0-while-TERM-pending":
        sup.pending.append(signal.SIGTERM)  # type: ignore[attr-defined]
    code = sup._on_dump_signal(exiting_job, signal.SIGUSR2)  # type: ignore[attr-defined]
    events = [json.loads(x) for x in (tmp_path / "run" / "ledger.jsonl").read_text().splitlines()]
    failed = [e for e in events if e["event"] == "criu_dump_failed"]
    if how == "exits-3":
        assert code == 3 and sup.outcome.action == "exited"  # type: ignore[attr-defined]
        assert not (tmp_path / "run" / "criu" / "STALE").exists()
        assert any("ended by itself" in line for line in said), said
        assert "requeue" not in [e["event"] for e in events]
        assert [e.get("exited_itself") for e in failed] == [True]
    else:
        assert sup.outcome.action == "requeue"  # type: ignore[attr-defined]
        assert (tmp_path / "run" / "criu" / "STALE").read_text().strip() == "image-000001"
        assert [e["event"] for e in events].count("requeue") == 1
        assert len(failed) == 1 and failed[0]["job_ended"] is True and not failed[0].get("exited_itself")
        text = "\n".join(said)
        assert ("status 143: killed by SIGTERM from outside" in text if how == "killed-by-TERM" else
                "exited with status 0 while this run was being told to stop (SIGTERM)" in text), text


def test_a_process_the_driver_reports_failed_is_never_called_restored() -> None:
    # The seam: the state the driver reports. FAILED is neither restored nor unlocked.
    from hpcckpt.cuda import ProcessState
    from hpcckpt.cuda.group import restore_all, resume_all
    from hpcckpt.errors import CudaCheckpointError

    cu = FakeCuda()
    cu.states = {201: ProcessState.CHECKPOINTED, 202: ProcessState.FAILED}
    with pytest.raises(CudaCheckpointError, match=r"did not leave them running: PID 202 is in CUDA state FAILED"):
        restore_all(cu, [201, 202])  # type: ignore[arg-type]
    assert cu.states[201] is ProcessState.RUNNING and ("restore", 202) not in cu.calls
    cu.states = {201: ProcessState.CHECKPOINTED, 202: ProcessState.FAILED}
    with pytest.raises(CudaCheckpointError, match=r"STUCK.*PID 202 is in CUDA state FAILED"):
        resume_all(cu, [201, 202])  # type: ignore[arg-type]
    assert cu.states[201] is ProcessState.RUNNING
    restore_all(cu, [201])  # type: ignore[arg-type]  # RUNNING already: nothing to say


# A stuck lock with the real driver wrapper and its per-PID guard: test_cuda_driver.py
# (test_a_stuck_lock_never_stops_the_peers_being_given_back).


def test_a_state_query_that_hangs_fails_the_dump_with_the_job_running(tmp_path: Path, cuda_job: object) -> None:
    # The seam: the driver's state query does not answer. Nothing was locked: not STUCK.
    from hpcckpt.criu.locate import Criu
    from hpcckpt.cuda.driver import CudaQueryTimedOut

    class QueryHangs(FakeCuda):
        def probe(self, pid: int) -> object:
            raise CudaQueryTimedOut(f"could not query PID {pid}'s CUDA state: cuCheckpointProcessGetState(pid={pid}) "
                                    "did not return within 30 s (nothing was changed in the process)")

    FakeCuda.instance = cu = QueryHangs()
    sup, said = _supervisor(tmp_path / "run")
    sup.tools.found = Criu(path=Path("/bin/false"), version="4.1.1", major=4, source="explicit")  # type: ignore[attr-defined]
    assert sup._on_dump_signal(cuda_job, signal.SIGUSR2) is None  # type: ignore[attr-defined]
    text = "\n".join(said)
    assert "CRIU DUMP FAILED; the job keeps running" in text and "could not query" in text
    assert "did not answer a state query" in text and "MAY BE STUCK" not in text
    assert cu.calls == [] and cuda_job.poll() is None  # type: ignore[attr-defined]
    failed = [json.loads(x) for x in (tmp_path / "run" / "ledger.jsonl").read_text().splitlines()
              if json.loads(x)["event"] == "criu_dump_failed"]
    assert len(failed) == 1 and failed[0]["stuck"] is False


@pytest.mark.parametrize("left", ["LOCKED", "CHECKPOINTED", "failed"])
def test_a_stuck_call_that_returns_late_is_undone_by_the_supervisor(tmp_path: Path, cuda_job: object,
                                                                   left: str) -> None:
    # The seam: the driver wrapper's record of a call that was reported STUCK and returned late.
    from hpcckpt.cuda import ProcessState, driver

    pid = cuda_job.app_pid  # type: ignore[attr-defined]
    FakeCuda.instance = cu = FakeCuda()
    state = None if left == "failed" else ProcessState[left]
    if state is not None:
        cu.states[pid] = state
    what = "Checkpoint" if left == "CHECKPOINTED" else "Lock"
    with driver._STUCK_LOCK:
        driver._LATE.append(driver.LateReturn(pid=pid, what=what, name=f"cuCheckpointProcess{what}(pid={pid})",
                                              result="succeeded" if state else "failed: CUDA_ERROR_UNKNOWN (999)",
                                              left=state, after_s=700.0))
    sup, said = _supervisor(tmp_path / "run")
    sup.dumper.resume_late()  # type: ignore[attr-defined]
    text = "\n".join(said)
    assert f"cuCheckpointProcess{what}(pid={pid}), reported STUCK, returned after 700 s" in text
    if state is None:
        assert cu.calls == [] and "restored and unlocked" not in text
    else:
        assert cu.calls == ([("restore", pid), ("unlock", pid)] if state is ProcessState.CHECKPOINTED else
                            [("unlock", pid)])
        assert cu.states[pid] is ProcessState.RUNNING and f"PID {pid} restored and unlocked after its late" in text
    events = [json.loads(x) for x in (tmp_path / "run" / "ledger.jsonl").read_text().splitlines()]
    assert [e["left"] for e in events if e["event"] == "cuda_late_return"] == [state.name if state else None]
    assert driver.take_late_returns() == []  # each is handled once


# A stand-in for nsjoin: it starts a child (the stand-in criu, which records its PID and
# would run for a minute), then waits for it.
NSJOIN_STANDIN = ("import os, sys, time\nif os.fork() == 0:\n"
                  "    open(sys.argv[1] + '.tmp', 'w').write(str(os.getpid()))\n"
                  "    os.rename(sys.argv[1] + '.tmp', sys.argv[1])\n    time.sleep(60)\n    os._exit(0)\nos.wait()\n")


def test_a_criu_that_is_given_up_on_is_gone_before_anything_else_runs(tmp_path: Path) -> None:
    # While criu lives it may hold the job's tasks traced; the CUDA undo after a failed dump
    # needs them running. end_criu returns only once nsjoin and the criu under it are gone.
    from hpcckpt.criu.ops import end_criu
    from hpcckpt.proc import tree as proctree

    pidfile = tmp_path / "criu.pid"
    proc = subprocess.Popen([sys.executable, "-c", NSJOIN_STANDIN, str(pidfile)], start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not pidfile.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        criu_pid = int(pidfile.read_text())
        assert proctree.alive(criu_pid)
        assert end_criu(proc) == []
        assert not proctree.alive(criu_pid) and proc.returncode is not None
    finally:
        if proc.returncode is None:
            proc.kill()
            proc.wait()


def test_a_criu_run_past_its_timeout_is_killed_with_its_children(tmp_path: Path) -> None:
    from hpcckpt.criu.ops import _run_criu
    from hpcckpt.proc import tree as proctree

    pidfile = tmp_path / "criu.pid"
    with pytest.raises(CriuError, match=r"criu dump did not finish within 0 s \(killed\)"):
        _run_criu([sys.executable, "-c", NSJOIN_STANDIN, str(pidfile)], "dump", log=tmp_path / "dump.log",
                  timeout_s=0.2)
    if pidfile.exists():  # forked before the timeout (or not: then there was nothing to end)
        pid, deadline = int(pidfile.read_text()), time.monotonic() + 60
        while proctree.alive(pid) and time.monotonic() < deadline:  # SIGKILLed: gone at once, or nearly
            time.sleep(0.01)
        assert not proctree.alive(pid)
