"""Just-in-time checkpoints (hpcckpt.jit) with four real ranks: gloo over loopback, DDP on CPU.

A rank killed (kill -9) or stopped (SIGSTOP) in the middle of a step: the survivors
notice it through the guard's heartbeat, agree on the last completed step, one of them
commits it through the usual commit protocol, and every survivor exits 75; four fresh
ranks resume from it and end bit-identical to a run that was never interrupted. The
writer killed during the JIT save: nothing half-written is ever loaded, the previous
checkpoint (if any) stays the newest committed one. No test depends on timing beyond
generous bounds; every process started is reaped.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from hpcckpt.exitcodes import EXIT_REQUEUE
from hpcckpt.lifecycle.ledger import Ledger
from hpcckpt.store import catalog
from tests.conftest import REPO
from tests.helpers import built_once
from tests.prefork import Child

pytestmark = pytest.mark.native

WORLD = 4
TOTAL = 20
TIMEOUT_S = 8.0  # generous: a loaded CI machine must never look like a hung rank
RUN_LIMIT_S = 240.0  # a whole job (four interpreters starting torch on a small VM): generous
BOUND_S = 60.0  # failure -> committed JIT checkpoint; the design bound is ~2 x timeout + the save


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HPCCKPT_", "SLURM_"))}
    env["HPCCKPT_CLUSTER"] = "local"
    return env


def run_job(root: Path, **cfg: Any) -> tuple[list[int | None], list[str]]:
    """Start WORLD ranks; wait for all (a stopped victim is killed once the others ended)."""
    cfg = {"world": WORLD, "total": TOTAL, "timeout": TIMEOUT_S, "every": None, **cfg}
    port = _free_port()
    world = int(cfg["world"])
    logs = [root.parent / f"{root.name}-rank{r}.out" for r in range(world)]
    procs = [Child(["-m", "tests.unit.jit_worker", str(r), str(port), str(root), json.dumps(cfg)], cwd=REPO,
                   env=_env(), output=logs[r]) for r in range(world)]
    stopped = cfg["victim"] if cfg.get("how") == "stop" else None
    deadline = time.monotonic() + RUN_LIMIT_S
    try:
        for r, p in enumerate(procs):
            if r == stopped:
                continue
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"rank {r} did not end within {RUN_LIMIT_S}s")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(60)
    outs = [p.read_output() for p in procs]
    codes = [p.returncode for p in procs]
    if stopped is not None:
        codes[stopped] = None  # it was still stopped: the harness killed it
    return codes, outs


def _committed(root: Path) -> list[int]:
    return [i.step for i in catalog.scan(root / "ckpt") if i.status == "committed"]


def _final(root: Path, rank: int) -> dict[str, Any]:
    return torch.load(root / f"final-{rank}.pt", weights_only=True)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and \
            bool(torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))  # bits, not values
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted run (the guard watching, no failure); one per session."""
    def build(root: Path) -> None:
        codes, outs = run_job(root)
        assert codes == [0] * WORLD, "\n".join(outs)
        for r in range(WORLD):
            assert json.loads((root / f"result-{r}.json").read_text()) == {"resumed": None, "jit_active": True}
        assert _committed(root) == [], "no periodic checkpoint was asked for"
    return built_once(tmp_path_factory, "jit-reference", build)


def _check_jit_and_resume(root: Path, reference: Path, codes: list[int | None], outs: list[str], *,
                          victim: int, step: int) -> None:
    survivors = [r for r in range(WORLD) if r != victim]
    assert codes[victim] in (-signal.SIGKILL, None, 1), "\n".join(outs)
    assert [codes[r] for r in survivors] == [EXIT_REQUEUE] * len(survivors), "\n".join(outs)
    # The last completed step is committed, and only it.
    assert _committed(root) == [step], "\n".join(outs)
    info = catalog.find(root / "ckpt", None)
    assert catalog.check(info.path, full=True)[1] == []
    assert info.manifest is not None and info.manifest["engine"] == "jit"
    assert info.manifest["jit"]["failed_ranks"] == [victim]
    assert info.manifest["jit"]["writer"] == min(survivors)
    events = Ledger(root / "ckpt").read()
    failure = [e for e in events if e["event"] == "rank_failure"]
    assert len(failure) == 1 and failure[0]["failed_ranks"] == [victim], failure
    assert failure[0]["jit_step"] == step and failure[0]["lost_step"] == step + 1, failure
    assert failure[0]["reached_step"] == step, failure  # the survivors were all inside step + 1
    commit = [e for e in events if e["event"] == "commit"]
    assert len(commit) == 1 and commit[0]["step"] == step and commit[0]["jit"], commit
    fault = json.loads((root / "fault-time.json").read_text())
    assert commit[0]["time"] - fault["time"] < BOUND_S, (commit[0]["time"] - fault["time"], "\n".join(outs))
    requeue = [e for e in events if e["event"] == "requeue"]
    assert len(requeue) == 1 and requeue[0]["requeued"] and requeue[0]["method"] == "exit", requeue
    assert not [p for p in (root / "ckpt").iterdir() if ".tmp-" in p.name]
    # Four fresh ranks resume from it and end bit-identical to the uninterrupted run.
    codes, outs = run_job(root)
    assert codes == [0] * WORLD, "\n".join(outs)
    for r in range(WORLD):
        assert json.loads((root / f"result-{r}.json").read_text())["resumed"] == step
        assert _same(_final(root, r), _final(reference, r)), f"rank {r} differs from the uninterrupted run"


@pytest.mark.parametrize(("victim", "at", "how"), [
    (2, 7, "kill"),            # a non-zero rank killed mid-step
    (0, 5, "kill"),            # rank 0 killed: the coordinator's role moves to a survivor
    (3, 11, "kill_boundary"),  # killed at a step boundary
    (1, 6, "stop"),            # SIGSTOPped: a hang, seen by the heartbeat
], ids=["nonzero-rank-killed-mid-step", "rank-zero-killed", "killed-at-boundary", "rank-stopped"])
def test_survivors_save_the_last_step_and_a_rerun_ends_identically(
        tmp_path: Path, reference: Path, victim: int, at: int, how: str) -> None:
    codes, outs = run_job(tmp_path, victim=victim, at=at, how=how)
    _check_jit_and_resume(tmp_path, reference, codes, outs, victim=victim, step=at)


def test_jit_checkpoint_resumes_on_fewer_ranks(tmp_path: Path, reference: Path) -> None:
    """Format hpcckpt/2: the job may come back on fewer nodes (here 2 ranks instead of 4)."""
    codes, outs = run_job(tmp_path, victim=3, at=8, how="kill")
    assert [codes[r] for r in range(3)] == [EXIT_REQUEUE] * 3, "\n".join(outs)
    info = catalog.find(tmp_path / "ckpt", None)
    assert info.step == 8 and info.manifest is not None and info.manifest["format"] == "hpcckpt/4"
    shared = info.manifest["shared"]
    assert any(n.startswith("objects/model/") for n in shared) and any("/exp_avg" in n for n in shared)
    for name in shared:  # replicated tensors are written once, by the writer, not once per rank
        assert [r for r, rec in info.manifest["ranks"].items() if name in rec["tensors"]] == ["0"], name
    codes, outs = run_job(tmp_path, world=2)
    assert codes == [0, 0], "\n".join(outs)
    for r in range(2):
        assert json.loads((tmp_path / f"result-{r}.json").read_text())["resumed"] == 8


def test_rank_that_raises_leaves_and_the_others_save_at_once(tmp_path: Path, reference: Path) -> None:
    codes, outs = run_job(tmp_path, victim=1, at=4, how="raise")
    assert codes[1] == 1 and "injected failure on rank 1 at step 4" in outs[1], outs[1]
    events = Ledger(tmp_path / "ckpt").read()
    assert "left training on an error" in [e for e in events if e["event"] == "rank_failure"][0]["reason"]
    _check_jit_and_resume(tmp_path, reference, codes, outs, victim=1, step=4)


def test_writer_killed_during_the_jit_save_leaves_the_previous_checkpoint(tmp_path: Path, reference: Path) -> None:
    codes, outs = run_job(tmp_path, victim=2, at=9, how="kill", every=4, kill_writer_in_save=True)
    killed = json.loads((tmp_path / "writer-killed.json").read_text())
    assert killed["rank"] == 0
    assert codes[2] == -signal.SIGKILL and codes[0] == -signal.SIGKILL, "\n".join(outs)
    assert codes[1] == codes[3] == EXIT_REQUEUE, "\n".join(outs)
    # The periodic checkpoints stand; the half-written JIT save is a temporary directory, never listed.
    assert _committed(tmp_path) == [4, 8], "\n".join(outs)
    assert catalog.find(tmp_path / "ckpt", None).step == 8
    assert Path(killed["tmp"]).exists() and ".tmp-" in Path(killed["tmp"]).name
    assert [i.status for i in catalog.scan(tmp_path / "ckpt") if i.step == 9] == ["incomplete"]
    events = Ledger(tmp_path / "ckpt").read()
    assert [e["step"] for e in events if e["event"] == "save_failed"] == [9], events
    assert [e["requeued"] for e in events if e["event"] == "requeue"] == [True], events
    # A rerun resumes from step 8 (not the half-written 9) and ends bit-identical.
    codes, outs = run_job(tmp_path)
    assert codes == [0] * WORLD, "\n".join(outs)
    for r in range(WORLD):
        assert json.loads((tmp_path / f"result-{r}.json").read_text())["resumed"] == 8
        assert _same(_final(tmp_path, r), _final(reference, r))


# -- in-process pieces (no ranks started) ----------------------------------------------

def test_decision_takes_the_highest_step_whose_holders_agree() -> None:
    from hpcckpt.jit.rendezvous import decide
    docs = {0: {"rank": 0, "ok": True, "step": 7, "fp": "a"}, 1: {"rank": 1, "ok": True, "step": 8, "fp": "b"},
            3: {"rank": 3, "ok": True, "step": 8, "fp": "b"}}
    d = decide(docs, 4)
    assert d["ok"] and d["step"] == 8 and d["writer"] == 1 and d["holders"] == [1, 3] and d["failed"] == [2]
    # ranks not at the agreed step (and the dead one) take the writer's rank-local state
    assert d["source_of"] == {"0": 1, "1": 1, "2": 1, "3": 3}


def test_decision_refuses_survivors_that_disagree_or_hold_nothing_consistent() -> None:
    from hpcckpt.jit.rendezvous import decide
    split = decide({0: {"rank": 0, "ok": True, "step": 5, "fp": "a"},
                    1: {"rank": 1, "ok": True, "step": 5, "fp": "x"}}, 3)
    assert not split["ok"] and "different states" in split["reason"] and split["failed"] == [2]
    none = decide({1: {"rank": 1, "ok": False, "why": "mid-step"}}, 2)
    assert not none["ok"] and "no survivor holds a consistent state" in none["reason"]


def test_only_the_first_decision_counts(tmp_path: Path) -> None:
    from hpcckpt.jit.rendezvous import publish_decision
    first = publish_decision(tmp_path, {"ok": True, "step": 3})
    second = publish_decision(tmp_path, {"ok": True, "step": 4})
    assert first == second == {"ok": True, "step": 3}
    assert [p.name for p in tmp_path.iterdir()] == ["decision.json"]


def test_state_that_is_not_declared_replicated_is_refused() -> None:
    from hpcckpt.jit.capture import replication_problem
    model = torch.nn.Linear(2, 2)
    problem = replication_problem({"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}, 4)
    assert problem is not None and "not a DistributedDataParallel module" in problem
    assert replication_problem({}, 4) == "no DistributedDataParallel model is registered"
    from hpcckpt.state import TrainState
    state = TrainState()
    state.register("model", model)
    state.rank, state.world, state.replicated = 0, 4, "none"
    problem = replication_problem(state.objects, 4, state)
    assert problem is not None and "not declared replicated (replicated='none')" in problem
    state.replicated = "models"  # the user declares the module inside the DDP wrapper replicated
    assert replication_problem(state.objects, 4, state) is None


def test_boundary_copy_is_independent_of_later_changes() -> None:
    from hpcckpt.data import ResumableSampler
    from hpcckpt.jit.capture import capture_boundary, finish
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    sampler = ResumableSampler(32, num_replicas=2, rank=1)
    objects = {"model": model, "optimizer": opt, "scheduler": sched, "sampler": sampler}
    b = capture_boundary(3, (3,), objects, {"note": "x"})
    mean = model[1].running_mean.clone()
    rng = torch.get_rng_state()
    model(torch.randn(8, 4))  # a forward pass moves the running statistics and the RNG was drawn
    sampler.advance(4)
    opt.step()
    sched.step()
    assert torch.equal(b.tensors["objects/model/1.running_mean"], mean)
    assert not torch.equal(model[1].running_mean, mean)
    assert b.trees["objects"]["sampler"]["consumed"] == 0 and b.trees["objects"]["scheduler"]["last_epoch"] == 0
    assert torch.equal(finish(b).tensors["rng/torch"], rng)
    assert not any(n.startswith("objects/model/") and "weight" in n for n in b.tensors), "parameters are not copied"
    assert not any(n.startswith("objects/optimizer") for n in b.tensors)


def test_frozen_gate_holds_back_the_next_optimizer_step() -> None:
    import threading

    from hpcckpt.jit.capture import StepGate
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.5)
    gate = StepGate({"opt": opt})
    p.grad = torch.ones(2)
    opt.step()
    assert gate.snapshot() == (1,)
    assert gate.freeze(timeout_s=60)
    t = threading.Thread(target=opt.step, daemon=True)
    t.start()
    t.join(0.5)
    assert t.is_alive() and gate.snapshot() == (1,) and torch.equal(p.detach(), torch.full((2,), 0.5))
    with gate.cond:  # released only for this test: production ends the process instead
        gate.frozen = False
        gate.cond.notify_all()
    t.join(60)
    assert not t.is_alive() and gate.snapshot() == (2,)
    gate.remove()


def test_a_single_rank_or_a_bad_timeout_is_reported_clearly(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from types import SimpleNamespace

    from hpcckpt.config import resolve_options
    from hpcckpt.errors import ConfigError
    from hpcckpt.jit import JitGuard
    ckpt = SimpleNamespace(ranks=SimpleNamespace(rank=0, world=1), root=tmp_path, options=SimpleNamespace(),
                           state=SimpleNamespace(objects={}), step=0)
    guard = JitGuard(ckpt)
    assert not guard.active and guard.problem is not None and "single rank" in guard.problem
    guard.start()
    guard.at_boundary(1)
    guard.close()
    monkeypatch.setenv("HPCCKPT_JIT_TIMEOUT_S", "soon")
    assert JitGuard(ckpt).timeout_s == 5.0  # the guard reads no variable: resolve_options does
    with pytest.raises(ConfigError, match="HPCCKPT_JIT_TIMEOUT_S='soon' is invalid"):
        resolve_options(tmp_path)
    monkeypatch.setenv("HPCCKPT_JIT_TIMEOUT_S", "2.5")
    assert JitGuard(SimpleNamespace(**{**vars(ckpt), "options": resolve_options(tmp_path)})).timeout_s == 2.5
    with pytest.raises(ConfigError, match="jit_timeout_s=-1 is invalid"):
        JitGuard(ckpt, timeout_s=-1)


def test_fingerprint_tells_states_apart_and_reads_only_a_few_tensors() -> None:
    from hpcckpt.jit.capture import fingerprint, to_host
    a = {f"objects/model/{i}.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3) + i for i in range(5)}
    b = {n: t.clone() for n, t in a.items()}
    assert fingerprint(4, (4,), a) == fingerprint(4, (4,), b)
    assert fingerprint(4, (4,), a) != fingerprint(5, (4,), a)
    b["objects/model/4.weight"][1, 2] += 1  # the last tensor is among the sampled ones
    assert fingerprint(4, (4,), a) != fingerprint(4, (4,), b)
    assert fingerprint(4, (4,), {"x": a["objects/model/0.weight"].t()}) == \
        fingerprint(4, (4,), {"x": a["objects/model/0.weight"].t().contiguous()})
    host = to_host(a, [])
    assert all(host[n] is a[n] for n in a), "CPU tensors are not copied"


def test_scheduler_stepped_before_the_optimizer_does_not_leak_into_the_jit_checkpoint(tmp_path: Path) -> None:
    """The live learning rate is one scheduler step ahead of the last completed step when the
    failure interrupts a step; the checkpoint holds the hyperparameters of the boundary."""
    reference = tmp_path / "reference"
    reference.mkdir()
    codes, outs = run_job(reference, sched_first=True)
    assert codes == [0] * WORLD, "\n".join(outs)
    root = tmp_path / "failed"
    root.mkdir()
    # at=8: the survivors' scheduler step of step 9 (last_epoch 9, a multiple of step_size=3) changes the lr
    codes, outs = run_job(root, victim=2, at=8, how="kill", sched_first=True)
    assert [codes[r] for r in (0, 1, 3)] == [EXIT_REQUEUE] * 3, "\n".join(outs)
    assert _committed(root) == [8], "\n".join(outs)
    codes, outs = run_job(root, sched_first=True)
    assert codes == [0] * WORLD, "\n".join(outs)
    for r in range(WORLD):
        assert json.loads((root / f"result-{r}.json").read_text())["resumed"] == 8
        assert _same(_final(root, r), _final(reference, r)), f"rank {r} differs from the uninterrupted run"


class _FakeHeartbeat:
    """Records what the guard announces (in a forked child: into a file the parent reads)."""

    def __init__(self, marker: Path | None = None) -> None:
        import threading
        self._thread: Any = None
        self.failed = threading.Event()
        self.calls: list[int] = []
        self.marker = marker

    def start(self) -> None:
        self._thread = object()

    def announce(self, status: int, timeout_s: float | None) -> bool:
        self.calls.append(status)
        if self.marker is not None:
            self.marker.write_text(f"{os.getpid()} announced {status}")
        return True


def _started_guard(tmp_path: Path, hb: _FakeHeartbeat, rank: int = 1) -> Any:
    """A JitGuard started as on ``rank`` with a recording heartbeat (no process group)."""
    from types import SimpleNamespace

    from hpcckpt.jit import JitGuard
    from hpcckpt.jit.capture import StepGate
    ckpt = SimpleNamespace(ranks=SimpleNamespace(rank=rank, world=1), root=tmp_path, options=SimpleNamespace(),
                           state=SimpleNamespace(objects={}, user_meta={}), step=3, committed_step=None,
                           resumed_from=None, ledger=Ledger(tmp_path), cluster=SimpleNamespace(name="local"))
    guard = JitGuard(ckpt)  # one rank: inactive; made active below with the recording heartbeat
    guard.active, guard.problem, guard.heartbeat, guard.gate = True, None, hb, StepGate({})
    guard.start()
    return guard


def _child_exits() -> None:
    pass  # multiprocessing's child ends through threading._shutdown, like a DataLoader worker


def test_a_forked_child_never_announces_and_the_guard_is_not_kept_alive(tmp_path: Path) -> None:
    import gc
    import multiprocessing
    import weakref
    marker = tmp_path / "announced"
    guard = _started_guard(tmp_path, _FakeHeartbeat(marker))
    p = multiprocessing.get_context("fork").Process(target=_child_exits)
    p.start()
    p.join(120)
    assert p.exitcode == 0
    assert not marker.exists(), marker.read_text()  # the child would wait a full LEAVING timeout there
    assert guard.active and guard.heartbeat.calls == []  # the parent still watches
    ref = weakref.ref(guard)
    del guard
    gc.collect()
    assert ref() is None, "the atexit and at-fork registrations keep the guard alive"


def test_an_end_without_close_closes_normally_and_leaves_only_on_an_uncaught_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hpcckpt.jit.heartbeat import CLOSING, LEAVING
    monkeypatch.delattr(sys, "last_value", raising=False)
    monkeypatch.delattr(sys, "last_exc", raising=False)
    normal = _started_guard(tmp_path, _FakeHeartbeat())
    normal._at_shutdown()
    assert normal.heartbeat.calls == [CLOSING]
    monkeypatch.setattr(sys, "last_value", RuntimeError("uncaught"), raising=False)
    failed = _started_guard(tmp_path, _FakeHeartbeat())
    failed._at_shutdown()
    assert failed.heartbeat.calls == [LEAVING]
    failed._at_shutdown()  # once only
    assert failed.heartbeat.calls == [LEAVING]


@pytest.mark.parametrize("how", ["empty-message", "unexpected"])
def test_a_heartbeat_error_always_ends_in_the_failure_path(monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    import torch.distributed as dist

    from hpcckpt.jit.heartbeat import Heartbeat
    monkeypatch.setattr(dist, "new_group", lambda **kw: None)

    def all_reduce(t: torch.Tensor, group: Any = None) -> None:
        raise RuntimeError("")  # no message at all: splitlines() is empty

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    seen: list[tuple[str, list[int]]] = []
    # "unexpected": rank 5 of 2 fails outside the all-reduce (an IndexError in the thread itself)
    hb = Heartbeat(0 if how == "empty-message" else 5, 2, timeout_s=60, interval_s=0.01,
                   on_failure=lambda reason, failed: seen.append((reason, failed)))
    hb.start()
    assert hb._thread is not None
    hb._thread.join(120)
    assert not hb._thread.is_alive() and hb.failed.is_set() and hb.stopped.is_set()
    want = "heartbeat failed: RuntimeError: " if how == "empty-message" else "heartbeat thread error: IndexError"
    assert len(seen) == 1 and seen[0][0].startswith(want) and seen[0][1] == [], seen


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before:UserWarning")
def test_the_boundary_copies_only_persistent_buffers_and_the_optimizer_hyperparameters() -> None:
    from hpcckpt.jit.capture import capture_boundary, capture_replicated
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    model.register_buffer("scratch", torch.zeros(3), persistent=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    objects = {"model": model, "optimizer": opt, "scheduler": sched}
    b = capture_boundary(2, (0,), objects, {})
    assert "objects/model/1.running_mean" in b.tensors and "objects/model/scratch" not in b.tensors
    sched.step()  # stepped before the next optimizer step: the live lr moved on
    assert opt.param_groups[0]["lr"] == 0.05
    trees, _ = capture_replicated(objects, b.groups)
    group = trees["optimizer"]["param_groups"][0]
    assert group["lr"] == 0.1 and group["weight_decay"] == 0.01 and group["params"] == [0, 1, 2, 3]
    live, _ = capture_replicated(objects)
    assert live["optimizer"]["param_groups"][0]["lr"] == 0.05


def test_ledger_appends_on_the_jit_path_never_wait_forever(tmp_path: Path) -> None:
    import threading

    from hpcckpt.jit.guard import bounded_append
    release = threading.Event()

    class StuckLedger:  # as if a stopped rank held the ledger's lock
        def append(self, event: str, **fields: Any) -> None:
            release.wait()

    try:
        assert bounded_append(StuckLedger(), "rank_failure", wait_s=0.2, failed_ranks=[1]) is False
    finally:
        release.set()
    ledger = Ledger(tmp_path)
    assert bounded_append(ledger, "rank_failure", reached_step=7) is True
    assert [(e["event"], e["reached_step"]) for e in ledger.read()] == [("rank_failure", 7)]


def test_survivors_stop_waiting_for_a_writer_that_beats_but_never_finishes(tmp_path: Path) -> None:
    import threading

    from hpcckpt.jit import rendezvous
    stop = threading.Event()

    def beat() -> None:  # a writer stuck in a hung commit: its beat thread goes on
        n = 0
        while not stop.is_set():
            n += 1
            rendezvous.write_json(tmp_path / rendezvous.BEAT, n)
            stop.wait(0.02)

    t = threading.Thread(target=beat, daemon=True)
    t.start()
    try:
        outcome, why = rendezvous.await_outcome(tmp_path, dead_after_s=3600, deadline_s=0.5)
    finally:
        stop.set()
        t.join(60)
    assert outcome is None and "still beats" in why
    rendezvous.write_json(tmp_path / rendezvous.OUTCOME, {"ok": True, "step": 3})
    assert rendezvous.await_outcome(tmp_path, dead_after_s=3600, deadline_s=0.5) == ({"ok": True, "step": 3}, "")


def test_a_committed_step_of_an_earlier_run_is_replaced_not_reused(tmp_path: Path) -> None:
    """Only a step this run committed (or resumed from) holds this run's state at that step."""
    from hpcckpt.jit import writer
    from hpcckpt.jit.capture import capture_boundary, capture_replicated, finish
    from hpcckpt.store import torchfile
    guard = _started_guard(tmp_path, _FakeHeartbeat(), rank=0)
    model = torch.nn.Linear(2, 2)
    objects = {"model": model}
    b = finish(capture_boundary(5, (), objects, {}))
    trees, live = capture_replicated(objects)
    local = {k: v for k, v in b.trees.items() if k != "wall"}
    decision = {"step": 5, "holders": [0], "source_of": {"0": 0}, "failed": [], "fingerprint": "fp"}
    # an earlier run committed a step 5 of its own (other weights)
    writer.commit(tmp_path, step=5, world=1, writer_rank=0, keep=3, job={}, user={}, replicated_trees=trees,
                  replicated={n: torch.zeros_like(t) for n, t in live.items()}, sources={0: (b.tensors, local)},
                  source_of={0: 0}, info={})

    def weight() -> torch.Tensor:
        info = catalog.inspect_step(tmp_path, 5, full=True)
        assert info is not None and info.status == "committed" and info.manifest is not None
        rec = info.manifest["ranks"]["0"]
        return torchfile.read(info.path / writer.JIT_FILE, {"tensors": rec["tensors"]})["objects/model/weight"]

    assert torch.equal(weight(), torch.zeros(2, 2))
    out = guard._write(tmp_path, decision, b, dict(live), trees)
    assert out["ok"] and out["wrote"], out
    assert torch.equal(weight(), model.weight.detach())
    guard.ckpt.committed_step = 5  # this run's own commit of step 5: reused
    out = guard._write(tmp_path, decision, b, dict(live), trees)
    assert out["ok"] and not out["wrote"], out
    guard.active = False
