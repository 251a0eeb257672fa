"""A resumed job trains exactly what the uninterrupted job would, whatever its loop looks like.

Loops as users write them: ``total_steps = epochs * len(loader)`` computed after
``register()``; a new ``iter()`` per epoch with a ``next(iter(loader))`` peek; an epoch
loop with per-epoch code; a ``while`` loop with ``step_done()``. Each is stopped by a
real SIGUSR2 (mid-epoch and at step 32, an epoch's end), restarted with fresh objects as
a new process would be, and compared bit for bit with the uninterrupted run. A job that
resumes at or past its end says so in one line and trains nothing.
"""
from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from hpcckpt.api import Checkpointer, RequeueExit
from hpcckpt.data import ResumableSampler
from hpcckpt.lifecycle.ledger import Ledger

pytestmark = pytest.mark.native

EPOCHS = 3
PER_EPOCH = 16  # batches: 3 epochs are steps 1..48, step 32 is the end of epoch 2


def setup(sampler_kind: str) -> dict[str, Any]:
    torch.manual_seed(0)
    x, y = torch.randn(PER_EPOCH * 4, 6), torch.randint(0, 3, (PER_EPOCH * 4,))
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ds = TensorDataset(x, y)
    sampler = ResumableSampler(len(ds), seed=4) if sampler_kind == "resumable" else None
    loader = DataLoader(ds, batch_size=4, shuffle=sampler is None, sampler=sampler)
    return {"model": model, "opt": opt, "sched": sched, "loader": loader, "sampler": sampler}


def step(o: dict[str, Any], batch: Any, losses: list[str]) -> None:
    x, y = batch
    loss = torch.nn.functional.cross_entropy(o["model"](x), y)
    o["opt"].zero_grad()
    loss.backward()
    o["opt"].step()
    losses.append(float.hex(loss.item()))


def signal_if(ck: Checkpointer, stop_at: int | None) -> None:
    if stop_at is not None and ck.step + 1 == stop_at:
        os.kill(os.getpid(), signal.SIGUSR2)  # stops at the boundary after this step


def flat_loop(ckdir: Path, kind: str, losses: list[str], stop_at: int | None = None) -> dict[str, Any]:
    """``total_steps`` from ``len(loader)`` after ``register()``; ``ckpt.loop``."""
    o = setup(kind)
    with Checkpointer(ckdir, every_steps=None) as ck:
        ck.register(model=o["model"], opt=o["opt"], **({"sampler": o["sampler"]} if o["sampler"] else {}))
        total_steps = EPOCHS * len(o["loader"])  # written after register(): must not shrink
        for _, batch in ck.loop(o["loader"], total_steps):
            step(o, batch, losses)
            signal_if(ck, stop_at)
    return o


def epoch_loop(ckdir: Path, kind: str, losses: list[str], stop_at: int | None = None) -> dict[str, Any]:
    """A new iterator per epoch with a peek first, per-epoch code after (scheduler, evaluation)."""
    o = setup(kind)
    ck = Checkpointer(ckdir, every_steps=None)
    ck.register(model=o["model"], opt=o["opt"], sched=o["sched"])
    for epoch in ck.epochs(EPOCHS):
        peek = next(iter(o["loader"]))  # e.g. the batch size, as the DDP tutorial reads it
        assert len(peek[0]) == 4
        if o["sampler"] is not None:
            o["sampler"].set_epoch(epoch)
        for batch in ck.batches(o["loader"]):
            step(o, batch, losses)
            signal_if(ck, stop_at)
        o["sched"].step()
        losses.append(f"eval {epoch} {float.hex(o['model'](torch.ones(1, 6)).sum().item())}")
    return o


def while_loop(ckdir: Path, kind: str, losses: list[str], stop_at: int | None = None) -> dict[str, Any]:
    """A loop hpcckpt does not drive: the script counts steps itself and calls step_done()."""
    o = setup(kind)
    with Checkpointer(ckdir, every_steps=None) as ck:
        ck.register(model=o["model"], opt=o["opt"])
        total = EPOCHS * len(o["loader"])
        while ck.step < total:
            step(o, (torch.randn(4, 6), torch.randint(0, 3, (4,))), losses)
            signal_if(ck, stop_at)
            ck.step_done()
    return o


LOOPS: dict[str, Callable[..., dict[str, Any]]] = {"flat": flat_loop, "epochs": epoch_loop}


def resumed(loop: Callable[..., dict[str, Any]], ckdir: Path, kind: str, stops: list[int]) -> tuple[list[str], Any]:
    losses: list[str] = []
    for stop in stops:
        with pytest.raises(RequeueExit) as exc:
            loop(ckdir, kind, losses, stop)
        assert exc.value.step == stop
    return losses, loop(ckdir, kind, losses)


def same_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    sa, sb = a["model"].state_dict(), b["model"].state_dict()
    return all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("kind", ["shuffle", "resumable"])
@pytest.mark.parametrize("name", list(LOOPS))
def test_resumed_at_step_32_trains_to_the_same_last_step_and_state(name: str, kind: str, tmp_path: Path) -> None:
    loop = LOOPS[name]
    ref: list[str] = []
    ref_o = loop(tmp_path / "ref", kind, ref)
    assert sum(not x.startswith("eval") for x in ref) == EPOCHS * PER_EPOCH
    losses, o = resumed(loop, tmp_path / "run", kind, [21, 32])  # mid-epoch 2, then the end of epoch 2
    assert losses == ref and same_state(o, ref_o)
    starts = [e for e in Ledger(tmp_path / "run").read() if e["event"] == "start"]
    assert [s["resumed_from"] for s in starts] == [None, 21, 32]
    done = [e for e in Ledger(tmp_path / "run").read() if e["event"] == "stop" and e["reason"] == "done"]
    assert [d["step"] for d in done] == [EPOCHS * PER_EPOCH]


def test_step_done_loop_resumes_exactly(tmp_path: Path) -> None:
    ref: list[str] = []
    ref_o = while_loop(tmp_path / "ref", "shuffle", ref)
    losses, o = resumed(while_loop, tmp_path / "run", "shuffle", [32])
    assert losses == ref and same_state(o, ref_o)


def full_batch_loop(ckdir: Path, kind: str, losses: list[str], stop_at: int | None = None,
                    every_steps: int | None = None) -> dict[str, Any]:
    """pytorch/examples gcn's shape: the whole data set each epoch, one optimizer step, no loader:
    only ``ckpt.epochs()`` is integrated. Dropout draws from the RNG every epoch."""
    o = setup(kind)
    x, y = o["loader"].dataset.tensors
    ck = Checkpointer(ckdir, every_steps=every_steps)
    ck.register(model=o["model"], opt=o["opt"], sched=o["sched"])
    for epoch in ck.epochs(1, 13):
        step(o, (x, y), losses)
        o["sched"].step()
        losses[-1] += f" epoch {epoch}"
        signal_if(ck, stop_at)
    return o


def test_a_full_batch_epoch_loop_stops_at_an_epoch_end_and_resumes_at_the_next(tmp_path: Path) -> None:
    # Before, no boundary ever ran in such a loop: the stop signal was recorded and never taken
    # (the run trained to its end, or in a job was killed with nothing saved).
    ref: list[str] = []
    ref_o = full_batch_loop(tmp_path / "ref", "shuffle", ref)
    assert len(ref) == 12
    losses, o = resumed(full_batch_loop, tmp_path / "run", "shuffle", [5, 9])  # after epochs 5 and 9
    assert losses == ref and same_state(o, ref_o)
    assert o["sched"].last_epoch == ref_o["sched"].last_epoch == 12
    starts = [e for e in Ledger(tmp_path / "run").read() if e["event"] == "start"]
    assert [s["resumed_from"] for s in starts] == [None, 5, 9]
    periodic: list[str] = []
    full_batch_loop(tmp_path / "every", "shuffle", periodic, every_steps=4)  # saves count epochs
    assert periodic == ref
    assert sorted(p.name for p in (tmp_path / "every").glob("step-*")) == ["step-12", "step-4", "step-8"]


def fresh_loop(ckdir: Path, kind: str, losses: list[str], stop_at: int | None = None) -> dict[str, Any]:
    """A loader made anew in each epoch's code, as word_language_model's
    ``range(0, len(data) - 1, bptt)`` (``kind="range"``), a ``DataLoader`` built each epoch
    (``"dataloader"``), or both in turn, each epoch (``"both"``); the previous epoch's still
    held when the next is made (a variable of the loop). ``"two"``: two loaders made once,
    trained in turn each epoch."""
    o = setup("shuffle")
    data = o["loader"].dataset
    ck = Checkpointer(ckdir, every_steps=None)
    ck.register(model=o["model"], opt=o["opt"])
    batches: Any = None
    halves = [DataLoader(torch.utils.data.Subset(data, range(h, len(data), 2)), batch_size=4, shuffle=True)
              for h in (0, 1)]
    for epoch in ck.epochs(EPOCHS):
        kinds = ["range", "dataloader"] if kind == "both" else ["half0", "half1"] if kind == "two" else [kind]
        for k in kinds:
            if k.startswith("half"):
                batches = ck.batches(halves[int(k[-1])])
                made = iter(batches)
            elif k == "range":
                batches = ck.batches(range(0, len(data), 4 * len(kinds)))
                made = (data[i:i + 4] for i in batches)
            else:
                loader = DataLoader(data, batch_size=4 * len(kinds), shuffle=True)
                batches = ck.batches(loader)
                made = iter(batches)
            for batch in made:
                step(o, batch, losses)
                signal_if(ck, stop_at)
        losses.append(f"eval {epoch} {float.hex(o['model'](torch.ones(1, 6)).sum().item())}")
    return o


@pytest.mark.parametrize("kind", ["range", "dataloader", "both", "two"])
def test_a_loader_made_anew_each_epoch_resumes_its_interrupted_pass(kind: str, tmp_path: Path) -> None:
    # Before, the new object of each epoch was the next "loader<N>": the resumed run gave the
    # interrupted epoch the saved position of an earlier epoch's loader (a pass that had
    # ended: it trained none of the epoch's remaining batches) and skipped the first
    # batches of the next epoch, and exited 0; word_language_model integrated as the README
    # says: hpcckpt check NOT identical. With two loaders an epoch (made anew or not), a
    # resumed epoch stopped in the first one's pass resumed the second's pass of the epoch
    # before, which had ended: it skipped that loader for the epoch.
    ref: list[str] = []
    ref_o = fresh_loop(tmp_path / "ref", kind, ref)
    assert len([x for x in ref if not x.startswith("eval")]) == EPOCHS * PER_EPOCH
    losses, o = resumed(fresh_loop, tmp_path / "run", kind, [21, 40])  # mid-epoch 2 and 3
    assert losses == ref and same_state(o, ref_o)


def shuffled_batches(data: Any, rng: str) -> Any:
    """A batch generator of the script's own that shuffles as its pass begins, with ``rng``."""
    import random

    import numpy as np
    n = len(data)
    order = (torch.randperm(n).tolist() if rng == "torch" else random.sample(range(n), n) if rng == "python"
             else np.random.permutation(n).tolist())
    for i in range(0, n, 4):
        yield data[order[i:i + 4]]


def generator_loop(ckdir: Path, rng: str, losses: list[str], stop_at: int | None = None) -> dict[str, Any]:
    import random

    import numpy as np
    random.seed(1)
    np.random.seed(1)
    o = setup("shuffle")
    data = o["loader"].dataset
    ck = Checkpointer(ckdir, every_steps=None)
    ck.register(model=o["model"], opt=o["opt"])
    for _ in ck.epochs(EPOCHS):
        for batch in ck.batches(shuffled_batches(data, rng)):
            step(o, batch, losses)
            losses[-1] += f" {random.random()} {np.random.rand()}"  # training draws from them too
            signal_if(ck, stop_at)
    return o


@pytest.mark.parametrize("rng", ["torch", "python", "numpy"])
def test_a_batch_generator_shuffling_as_its_pass_begins_resumes_in_its_order(rng: str, tmp_path: Path) -> None:
    # Before, the start of a pass over a generator recorded only the torch RNG: one shuffling
    # with `random` or NumPy (np.random.permutation in many scripts' batch_iter) drew another
    # order in a resumed epoch, from the resume point's RNGs.
    ref: list[str] = []
    ref_o = generator_loop(tmp_path / "ref", rng, ref)
    losses, o = resumed(generator_loop, tmp_path / "run", rng, [21, 40])
    assert losses == ref and same_state(o, ref_o)


def own_epochs_loop(ckdir: Path, kind: str, losses: list[str], stop_at: int | None = None) -> dict[str, Any]:
    """No epoch loop of ckpt.epochs(): passes over a loader made anew each time until a step
    budget is spent, the loader with a name (``kind="named"``) or without."""
    o = setup("shuffle")
    data = o["loader"].dataset
    with Checkpointer(ckdir, every_steps=None) as ck:
        ck.register(model=o["model"], opt=o["opt"])
        while ck.step < EPOCHS * PER_EPOCH:  # a step budget, passes as many as it takes
            batches = ck.batches(range(0, len(data), 4), name="train" if kind == "named" else None)
            for i in batches:
                step(o, data[i:i + 4], losses)
                signal_if(ck, stop_at)
    return o


def test_a_loader_made_anew_without_ckpt_epochs_is_named_in_the_log_and_a_name_resumes_it(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="hpcckpt"):
        own_epochs_loop(tmp_path / "anon", "anon", [])
    said = [r.getMessage() for r in caplog.records if "another loader object" in r.getMessage()]
    assert len(said) == 1 and "own_epochs_loop" in said[0] and 'name="train"' in said[0], said
    ref: list[str] = []
    ref_o = own_epochs_loop(tmp_path / "ref", "named", ref)
    losses, o = resumed(own_epochs_loop, tmp_path / "run", "named", [21])
    assert losses == ref and same_state(o, ref_o)


def test_a_checkpoint_naming_its_loaders_by_first_use_resumes_with_that_naming(tmp_path: Path) -> None:
    """Checkpoints written before call-site names name an unnamed loader ``loader<N>`` by first
    use: a run resumed from one keeps that naming (here the first run names its loader so
    by hand, as the earlier hpcckpt did), else its interrupted pass would begin again."""
    def run(ckdir: Path, losses: list[str], name: str | None, stop_at: int | None = None) -> dict[str, Any]:
        o = setup("shuffle")
        ck = Checkpointer(ckdir, every_steps=None)
        ck.register(model=o["model"], opt=o["opt"])
        for _ in ck.epochs(EPOCHS):
            for batch in ck.batches(o["loader"], name=name):
                step(o, batch, losses)
                signal_if(ck, stop_at)
        return o

    ref: list[str] = []
    ref_o = run(tmp_path / "ref", ref, None)
    losses: list[str] = []
    with pytest.raises(RequeueExit):
        run(tmp_path / "run", losses, "loader0", 21)
    o = run(tmp_path / "run", losses, None)
    assert losses == ref and same_state(o, ref_o)


@pytest.mark.parametrize("name", list(LOOPS))
def test_rerunning_a_finished_job_says_so_and_trains_nothing(name: str, tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    ref_o = resumed(LOOPS[name], tmp_path, "shuffle", [20])[1]  # a job with checkpoints, finished
    again: list[str] = []
    with caplog.at_level(logging.WARNING, logger="hpcckpt"):
        o = LOOPS[name](tmp_path, "shuffle", again)
    assert [x for x in again if not x.startswith("eval")] == []  # no training step
    assert same_state(o, ref_o)  # the finished state was restored
    said = [r.getMessage() for r in caplog.records if "nothing left to train" in r.getMessage()]
    assert len(said) == 1 and str(tmp_path) in said[0] and "48" in said[0] and "start fresh" in said[0], said
    assert "finished" in said[0]


def test_resuming_past_a_smaller_total_says_so(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(RequeueExit):
        flat_loop(tmp_path, "shuffle", [], 32)
    o = setup("shuffle")
    with caplog.at_level(logging.WARNING, logger="hpcckpt"), Checkpointer(tmp_path, every_steps=None) as ck:
        ck.register(model=o["model"], opt=o["opt"])
        assert list(ck.loop(o["loader"], 24)) == []
    said = [r.getMessage() for r in caplog.records if "nothing left to train" in r.getMessage()]
    assert len(said) == 1 and "step 32 of total_steps=24" in said[0] and "HPCCKPT_DIR" in said[0], said


def log_every(iterable: Any) -> Any:
    """A generator of the script's own between the batches and the loop's enumerate()."""
    yield from iterable


def sampling_loop(ckdir: Path, numbered: str, log: list[str], stop_at: int | None = None) -> dict[str, Any]:
    """DCGAN's loop: every 5th batch of an epoch (by its number) samples from the model in
    train mode, which updates its BatchNorm statistics; the numbers are logged."""
    o = setup("shuffle")
    o["model"] = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 3))
    o["opt"] = torch.optim.SGD(o["model"].parameters(), lr=0.1)
    fixed = torch.randn(4, 6)
    ck = Checkpointer(ckdir, every_steps=None)
    ck.register(model=o["model"], opt=o["opt"])
    for epoch in ck.epochs(EPOCHS):
        batches = ck.batches(o["loader"])
        if numbered == "enumerate":
            numbering = enumerate(batches)
        elif numbered == "wrapped":  # torchvision references' MetricLogger.log_every, tqdm
            numbering = enumerate(log_every(batches))
        elif numbered == "wrapped-start":
            numbering = enumerate(log_every(batches), start=batches.start)
        else:
            numbering = batches.enumerate()
        for i, batch in numbering:
            step(o, batch, log)
            log.append(f"{epoch}/{i}")
            if i % 5 == 0:
                o["model"](fixed)  # a sample, in train mode
            signal_if(ck, stop_at)
    return o


@pytest.mark.parametrize("numbered", ["enumerate", "batches.enumerate", "wrapped", "wrapped-start"])
def test_a_resumed_epoch_numbered_by_enumerate_says_so_and_batches_enumerate_keeps_the_numbers(
        numbered: str, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both runs traced as ``hpcckpt check`` traces them: with enumerate() its hint comes first."""
    from hpcckpt.check import ENUMERATE_HINT, TRACE_ENV, compare, read_trace
    ref: list[str] = []
    monkeypatch.setenv(TRACE_ENV, str(tmp_path / "ref.jsonl"))
    ref_o = sampling_loop(tmp_path / "ref", numbered, ref)
    monkeypatch.setenv(TRACE_ENV, str(tmp_path / "run.jsonl"))
    with caplog.at_level(logging.WARNING, logger="hpcckpt"):
        losses, o = resumed(sampling_loop, tmp_path / "run", numbered, [19])  # batch 3 of the second epoch
    said = [r.getMessage() for r in caplog.records if "enumerate()" in r.getMessage()]
    (a, _, _), (b, _, notes) = read_trace(tmp_path / "ref.jsonl"), read_trace(tmp_path / "run.jsonl")
    checked = compare(a, b, [19], 1, notes)
    if numbered in ("enumerate", "wrapped"):
        # its count starts at 0 again: the samples move, the BatchNorm statistics differ
        assert "1/0" in losses[losses.index("0/15") + 1:] and not same_state(o, ref_o)
        fix = ".enumerate()" if numbered == "enumerate" else "start=batches.start"
        assert len(said) == 1 and "batch 3 of 16" in said[0] and fix in said[0], said
        assert notes == ["enumerate"] and not checked.identical and checked.first_diverging_step == 20
        assert checked.hints[0] == ENUMERATE_HINT
    else:
        assert losses == ref and same_state(o, ref_o) and said == [] and notes == []
        assert checked.identical, checked
