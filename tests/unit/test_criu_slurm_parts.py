"""The parts of CRIU mode that face the scheduler, each at its own seam.

What the job is started with (TERM ignored), what is seen to be undumpable (a real
io_uring instance), the end-time watch on a fast-forward clock, the accounting of lost
progress, the image chains of periodic dumps, the template's refusals and the doctor's
preemption checks.
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

from hpcckpt.criu import dumpable, images, ops
from hpcckpt.criu.watch import Progress, Tee
from hpcckpt.errors import CheckpointCorrupt, ConfigError
from hpcckpt.lifecycle.supervise import EndTimeWatch


def _sig_ignored(pid: int, sig: int) -> bool:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return bool(int(line.split()[1], 16) & (1 << (sig - 1)))
    raise AssertionError("no SigIgn line")


@pytest.mark.skipif(os.geteuid() != 0, reason="PID + mount namespaces need root")
def test_job_starts_with_the_dump_signals_ignored_and_survives_term(tmp_path: Path) -> None:
    out, err, log = tmp_path / "o", tmp_path / "e", tmp_path / "log"
    job = ops.launch(["sh", "-c", "echo up; exec sleep 60"], stdout=out, stderr=err, log=log,
                     ignore=(signal.SIGUSR2, signal.SIGTERM))
    try:
        deadline = time.monotonic() + 30
        while not (out.exists() and out.read_text()) and time.monotonic() < deadline:
            time.sleep(0.02)  # until the command runs (exec'd)
        assert _sig_ignored(job.app_pid, signal.SIGTERM) and _sig_ignored(job.app_pid, signal.SIGUSR2)
        assert not _sig_ignored(job.app_pid, signal.SIGINT)
        os.kill(job.app_pid, signal.SIGTERM)  # what Slurm sends every process of the job
        time.sleep(0.3)
        assert job.poll() is None, "the job died of a TERM it should ignore"
    finally:
        ops.kill_tree(job)
        job.proc.wait(timeout=30)  # type: ignore[union-attr]


IO_URING_SETUP = 425  # x86-64 and arm64 syscall number


@pytest.mark.skipif(sys.platform != "linux", reason="Linux only")
def test_an_io_uring_is_named_with_what_to_do(tmp_path: Path) -> None:
    holder = subprocess.Popen([sys.executable, "-c", (
        "import ctypes, sys, time\n"
        "params = ctypes.create_string_buffer(120)\n"
        f"fd = ctypes.CDLL(None, use_errno=True).syscall({IO_URING_SETUP}, 4, params)\n"
        "print(fd, flush=True)\n"
        "time.sleep(60)\n")], stdout=subprocess.PIPE, text=True)
    try:
        fd = int(holder.stdout.readline())  # type: ignore[union-attr]
        if fd < 0:
            pytest.skip("io_uring is disabled on this kernel")
        found = dumpable.problems(holder.pid)
        assert [(p.pid, p.fd) for p in found] == [(holder.pid, fd)]
        text = "\n".join(dumpable.lines(found))
        assert "io_uring" in text and "hpcckpt template torchrun" in text and "keeps running" in text
        assert holder.poll() is None  # looked at, never touched
    finally:
        holder.kill()
        holder.communicate()


def test_an_established_tcp_connection_is_named_unless_allowed() -> None:
    import socket

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    client = socket.create_connection(server.getsockname())
    peer, _ = server.accept()
    try:
        found = dumpable.problems(os.getpid())
        assert {p.fd for p in found} >= {client.fileno(), peer.fileno()}
        assert all("--tcp-established" in p.what for p in found)
        assert dumpable.problems(os.getpid(), tcp_allowed=True) == []
    finally:
        for s in (client, peer, server):
            s.close()


def test_end_time_watch_sees_a_preemption_once_on_a_fast_forward_clock() -> None:
    now = [0.0]
    ends = [1000.0]
    watch = EndTimeWatch(lambda: ends[0], poll_s=10, clock=lambda: now[0])
    assert not watch.moved()  # first read: the end as the job started
    ends[0] = 990.0  # pulled in, but not read before the next poll
    now[0] = 5.0
    assert not watch.moved()
    now[0] = 10.0
    assert watch.moved() and watch.pulled_in
    now[0] = 20.0
    assert not watch.moved()  # said once
    later = EndTimeWatch(lambda: 2000.0, poll_s=10, clock=lambda: now[0])
    later.moved()
    later.refresh()
    assert not later.pulled_in  # an unchanged end is no notice


def test_end_time_watch_survives_a_scheduler_that_does_not_answer() -> None:
    def broken() -> float:
        raise OSError("scontrol: Unable to contact slurm controller")

    watch = EndTimeWatch(broken, poll_s=1, clock=lambda: 0.0)
    assert not watch.moved() and watch.remaining_s() is None


def test_lost_progress_is_exact_after_a_stop_and_a_lower_bound_after_a_vanished_run() -> None:
    run = [{"event": "start", "progress_s": 0.0}, {"event": "criu_dump", "progress_s": 30.0},
           {"event": "stop", "reason": "preemption", "progress_s": 30.0}]
    assert Progress.lost_since(run, 30.0) == {"lost_s": 0.0, "lost_exact": True}
    assert Progress.lost_since([], 0.0) == {}
    vanished = [{"event": "criu_restore", "progress_s": 30.0}, {"event": "criu_dump", "progress_s": 90.0,
                                                                "periodic": True}]
    assert Progress.lost_since(vanished, 60.0) == {"lost_s": 30.0, "lost_exact": False}
    assert Progress.lost_since([{"event": "start"}], 0.0) == {"lost_s": None, "lost_exact": False}


def test_tee_copies_what_the_job_appends(tmp_path: Path) -> None:
    src = tmp_path / "job.out"
    src.write_bytes(b"step 1\n")
    r, w = os.pipe()
    tee = Tee([(src, w)], interval_s=0.01)
    tee.start()
    with open(src, "ab") as f:
        f.write(b"step 2\n")
    tee.close()
    os.close(w)
    assert os.read(r, 100) == b"step 1\nstep 2\n"
    os.close(r)


def _image(root: Path, seq: int, parent: int | None = None) -> images.Image:
    path = root / images.image_name(seq)
    path.mkdir(parents=True)
    (path / "manifest.json").write_text("{}")
    if parent is not None:
        os.symlink(f"../{images.image_name(parent)}", path / images.PARENT)
    return images.Image(path=path, seq=seq)


def test_retention_keeps_the_images_a_kept_image_takes_pages_from(tmp_path: Path) -> None:
    _image(tmp_path, 1)
    _image(tmp_path, 2)
    _image(tmp_path, 3, parent=2)
    newest = _image(tmp_path, 4, parent=3)
    assert [im.seq for im in images.chain(newest)] == [4, 3, 2]
    removed = images.prune(tmp_path, keep=1)
    assert [p.name for p in removed] == [images.image_name(1)]
    assert [im.seq for im in images.committed(tmp_path)] == [2, 3, 4]


def test_a_chain_with_a_missing_parent_is_refused(tmp_path: Path) -> None:
    broken = _image(tmp_path, 5, parent=4)
    with pytest.raises(CheckpointCorrupt, match="cannot be restored"):
        images.chain(broken)


@pytest.mark.parametrize(("key", "value"), [("SIGNAL", "USR2,TERM"), ("LEAD_S", "3m"), ("TIME", "1h"),
                                            ("CPUS_PER_TASK", "0"), ("DUMP_EVERY_S", "-5")])
def test_template_refuses_what_sbatch_cannot_read_naming_the_parameter(key: str, value: str) -> None:
    from hpcckpt.cluster import render

    with pytest.raises(ConfigError, match=key):
        render.render("criu", {key: value})


def test_template_cli_refusal_is_one_line_not_a_traceback() -> None:
    proc = subprocess.run([sys.executable, "-m", "hpcckpt.cli", "template", "criu", "--set", "SIGNAL=USR2,TERM"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "SIGNAL" in proc.stderr and "Traceback" not in proc.stderr


def test_criu_template_dumps_on_term_and_ignores_it_until_the_supervisor_runs() -> None:
    from hpcckpt.cluster import render

    text = render.render("criu", {"DUMP_EVERY_S": "600"})
    assert "--signal=B:USR2@180" in text and '--signal "${HPCCKPT_CRIU_SIGNAL:-USR2,TERM}"' in text
    assert "trap '' USR2 TERM" in text and "--dump-every 600" in text


def _ctx(config: dict[str, str], script: str = ""):  # type: ignore[no-untyped-def]
    from hpcckpt.doctor import DoctorContext

    return DoctorContext(script_text=script, slurm_config=config)


@pytest.mark.parametrize(("config", "on"), [
    ({"SchedulerParameters": "sched_interval=2,preempt_send_user_signal"}, True),
    ({"PreemptParameters": "send_user_signal,strict_order"}, True),
    ({"SchedulerParameters": "sched_interval=2"}, False)])
def test_doctor_says_whether_preemption_sends_the_user_signal(config: dict[str, str], on: bool) -> None:
    from hpcckpt.doctor import check_preempt_signal

    [check] = check_preempt_signal(_ctx({**config, "KillWait": "30 sec"}))
    assert check.data["send_user_signal"] is on
    assert "CRIU" in check.detail and "In-process" in check.detail and "KillWait=30 sec" in check.detail
    assert bool(check.fix) is not on


def test_doctor_says_whether_requeue_expedite_exists() -> None:
    from hpcckpt.doctor import check_requeue_expedite

    assert check_requeue_expedite(_ctx({"SLURM_VERSION": "22.05.8"}))[0].data["expedite"] is False
    assert check_requeue_expedite(_ctx({"SLURM_VERSION": "25.11.0"}))[0].data["expedite"] is True


def test_doctor_warns_of_a_criu_script_that_does_not_dump_on_term() -> None:
    from hpcckpt.doctor import check_criu_script

    bad = "#!/bin/bash\nexec hpcckpt run --mode criu --dir d --signal USR2 -- python train.py\n"
    [check] = check_criu_script(_ctx({}, bad))
    assert check.severity == "warn" and "USR2,TERM" in check.fix
    shipped = (Path(__file__).resolve().parents[2] / "jobscripts" / "criu.sbatch").read_text()
    assert check_criu_script(_ctx({}, shipped))[0].ok


def test_run_cli_defaults_dump_on_term_and_takes_dump_every() -> None:
    from hpcckpt.cli.main import build_parser
    from hpcckpt.cli.run import options_from_args

    opts = options_from_args(build_parser().parse_args(["run", "--dir", "/tmp/x", "--dump-every", "300", "--",
                                                        "true"]))
    assert opts.dump_signals == (signal.SIGUSR2, signal.SIGTERM) and opts.dump_every_s == 300.0
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "--dir", "/tmp/x", "--dump-every", "-1", "--", "true"])


def test_ledger_json_roundtrip_of_a_problem() -> None:
    p = dumpable.Problem(pid=7, inner_pid=2, command="torchrun", fd=9, what="an io_uring instance")
    assert json.loads(json.dumps(p.as_dict()))["what"] == "an io_uring instance"
    assert "PID 2 in the job" in p.text()


URING_JOB = ("import ctypes, time\n"
             f"ctypes.CDLL(None).syscall({IO_URING_SETUP}, 4, ctypes.create_string_buffer(120))\n"
             "print('ready', flush=True)\n"
             "time.sleep(120)\n")


@pytest.mark.skipif(os.geteuid() != 0, reason="PID + mount namespaces need root")
def test_doctor_mode_criu_tries_a_command_and_names_what_criu_refuses(tmp_path: Path) -> None:
    from hpcckpt.criu.doctor import trial

    check, *_ = trial([sys.executable, "-c", URING_JOB], wait_s=5, run_dir=tmp_path)  # then TERM, sandbox
    if check.ok and "io_uring" not in check.detail:
        pytest.skip("io_uring is disabled on this kernel")
    assert check.severity == "warn" and "io_uring" in check.detail and "torchrun" in check.fix
    quiet, *_ = trial(["sleep", "30"], wait_s=1, run_dir=tmp_path)
    assert quiet.ok and "nothing criu refuses" in quiet.detail


def test_doctor_takes_a_command_only_with_mode_criu() -> None:
    proc = subprocess.run([sys.executable, "-m", "hpcckpt.cli", "doctor", "--no-plugins", "--", "true"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--mode criu" in proc.stderr and "Traceback" not in proc.stderr


class _Watch:
    """An end-time watch frozen at ``left`` seconds before the end."""

    def __init__(self, left: float, pulled_in: bool = False) -> None:
        self.left, self.pulled_in = left, pulled_in

    def refresh(self) -> None:
        pass

    def remaining_s(self) -> float:
        return self.left


@pytest.mark.parametrize(("left", "pulled_in", "sig", "cause", "deferred"), [
    (40.0, False, signal.SIGUSR2, "time_limit", True),    # B:USR2@10 delivered 30 s early by the tick
    (12.0, False, signal.SIGUSR2, "time_limit", False),   # on time: at once
    (40.0, False, signal.SIGTERM, "time_limit", False),   # TERM never waits
    (500.0, False, signal.SIGUSR2, "signal", False),      # scancel --signal=USR2 long before the end
    (8.0, True, signal.SIGUSR2, "preemption", False)])    # the end was pulled in
def test_an_early_time_limit_warning_waits_for_its_lead(tmp_path: Path, left: float, pulled_in: bool,
                                                        sig: signal.Signals, cause: str, deferred: bool) -> None:
    from hpcckpt.criu.supervisor import RunOptions, Supervisor

    sup = Supervisor(RunOptions(dir=tmp_path, cmd=("true",), lead_s=10.0), log=lambda _m: None)
    sup.timing.watch = _Watch(left, pulled_in)  # type: ignore[assignment]
    assert sup.timing.cause(sig) == cause
    assert sup.timing.defer(sig, cause, True) is deferred
    if deferred:
        assert sup.timing.stop_at is not None and sup.timing.stop_at - time.monotonic() <= 25  # end - max(10, 15)


def test_a_warning_in_an_allocation_shorter_than_the_lead_waits_for_the_end(tmp_path: Path) -> None:
    # --time-min granted 120 s against the template's B:USR2@180: the warning comes at the
    # start. The dump waits until a quarter of the allocation before the end (30 s), or
    # three times the measured dump cost when that is more, never dumping at the warning.
    from hpcckpt.criu.supervisor import RunOptions, Supervisor
    from hpcckpt.lifecycle.ledger import Ledger

    sup = Supervisor(RunOptions(dir=tmp_path, cmd=("true",), lead_s=180.0), log=lambda _m: None)
    sup.timing.watch = _Watch(120.0)  # type: ignore[assignment]
    assert sup.timing.cause(signal.SIGUSR2) == "time_limit"
    assert sup.timing.defer(signal.SIGUSR2, "time_limit", True)
    assert sup.timing.stop_at is not None and 60 < sup.timing.stop_at - time.monotonic() <= 90  # 120 - max(120 / 4, 15)
    Ledger(tmp_path).append("criu_dump", image="x", dump_s=14.0, commit_s=1.0)  # measured: 15 s, x3 = 45 s
    sup.timing.stop_at = None
    assert sup.timing.defer(signal.SIGUSR2, "time_limit", True)
    assert sup.timing.stop_at is not None and sup.timing.stop_at - time.monotonic() <= 75  # 120 - 45
    sup.timing.stop_at = None
    sup.timing.watch = _Watch(40.0)  # the dump needs more than is left: at once
    assert not sup.timing.defer(signal.SIGUSR2, "time_limit", True) and sup.timing.stop_at is None


def test_a_restart_with_no_image_says_so_and_records_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    # A restarted job (Slurm's or the local restart count, or an unfinished earlier run in the
    # ledger) with no image to restore: one line on stderr, and `no_image` on its start event.
    from hpcckpt.cli.main import main
    from hpcckpt.criu.supervisor import RunOptions, Supervisor
    from hpcckpt.lifecycle.ledger import Ledger
    from hpcckpt.lifecycle.restart import RESTART_ENV

    for var in [k for k in os.environ if k.startswith("SLURM_") or k == RESTART_ENV]:
        monkeypatch.delenv(var)
    procs: list[subprocess.Popen[bytes]] = []

    def launch(cmd: list[str], *, stdout: Path, stderr: Path, **_kw: object) -> ops.Job:
        for path in (stdout, stderr):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch()
        procs.append(subprocess.Popen(["true"]))
        pid = procs[-1].pid
        return ops.Job(init_pid=pid, app_pid=pid, wait_pid=pid, stdout=stdout, stderr=stderr, proc=procs[-1])

    monkeypatch.setattr(ops, "launch", launch)

    def start(run_dir: Path) -> list[str]:
        said: list[str] = []
        sup = Supervisor(RunOptions(dir=run_dir, cmd=("train",)), log=said.append)
        try:
            assert sup._restore_or_start() is not None
        finally:
            sup._close_tee()
            procs[-1].wait(timeout=30)
        return [m for m in said if "NO CRIU IMAGE" in m]

    assert start(tmp_path) == []  # a first start is no restart
    [line] = start(tmp_path)  # the first run vanished (killed before any image): the ledger says so
    assert "\n" not in line and "did not finish" in line and "starts from the beginning" in line, line
    starts = [e for e in Ledger(tmp_path).read() if e["event"] == "start"]
    assert starts[0]["no_image"] is None and "did not finish" in starts[1]["no_image"]
    monkeypatch.setenv(RESTART_ENV, "2")
    [line] = start(tmp_path / "restarted")  # restarted, and this directory never had a run
    assert "restart 2" in line, line
    capsys.readouterr()
    assert main(["history", str(tmp_path)]) == 0
    table = capsys.readouterr().out
    assert "! #1: the next run started from the beginning: there was no image (an earlier run" in table, table
    assert " none " in table.splitlines()[1], table


def test_an_end_time_pulled_in_hours_ahead_is_a_shortened_limit_not_a_preemption(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # An operator shortens the limit to 3 h from now: no dump and no requeue now, the dump is
    # re-planned for the lead before the new end. A preemption after it (the end pulled in to
    # now + GraceTime) still dumps at once.
    from hpcckpt.criu.supervisor import RunOptions, Supervisor

    said: list[str] = []
    sup = Supervisor(RunOptions(dir=tmp_path, cmd=("true",), lead_s=180.0), log=said.append)
    sup.dumper.checks_at = []
    clock, end = [0.0], [time.time() + 8 * 3600]
    sup.timing.watch = EndTimeWatch(lambda: end[0], poll_s=10, clock=lambda: clock[0])
    dumps: list[dict[str, object]] = []
    monkeypatch.setattr(sup, "_on_dump_signal", lambda _job, _sig, **kw: dumps.append(kw) or 0)
    assert sup._duties(None) is None  # type: ignore[arg-type]  # the first reading of the end time

    end[0], clock[0] = time.time() + 3 * 3600, 10.0  # shortened by 5 h
    assert sup._duties(None) is None and dumps == []  # type: ignore[arg-type]
    assert sup.timing.stop_at is not None and 3 * 3600 - 240 < sup.timing.stop_at - time.monotonic() <= 3 * 3600 - 180
    assert "shortened time limit" in said[-1], said
    assert sup.timing.cause(signal.SIGUSR2) == "signal"  # a USR2 now is no time-limit warning, nor a preemption

    sup.timing.stop_at = time.monotonic() - 1  # the planned dump is due, but the limit was lengthened again
    end[0], clock[0] = time.time() + 5 * 3600, 20.0
    assert sup._duties(None) is None and dumps == []  # type: ignore[arg-type]
    assert sup.timing.stop_at is not None and sup.timing.stop_at - time.monotonic() > 4 * 3600

    end[0], clock[0] = time.time() + 30, 30.0  # a preemption with GraceTime 30 s
    assert sup._duties(None) == 0 and dumps == [{"cause": "preemption", "received": False}]  # type: ignore[arg-type]
    assert sup.timing.cause(signal.SIGTERM) == "preemption"


def test_a_supervisor_done_ignores_a_late_warning() -> None:
    """After a supervisor's run is decided, a signal it watched (a time-limit warning that
    slurmctld sent early) must not kill its process as Python finalizes: the job would end
    FAILED (ExitCode 0:12) after its command exited 0. A child installs the inbox, quiets it,
    then receives USR2 and TERM and still exits 0."""
    code = ("import os, signal\n"
            "from hpcckpt.lifecycle.supervise import SignalInbox\n"
            "inbox = SignalInbox()\n"
            "inbox.install({signal.SIGUSR2, signal.SIGTERM}, 'test')\n"
            "inbox.quiet()\n"
            "for sig in (signal.SIGUSR2, signal.SIGTERM):  # what finalization does to Python handlers\n"
            "    if callable(signal.getsignal(sig)):\n"
            "        signal.signal(sig, signal.SIG_DFL)\n"
            "os.kill(os.getpid(), signal.SIGUSR2)\n"
            "os.kill(os.getpid(), signal.SIGTERM)\n"
            "print('survived', flush=True)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0 and "survived" in proc.stdout, (proc.returncode, proc.stderr)
