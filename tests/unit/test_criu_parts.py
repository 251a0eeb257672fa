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


def _nsinit(tmp_path: Path, script: str) -> tuple[subprocess.Popen, Path]:
    body = tmp_path / "child.py"
    body.write_text(script)
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-I", "-S", str(NSINIT), "start", str(out), str(tmp_path / "err"), "--",
                             sys.executable, str(body)])
    deadline = time.monotonic() + 30
    while "ready" not in (out.read_text() if out.exists() else ""):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.02)
    return proc, out


def test_nsinit_forwards_signals_and_returns_the_status(tmp_path: Path) -> None:
    proc, out = _nsinit(tmp_path, "import signal, sys, time\n"
                                  "signal.signal(signal.SIGTERM, lambda s, f: sys.exit(7))\n"
                                  "print('ready', flush=True)\n"
                                  "time.sleep(60)\n")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 7


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


def test_app_mode_forwards_signals_and_passes_the_exit_status(tmp_path: Path) -> None:
    flag = tmp_path / "got"
    script = ("import signal, sys, time, pathlib\n"
              f"signal.signal(signal.SIGUSR2, lambda s, f: (pathlib.Path({str(flag)!r}).write_text('x'), sys.exit(42)))\n"
              "print('ready', flush=True)\n"
              "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-m", "hpcckpt.cli", "run", "--mode", "app", "--dir", str(tmp_path),
                             "--json", "--", sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGUSR2)
    out, _ = proc.communicate(timeout=60)
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
    from hpcckpt.proc import tree as proctree
    from hpcckpt.criu.failure import catchers
    from hpcckpt.criu.ops import Job

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


@pytest.mark.skipif(os.geteuid() != 0, reason="fresh PID + mount namespaces need root")
def test_doctor_starts_fresh_pid_and_mount_namespaces() -> None:
    from hpcckpt.criu.doctor import _namespace_check

    found = _namespace_check()
    assert found.ok and "--mount-proc" in found.detail
