"""The Checkpointer end to end in-process: saves, restore, stop on a real signal."""
from __future__ import annotations

import contextlib
import os
import pickle
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hpcckpt.api import EXIT_REQUEUE, Checkpointer, RequeueExit
from hpcckpt.errors import CheckpointCorrupt, ConfigError
from hpcckpt.lifecycle.ledger import Ledger
from hpcckpt.store import catalog
from tests.helpers import tiny_state, train_step

pytestmark = pytest.mark.native


def run(ckdir: Path, total: int, *, signal_at: int | None = None, engine: str = "sync", every: int = 3,
        seed: int = 0) -> tuple[list[str], dict[str, object]]:
    objs = tiny_state(seed)
    losses: list[str] = []
    with Checkpointer(ckdir, engine=engine, every_steps=every, keep=2) as ck:
        ck.register(**objs)
        for step in ck.steps(total):
            losses.append(float.hex(train_step(objs)))
            if signal_at is not None and step + 1 == signal_at:
                os.kill(os.getpid(), signal.SIGUSR2)  # a real signal through the real handler
    return losses, objs


def test_signal_stops_at_boundary_with_durable_checkpoint_and_exact_resume(ckdir: Path) -> None:
    ref, ref_objs = run(ckdir.parent / "ref", 12, every=100)
    with pytest.raises(RequeueExit) as exc:
        run(ckdir, 12, signal_at=7)
    assert exc.value.code == EXIT_REQUEUE and exc.value.step == 7
    infos = catalog.scan(ckdir)
    assert infos[-1].step == 7 and infos[-1].status == "committed"
    # a fresh process would start here: same seed, different objects
    rest, objs = run(ckdir, 12)
    events = [e["event"] for e in Ledger(ckdir).read()]
    assert "signal" in events and "requeue" in events and events.count("start") == 2
    first_losses = ref[:7]
    assert first_losses + rest == ref
    for p, q in zip(objs["model"].state_dict().values(), ref_objs["model"].state_dict().values()):
        assert torch.equal(p, q)


def test_signal_storm_takes_one_final_checkpoint(ckdir: Path) -> None:
    objs = tiny_state(0)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(RequeueExit):
        with Checkpointer(ckdir, every_steps=None, signals=("USR1", "USR2", "TERM")) as ck:
            ck.register(**objs)
            for step in ck.steps(10):
                train_step(objs)
                if step == 3:
                    # To this thread: each is handled before the next is sent. Sent to the process,
                    # the kernel may pick another thread (torch's, pytest's) and two SIGTERMs
                    # pending at once are one signal.
                    for s in (signal.SIGTERM, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
                        signal.pthread_kill(threading.get_ident(), s)
    led = Ledger(ckdir).read()
    assert [e["signame"] for e in led if e["event"] == "signal"] == ["SIGTERM", "SIGTERM", "SIGUSR1", "SIGUSR2"]
    assert [e["step"] for e in led if e["event"] == "commit"] == [4]
    assert signal.getsignal(signal.SIGTERM) is before  # handlers uninstalled: the one found is back


@contextlib.contextmanager
def finished_run(ckdir: Path) -> Iterator[Checkpointer]:
    """A run of 6 steps (saves every 4) that listens to USR2 and TERM, trained to its end;
    the block runs before its Checkpointer closes (the code after the training loop)."""
    objs = tiny_state(0)
    with Checkpointer(ckdir, every_steps=4, signals=("USR2", "TERM")) as ck:
        ck.register(**objs)
        for _ in ck.steps(6):
            train_step(objs)
        yield ck


def test_a_stop_signal_after_the_run_requeues_and_the_next_run_ends_the_code_after_the_loop(ckdir: Path) -> None:
    """TERM while the script runs its code after the training loop (here: inside and after the
    Checkpointer's block): the job is requeued and exits 75 once (a second TERM, as
    ``scontrol requeue`` sends, does nothing more), the ledger says so and ``history`` does not
    call the run finished; the next run resumes at the final checkpoint, trains nothing, runs
    that code to its end and is finished. A new Checkpointer in the process takes the signals back."""
    from hpcckpt.lifecycle.history import fold

    def script(*, stop_in: str | None) -> list[str]:
        done: list[str] = []
        with finished_run(ckdir):
            if stop_in == "block":  # e.g. an evaluation before the Checkpointer closes
                for _ in range(2):
                    signal.pthread_kill(threading.get_ident(), signal.SIGTERM)
            done.append("in block")
        if stop_in == "after":  # e.g. an export after it closed
            signal.pthread_kill(threading.get_ident(), signal.SIGTERM)
        done.append("after block")
        return done

    for where in ("block", "after"):
        with pytest.raises(RequeueExit) as exc:
            script(stop_in=where)
        assert exc.value.code == EXIT_REQUEUE and exc.value.reason == "after_run", exc.value
        led = Ledger(ckdir).read()
        stops = [e for e in led if e["event"] == "stop"]
        assert stops[-2]["reason"] == "done" and stops[-1]["reason"] == "after_run", stops
        assert stops[-1]["signame"] == "SIGTERM" and stops[-1]["committed_step"] == 6
        assert [e["event"] for e in led].count("requeue") == (1 if where == "block" else 2)  # once a stop
        assert not fold(led).finished
        assert catalog.scan(ckdir)[-1].step == 6  # the final state, where the next run resumes
    assert script(stop_in=None) == ["in block", "after block"]  # the next run ends it
    led = Ledger(ckdir).read()
    assert led[-1]["event"] == "stop" and led[-1]["reason"] == "done" and fold(led).finished
    assert [e["event"] for e in led].count("nothing_left") == 2  # the runs after the first trained nothing
    # The guard left by a finished run keeps none of its objects alive (a script may go on to
    # load another model).
    import gc
    import weakref
    objs = tiny_state(0)
    with Checkpointer(ckdir.parent / "third", every_steps=2, signals=("USR2", "TERM")) as ck:
        ck.register(**objs)
        for _ in ck.steps(4):
            train_step(objs)
    held = [weakref.ref(ck), *(weakref.ref(o) for o in objs.values())]
    del ck, objs
    gc.collect()
    assert [r() for r in held] == [None] * len(held)
    # A later run in this process owns the signals: its stop is a stop at a step boundary.
    with pytest.raises(RequeueExit) as exc:
        run(ckdir.parent / "other", 12, signal_at=4)
    assert exc.value.reason == "signal" and exc.value.step == 4


def test_corrupt_latest_falls_back_to_previous(ckdir: Path) -> None:
    run(ckdir, 9, every=3)  # commits 3, 6, 9 (keep=2 -> 6, 9)
    newest = ckdir / "step-9" / "rank-0.pt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    objs = tiny_state(5)
    with Checkpointer(ckdir, every_steps=None) as ck:
        assert ck.register(**objs) == 6
    skipped = [e for e in Ledger(ckdir).read() if e["event"] == "skip_corrupt"]
    assert skipped and skipped[0]["step"] == 9


def test_missing_manifest_or_truncation_is_skipped(ckdir: Path) -> None:
    run(ckdir, 9, every=3)
    (ckdir / "step-9" / "manifest.json").unlink()
    with open(ckdir / "step-6" / "rank-0.pt", "r+b") as f:
        f.truncate(100)
    statuses = {i.step: i.status for i in catalog.scan(ckdir)}
    assert statuses == {6: "corrupt", 9: "incomplete"}
    # nothing restores: both engines refuse a silent fresh start and say what to do
    with Checkpointer(ckdir, every_steps=None) as ck:
        with pytest.raises(CheckpointCorrupt, match=r"step 9: .*step 6: .*HPCCKPT_ON_CORRUPT=fresh"):
            ck.register(**tiny_state(1))
    # a fresh start only when asked for, and the ledger says why
    with Checkpointer(ckdir, every_steps=None, on_corrupt="fresh") as ck:
        assert ck.register(**tiny_state(1)) is None
    fresh = [e for e in Ledger(ckdir).read() if e["event"] == "fresh_start"]
    assert len(fresh) == 1 and fresh[0]["steps"] == [9, 6]


def test_load_path_never_unpickles(ckdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run(ckdir, 3, every=3)
    real_load = torch.load

    def guarded(*a: object, **k: object) -> object:
        assert k.get("weights_only") is True, "torch.load must be called with weights_only=True"
        return real_load(*a, **k)

    def no_pickle(*a: object, **k: object) -> object:
        raise AssertionError("pickle used on the load path")

    monkeypatch.setattr(torch, "load", guarded)
    monkeypatch.setattr(pickle, "loads", no_pickle)
    monkeypatch.setattr(pickle, "load", no_pickle)
    with Checkpointer(ckdir, every_steps=None) as ck:
        assert ck.register(**tiny_state(1)) == 3


def test_bad_options_are_named() -> None:
    with pytest.raises(ConfigError, match="valid engines"):
        Checkpointer("/tmp/x-never", engine="fast")
    with pytest.raises(ConfigError, match="HPCCKPT_DIR"):
        Checkpointer(None)
    with pytest.raises(ConfigError, match="unknown signal"):
        Checkpointer("/tmp/x-never", signals=("USR9",))
    with pytest.raises(ConfigError, match="on_busy='later'"):
        Checkpointer("/tmp/x-never", engine="concurrent", on_busy="later")
    with pytest.raises(ConfigError, match="memory_budget_bytes"):
        Checkpointer("/tmp/x-never", engine="concurrent", memory_budget_bytes=0)


@pytest.mark.native
def test_concurrent_engine_options_reach_the_engine(ckdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with Checkpointer(ckdir, engine="concurrent", max_async=2, on_busy="skip",
                      memory_budget_bytes=1 << 30, direct=False) as ck:
        e = ck.engine
        assert (e.max_async, e.on_busy, e.memory_budget_bytes, e.direct) == (2, "skip", 1 << 30, False)
    monkeypatch.setenv("HPCCKPT_ON_BUSY", "skip")
    monkeypatch.setenv("HPCCKPT_DIRECT", "no")
    with Checkpointer(ckdir, engine="concurrent") as ck:
        assert (ck.engine.on_busy, ck.engine.direct) == ("skip", False)
    with Checkpointer(ckdir, engine="concurrent", on_busy="wait") as ck:  # an argument beats the environment
        assert ck.engine.on_busy == "wait"
    monkeypatch.setenv("HPCCKPT_DIRECT", "sometimes")
    with pytest.raises(ConfigError, match="HPCCKPT_DIRECT='sometimes'"):
        Checkpointer(ckdir, engine="concurrent")


def _flip_in(path: Path, name: str) -> None:
    """Damage one tensor's bytes inside an HDF5 rank file (the manifest keeps its crc)."""
    import h5py
    with h5py.File(path, "r") as f:
        offset = f[name].id.get_offset()
    with open(path, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ 0xFF]))


def test_concurrent_resume_reads_into_the_live_model_and_stays_exact(ckdir: Path) -> None:
    ref, ref_objs = run(ckdir.parent / "ref", 12, every=100)
    with pytest.raises(RequeueExit):
        run(ckdir, 12, signal_at=7, engine="concurrent")
    objs = tiny_state(3)  # a resumed process: same model, other initial values
    ptrs = {n: p.data_ptr() for n, p in objs["model"].named_parameters()}
    losses: list[str] = []
    with Checkpointer(ckdir, engine="concurrent", every_steps=100) as ck:
        assert ck.register(**objs) == 7
        # parameters were restored into their own memory, not replaced
        assert {n: p.data_ptr() for n, p in objs["model"].named_parameters()} == ptrs
        for _ in ck.steps(12):
            losses.append(float.hex(train_step(objs)))
    assert ref[7:] == losses
    for p, q in zip(objs["model"].state_dict().values(), ref_objs["model"].state_dict().values()):
        assert torch.equal(p, q)


def test_damaged_newest_read_in_place_falls_back_and_restores_the_older_exactly(ckdir: Path) -> None:
    run(ckdir, 9, every=3, engine="concurrent")  # keep=2: steps 6 and 9
    ref, _ = run(ckdir.parent / "ref", 9, every=100)
    _flip_in(ckdir / "step-9" / "rank-0.h5", "objects/model/0.weight")
    objs = tiny_state(4)
    with Checkpointer(ckdir, engine="concurrent", every_steps=None) as ck:
        assert ck.register(**objs) == 6  # step 9 was read into the model, failed, then 6 overwrote it
        losses = [float.hex(train_step(objs)) for _ in ck.steps(9)]
    assert losses == ref[6:]


def test_every_checkpoint_damaged_after_in_place_reads_refuses_a_silent_fresh_start(ckdir: Path) -> None:
    run(ckdir, 6, every=3, engine="concurrent")  # steps 3 and 6
    for step in (3, 6):
        _flip_in(ckdir / f"step-{step}" / "rank-0.h5", "objects/model/0.weight")
    with Checkpointer(ckdir, engine="concurrent", every_steps=None) as ck:
        with pytest.raises(CheckpointCorrupt, match="overwrote the live model"):
            ck.register(**tiny_state(1))


def test_every_checkpoint_damaged_fresh_only_when_asked_and_the_model_untouched(ckdir: Path) -> None:
    run(ckdir, 6, every=3, engine="concurrent")  # steps 3 and 6 (HDF5)
    for step in (3, 6):
        _flip_in(ckdir / f"step-{step}" / "rank-0.h5", "objects/model/0.weight")
    objs = tiny_state(1)
    before = {n: t.clone() for n, t in objs["model"].state_dict().items()}
    with Checkpointer(ckdir, engine="concurrent", every_steps=None, on_corrupt="fresh") as ck:
        assert ck.register(**objs) is None
    # with a fresh start allowed, nothing was read into the live model: it starts from its own init
    for name, t in objs["model"].state_dict().items():
        assert torch.equal(t, before[name]), name
    assert [e["steps"] for e in Ledger(ckdir).read() if e["event"] == "fresh_start"] == [[6, 3]]


def _lbfgs_run(ckdir: Path, total: int, engine: str, *, signal_at: int | None = None
               ) -> tuple[list[str], torch.nn.Module]:
    """pytorch/examples time_sequence_prediction's shape: LBFGS with a closure, saved at every
    step. LBFGS keeps lists of tensors in its state (``old_dirs``, ``old_stps``, ``ro``) that
    grow up to ``history_size``, and Python floats (``prev_loss``): the set of saved tensors
    changes from one save to the next."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()
    x, y = torch.randn(32, 4, dtype=torch.double), torch.randn(32, 1, dtype=torch.double)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3, history_size=4)
    losses: list[str] = []
    with Checkpointer(ckdir, engine=engine, every_steps=1, keep=2) as ck:
        ck.register(model=model, optimizer=opt)
        for step in ck.steps(total):
            def closure() -> torch.Tensor:
                opt.zero_grad()
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
                return loss
            losses.append(float.hex(opt.step(closure).detach().item()))
            if signal_at is not None and step + 1 == signal_at:
                os.kill(os.getpid(), signal.SIGUSR2)
    return losses, model


@pytest.mark.parametrize("engine", ["sync", "concurrent"])
def test_lbfgs_state_whose_tensor_lists_grow_resumes_exactly(ckdir: Path, engine: str) -> None:
    ref, ref_model = _lbfgs_run(ckdir.parent / "ref", 9, engine)
    with pytest.raises(RequeueExit) as exc:
        _lbfgs_run(ckdir, 9, engine, signal_at=5)
    assert exc.value.step == 5
    rest, model = _lbfgs_run(ckdir, 9, engine)
    assert ref[:5] + rest == ref
    for p, q in zip(model.state_dict().values(), ref_model.state_dict().values()):
        assert torch.equal(p, q)


def test_a_time_limit_warning_after_the_run_waits_and_a_term_still_requeues(
        ckdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """After the run the guard judges a warning as the run does: 120 s before the end time
    (further than the stop's lead, within the warning window) the script goes on; 10 s
    before it, or a TERM, stops it and requeues."""
    import time

    def script(left_s: float, *, then_term: bool) -> list[str]:
        monkeypatch.setenv("HPCCKPT_END_TIME", str(time.time() + 120))
        done: list[str] = []
        with finished_run(ckdir):
            pass
        monkeypatch.setenv("HPCCKPT_END_TIME", str(time.time() + left_s))  # read again at the warning
        signal.pthread_kill(threading.get_ident(), signal.SIGUSR2)  # the scheduler's warning, after the loop
        done.append("after the warning")
        if then_term:
            signal.pthread_kill(threading.get_ident(), signal.SIGTERM)
        done.append("after the term")
        return done

    def stops() -> list[dict[str, object]]:
        return [e for e in Ledger(ckdir).read() if e["event"] == "stop"]

    assert script(120, then_term=False) == ["after the warning", "after the term"]
    assert [s["reason"] for s in stops()] == ["done"]
    with pytest.raises(RequeueExit) as exc:
        script(120, then_term=True)
    assert exc.value.reason == "after_run" and stops()[-1]["signame"] == "SIGTERM"
    with pytest.raises(RequeueExit) as exc:
        script(10, then_term=False)
    assert exc.value.reason == "after_run" and stops()[-1]["signame"] == "SIGUSR2"


LATE_SIGNAL_SCRIPT = """
import sys
from hpcckpt.api import Checkpointer
from tests.helpers import tiny_state, train_step
objs = tiny_state(0)
with Checkpointer(sys.argv[1], every_steps=2, signals=("USR2", "TERM")) as ck:
    ck.register(**objs)
    for _ in ck.steps(4):
        train_step(objs)
print("finished", flush=True)
"""


def test_a_stop_signal_while_a_finished_run_exits_never_kills_it(ckdir: Path) -> None:
    """TERM sent again and again from the moment a run has finished until its process is
    gone (Slurm's time-limit TERM or a preemption landing as the job ends): the first one
    requeues (exit 75); one that comes while Python finalizes, which gives its handled
    signals back to SIG_DFL, used to kill the process (status 143: FAILED under Slurm,
    though the run and its checkpoint were complete). Exit 0 or 75 only, each time."""
    import subprocess
    import sys
    import time

    for attempt in range(2):
        run_dir = ckdir / f"run{attempt}"
        proc = subprocess.Popen([sys.executable, "-c", LATE_SIGNAL_SCRIPT, str(run_dir)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[2])
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "finished", proc.communicate()[1]
        while proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.0005)
        err = proc.communicate()[1]
        assert proc.returncode in (0, EXIT_REQUEUE), (proc.returncode, err[-2000:])
        # exit 75 exactly when the ledger says the job was requeued (a recorded requeue happens)
        after_run = [e for e in Ledger(run_dir).read() if e["event"] == "stop" and e["reason"] == "after_run"]
        assert (proc.returncode == EXIT_REQUEUE) == bool(after_run), (proc.returncode, after_run, err[-2000:])


SHUTDOWN_SCRIPT = LATE_SIGNAL_SCRIPT + """
import threading
def linger():  # a thread of the script's own: the interpreter joins it after the script returns
    while threading.main_thread().is_alive():
        threading.Event().wait(0.01)
    print("joining", flush=True)
    threading.Event().wait(60)
threading.Thread(target=linger).start()
"""


EXECUTOR_SHUTDOWN_SCRIPT = LATE_SIGNAL_SCRIPT + """
import concurrent.futures, threading
def linger():  # a task of the script's executor: the interpreter waits for it in threading._shutdown,
    # before the main thread is marked stopped (threading.main_thread().is_alive() is still True)
    while not concurrent.futures.thread._shutdown:
        threading.Event().wait(0.01)
    print("joining", flush=True)
    threading.Event().wait(60)
concurrent.futures.ThreadPoolExecutor(1).submit(linger)
"""


@pytest.mark.parametrize("script", [SHUTDOWN_SCRIPT, EXECUTOR_SHUTDOWN_SCRIPT], ids=["thread", "executor"])
def test_a_stop_signal_after_the_script_returned_still_exits_75(ckdir: Path, script: str) -> None:
    """A stop signal while the interpreter joins the script's threads or executors (after its
    last line): Python prints and ignores a SystemExit raised there, so the process exited 0
    though the ledger said the job was requeued, and under a local supervisor it never came
    back. It exits 75, the requeue recorded."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", script, str(ckdir)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[2])
    assert proc.stdout is not None
    assert [proc.stdout.readline().strip() for _ in range(2)] == ["finished", "joining"], proc.communicate()[1]
    proc.send_signal(signal.SIGTERM)
    err = proc.communicate(timeout=60)[1]
    assert proc.returncode == EXIT_REQUEUE, (proc.returncode, err[-2000:])
    events = Ledger(ckdir).read()
    stop = [e for e in events if e["event"] == "stop"][-1]
    assert stop["reason"] == "after_run" and stop["signame"] == "SIGTERM", events[-4:]
    assert events[-1]["event"] == "requeue", events[-4:]
