"""The first allocation's stop reserve is measured, not assumed (issue 55, item 5).

Before any save was measured, the stop's lead assumed a 10 s save: 1.5 x 10 + requeue and exit 5 +
margin 30 = 50 s, so a 1-minute allocation whose start-up took 15 s stopped without training (a
save that takes 0.02 s), twice, and was then refused. The first allocation now estimates its save
from the state's size and the checkpoint directory's rate, measured at the start."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from hpcckpt.api import Checkpointer, RequeueExit
from hpcckpt.lifecycle.ledger import Ledger
from hpcckpt.policy import PROBE_MAX_BYTES, PROBE_NAME, Figures, estimate_save_s
from hpcckpt.store import catalog
from tests.helpers import tiny_state, train_step

pytestmark = pytest.mark.native


class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


def test_a_one_minute_allocation_with_a_fast_save_trains_in_its_first_allocation(
        ckdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    monkeypatch.setenv("HPCCKPT_END_TIME", str(clock.t + 45))  # a 1-minute limit, 15 s of it start-up
    monkeypatch.setattr("hpcckpt.api.process_start_time", lambda: time.time() - 15)
    objs = tiny_state(0)
    trained = 0
    with pytest.raises(RequeueExit) as exc:
        with Checkpointer(ckdir, every_steps=None) as ck:  # the default margin: 30 s
            ck.policy.clock = clock
            ck.register(**objs)
            for _ in ck.steps(100):
                train_step(objs)
                trained += 1
                clock.t += 1.0  # a second a step
    stop = exc.value
    assert stop.reason == "deadline" and stop.step == trained and trained >= 5
    assert catalog.scan(ckdir)[-1].step == stop.step  # it trained, and kept what it trained
    # The guarantee holds: the stop came, at most one step (1 s here) late, with 1.5 x the final
    # save (as measured), the requeue and exit (5 s) and the margin (30 s) still ahead.
    left = 45 - trained
    save_s = Figures.read(ckdir).save_s
    assert save_s is not None and left >= 1.5 * save_s + 5 + 30 - 1.0
    assert [e["reason"] for e in Ledger(ckdir).read() if e["event"] == "stop"] == ["deadline"]


def test_the_estimate_scales_the_measured_write_to_the_state_and_leaves_nothing(tmp_path: Path) -> None:
    ticks = iter(range(100))

    def clock() -> float:
        return float(next(ticks))  # each reading a second later: the write took 1 s, the directory 1 s

    save_s, rate = estimate_save_s(tmp_path, 2 * PROBE_MAX_BYTES, clock=clock)
    assert rate == PROBE_MAX_BYTES and save_s == 2 * 1.0 + 2 * 1.0  # twice the probe, two directory syncs
    small, _ = estimate_save_s(tmp_path, 1000)  # a tiny state: the fixed costs of a 1 MiB write, measured
    assert 0 < small < 10
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(PROBE_NAME)]


def test_a_measured_save_is_not_replaced_by_an_estimate(ckdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ckdir.mkdir(parents=True)
    Figures(save_s=20.0, step_s=1.0).write(ckdir)  # an earlier allocation measured it
    clock = Clock()
    monkeypatch.setenv("HPCCKPT_END_TIME", str(clock.t + 600))
    called: list[int] = []
    monkeypatch.setattr("hpcckpt.lifecycle.stop.estimate_save_s", lambda root, n: called.append(n) or (0.01, 1e9))
    objs = tiny_state(0)
    with Checkpointer(ckdir, every_steps=None) as ck:
        ck.policy.clock = clock
        ck.register(**objs)
        for _ in ck.steps(2):
            train_step(objs)
        assert ck.policy.save_cost_s >= 0.8 * 20.0 or ck.policy.measured
    assert called == []
