"""The end of a run is a step like the others, and safe to run again (issue 55, item 3).

A loop shaped like transformers' ``run_clm_no_trainer.py``: ``for epoch in ckpt.epochs(E)``, a
``for batch in ckpt.batches(loader)`` that ``break``s once ``completed_steps >= max_steps`` (mid-epoch,
in the last epoch), then the epoch's evaluation (``perplexity``, set only there), and code after the
loop that uses it (the export). Before: the batch the loop broke at never ran its boundary, so the
final checkpoint was labelled ``step-<max_steps - 1>`` while holding ``max_steps`` updates, and a re-run
of the finished run (the after-run requeue of a TERM during the export) trained nothing, ran no
epoch, and the export failed with ``UnboundLocalError: perplexity``.
"""
from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from hpcckpt.api import Checkpointer, RequeueExit
from hpcckpt.check import read_trace
from hpcckpt.lifecycle.ledger import Ledger
from hpcckpt.store import catalog

pytestmark = pytest.mark.native

PER_EPOCH = 5  # batches
EPOCHS = 3
MAX_STEPS = 12  # the 2nd batch of the last epoch (steps 11..15)


def setup() -> dict[str, Any]:
    torch.manual_seed(0)
    x, y = torch.randn(PER_EPOCH * 4, 6), torch.randint(0, 3, (PER_EPOCH * 4,))
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    loader = DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True)
    return {"model": model, "opt": opt, "sched": sched, "loader": loader}


def train(o: dict[str, Any], batch: Any, log: list[str]) -> None:
    x, y = batch
    loss = torch.nn.functional.cross_entropy(o["model"](x), y)
    o["opt"].zero_grad()
    loss.backward()
    o["opt"].step()
    log.append(float.hex(loss.item()))


def evaluate(o: dict[str, Any]) -> str:
    o["model"].eval()
    with torch.no_grad():
        out = float.hex(o["model"](torch.ones(2, 6)).exp().sum().item())
    o["model"].train()
    return out


def clm(ckdir: Path, log: list[str], *, signal_at: int | None = None, term_after: bool = False,
        crash_at: int | None = None, engine: str = "sync", every: int | None = None,
        top_break: bool = False) -> dict[str, Any]:
    """run_clm_no_trainer's loop; returns its export (what the code after the loop writes)."""
    o = setup()
    ck = Checkpointer(ckdir, engine=engine, every_steps=every, signals=("USR2", "TERM"))
    ck.register(model=o["model"], opt=o["opt"], sched=o["sched"])
    completed_steps = ck.step  # the script's own counter, brought back from ckpt.step
    for epoch in ck.epochs(EPOCHS):
        for batch in ck.batches(o["loader"]):
            if top_break and completed_steps >= MAX_STEPS:
                break  # before training the batch: not a step
            train(o, batch, log)
            completed_steps += 1
            if signal_at == completed_steps:
                os.kill(os.getpid(), signal.SIGUSR2)
            if crash_at == completed_steps:
                raise ValueError("a bug in the training step")
            if completed_steps >= MAX_STEPS and not top_break:
                break
        log.append(f"epoch {epoch} ends at step {ck.step}")
        perplexity = evaluate(o)  # set only here, used after the loop
        log.append(f"eval {epoch} {perplexity}")
        o["sched"].step()
    if term_after:  # a TERM while the script exports the model
        signal.pthread_kill(threading.get_ident(), signal.SIGTERM)
    return {"perplexity": perplexity, "step": ck.step,
            "model": {k: v.clone() for k, v in o["model"].state_dict().items()},
            "sched": json.dumps(o["sched"].state_dict(), default=str)}


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (a["perplexity"] == b["perplexity"] and a["sched"] == b["sched"]
            and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"]))


def losses(log: list[str]) -> list[str]:
    return [x for x in log if not x.startswith(("eval", "epoch"))]


@pytest.mark.parametrize("engine", ["sync", "concurrent"])
def test_a_break_at_max_steps_commits_that_step_with_its_true_number(tmp_path: Path, engine: str) -> None:
    log: list[str] = []
    export = clm(tmp_path / "ck", log, engine=engine)
    assert len(losses(log)) == MAX_STEPS
    assert export["step"] == MAX_STEPS and f"epoch 2 ends at step {MAX_STEPS}" in log
    assert catalog.scan(tmp_path / "ck")[-1].step == MAX_STEPS
    stops = [e for e in Ledger(tmp_path / "ck").read() if e["event"] == "stop"]
    assert stops[-1]["reason"] == "done" and stops[-1]["step"] == MAX_STEPS
    # The finished run started again (the after-run requeue): it trains nothing, runs the last
    # epoch's evaluation again (so `perplexity` is set) and ends with the uninterrupted export.
    again: list[str] = []
    assert same(clm(tmp_path / "ck", again, engine=engine), export)
    assert losses(again) == [] and again[0] == f"epoch 2 ends at step {MAX_STEPS}"


@pytest.mark.parametrize("engine", ["sync", "concurrent"])
def test_a_term_during_the_export_requeues_and_the_next_run_exports_the_same(tmp_path: Path, engine: str) -> None:
    ref = clm(tmp_path / "ref", [], engine=engine)
    log: list[str] = []
    with pytest.raises(RequeueExit) as exc:
        clm(tmp_path / "ck", log, term_after=True, engine=engine)
    assert exc.value.reason == "after_run" and exc.value.step == MAX_STEPS
    again: list[str] = []
    assert same(clm(tmp_path / "ck", again, engine=engine), ref)  # no UnboundLocalError: perplexity
    assert losses(again) == []


@pytest.mark.parametrize("engine", ["sync", "concurrent"])
def test_a_stop_in_the_step_the_loop_breaks_at_resumes_exactly(tmp_path: Path, engine: str) -> None:
    ref_log: list[str] = []
    ref = clm(tmp_path / "ref", ref_log, engine=engine)
    log: list[str] = []
    with pytest.raises(RequeueExit) as exc:
        clm(tmp_path / "ck", log, signal_at=MAX_STEPS, engine=engine)
    assert exc.value.step == MAX_STEPS
    assert catalog.scan(tmp_path / "ck")[-1].step == MAX_STEPS
    assert same(clm(tmp_path / "ck", log, engine=engine), ref)
    assert losses(log) == losses(ref_log)


def test_a_break_before_the_batch_is_trained_is_not_a_step(tmp_path: Path) -> None:
    log: list[str] = []
    export = clm(tmp_path / "ck", log, top_break=True)
    assert len(losses(log)) == MAX_STEPS and export["step"] == MAX_STEPS
    assert catalog.scan(tmp_path / "ck")[-1].step == MAX_STEPS


def test_an_exception_in_the_last_epoch_is_no_end_of_training(tmp_path: Path) -> None:
    """The pass is left by an exception (its generator closed as the loop unwinds): nothing is
    counted or saved there, and the run is not finished: the next run trains the rest."""
    ref_log: list[str] = []
    ref = clm(tmp_path / "ref", ref_log, every=5)
    log: list[str] = []
    with pytest.raises(ValueError, match="a bug"):
        clm(tmp_path / "ck", log, every=5, crash_at=MAX_STEPS)
    assert catalog.scan(tmp_path / "ck")[-1].step == 10  # the periodic one
    del log[-2:]  # the steps trained since step 10, trained again
    assert same(clm(tmp_path / "ck", log, every=5), ref)
    assert losses(log) == losses(ref_log)


def limited(ckdir: Path, log: list[str], *, signal_at: int | None = None, engine: str = "sync") -> dict[str, Any]:
    """A loop that trains the first 3 batches of each epoch (a break mid-epoch, every epoch)."""
    o = setup()
    with Checkpointer(ckdir, engine=engine, every_steps=None, signals=("USR2",)) as ck:
        ck.register(model=o["model"], opt=o["opt"], sched=o["sched"])
        for epoch in ck.epochs(EPOCHS):
            for i, batch in ck.batches(o["loader"]).enumerate():
                train(o, batch, log)
                if signal_at == ck.step + 1:
                    os.kill(os.getpid(), signal.SIGUSR2)
                if i == 2:
                    break
            log.append(f"epoch {epoch} ends at step {ck.step}")
            log.append(f"eval {epoch} {evaluate(o)}")
            o["sched"].step()
    return {"perplexity": None, "step": ck.step, "model": {k: v.clone() for k, v in o["model"].state_dict().items()},
            "sched": json.dumps(o["sched"].state_dict(), default=str)}


@pytest.mark.parametrize("stop", [3, 5])
def test_a_stop_at_a_break_of_an_earlier_epoch_resumes_at_the_next_epoch(tmp_path: Path, stop: int) -> None:
    """Stopped at step 3 (where epoch 0's loop breaks: the stop is taken at the epoch's end, and
    the resumed run goes on with epoch 1, not with the rest of epoch 0) or at 5 (mid-pass)."""
    ref_log: list[str] = []
    ref = limited(tmp_path / "ref", ref_log)
    assert ref["step"] == 3 * EPOCHS and "epoch 0 ends at step 3" in ref_log
    log: list[str] = []
    with pytest.raises(RequeueExit) as exc:
        limited(tmp_path / "ck", log, signal_at=stop)
    assert exc.value.step == stop
    got = limited(tmp_path / "ck", log)
    assert same(got, ref) and got["step"] == ref["step"]
    assert log == ref_log


def test_leaving_the_epoch_loop_ends_the_run(tmp_path: Path) -> None:
    """Early stopping: a break out of ckpt.epochs() after epoch 1 is the run's end: its final
    state is committed (the next run trains nothing) and the ledger says it is done."""
    def run(log: list[str]) -> dict[str, Any]:
        o = setup()
        ck = Checkpointer(tmp_path / "ck", every_steps=None)
        ck.register(model=o["model"], opt=o["opt"])
        for epoch in ck.epochs(EPOCHS):
            for batch in ck.batches(o["loader"]):
                train(o, batch, log)
            if epoch == 1:
                break
        return {k: v.clone() for k, v in o["model"].state_dict().items()}

    first: list[str] = []
    model = run(first)
    assert len(first) == 2 * PER_EPOCH
    assert catalog.scan(tmp_path / "ck")[-1].step == 2 * PER_EPOCH
    stops = [e for e in Ledger(tmp_path / "ck").read() if e["event"] == "stop"]
    assert stops[-1]["reason"] == "done" and stops[-1]["step"] == 2 * PER_EPOCH
    again: list[str] = []
    got = run(again)
    assert again == [] and all(torch.equal(got[k], model[k]) for k in model)


def test_check_traces_the_step_the_loop_breaks_at(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trace = tmp_path / "trace.jsonl"
    monkeypatch.setenv("_HPCCKPT_CHECK_TRACE", str(trace))
    clm(tmp_path / "ck", [])
    steps, _, _ = read_trace(trace)
    assert max(steps) == MAX_STEPS and sorted(steps) == list(range(1, MAX_STEPS + 1))
