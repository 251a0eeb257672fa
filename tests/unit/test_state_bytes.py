"""A resumed run's state, as the script itself saves it, is the uninterrupted run's byte for byte
(issue 55, item 4): ``torch.save(optimizer.state_dict())`` after a resume equals the uninterrupted
run's at the same step, key order included (AdamW: step, exp_avg, exp_avg_sq; each parameter
group's hyperparameters in the order the optimizer made them)."""
from __future__ import annotations

import io
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from hpcckpt.api import Checkpointer, RequeueExit
from tests.helpers import tiny_state, train_step

pytestmark = pytest.mark.native


def _bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _run(ckdir: Path, total: int, engine: str, *, signal_at: int | None = None) -> dict[str, Any]:
    objs = tiny_state(0)
    with Checkpointer(ckdir, engine=engine, every_steps=100, keep=2, signals=("USR2",)) as ck:
        ck.register(**objs)
        for step in ck.steps(total):
            train_step(objs)
            if signal_at is not None and step + 1 == signal_at:
                os.kill(os.getpid(), signal.SIGUSR2)
    return objs


@pytest.mark.parametrize("engine", ["sync", "concurrent"])
def test_a_resumed_optimizers_state_dict_saves_to_the_uninterrupted_runs_bytes(ckdir: Path, engine: str) -> None:
    ref = _run(ckdir.parent / "ref", 9, engine)
    with pytest.raises(RequeueExit):
        _run(ckdir, 9, engine, signal_at=4)
    got = _run(ckdir, 9, engine)
    want_sd, got_sd = ref["optimizer"].state_dict(), got["optimizer"].state_dict()
    assert [list(s) for s in got_sd["state"].values()] == [list(s) for s in want_sd["state"].values()]
    assert [list(g) for g in got_sd["param_groups"]] == [list(g) for g in want_sd["param_groups"]]
    for name in ("optimizer", "model", "scheduler", "scaler"):
        assert _bytes(got[name].state_dict()) == _bytes(ref[name].state_dict()), name


@pytest.mark.parametrize("engine", ["sync", "concurrent"])
def test_the_restored_state_dicts_keep_their_key_order_right_after_the_resume(ckdir: Path, engine: str) -> None:
    """At the resumed step itself, before any further update: the optimizer's per-parameter
    state lists step, exp_avg, exp_avg_sq as AdamW made them (not sorted)."""
    objs = tiny_state(0)
    with pytest.raises(RequeueExit):
        with Checkpointer(ckdir, engine=engine, every_steps=100, signals=("USR2",)) as ck:
            ck.register(**objs)
            for step in ck.steps(10):
                train_step(objs)
                if step + 1 == 3:
                    os.kill(os.getpid(), signal.SIGUSR2)
    want = _bytes(objs["optimizer"].state_dict())
    assert list(objs["optimizer"].state_dict()["state"][0]) == ["step", "exp_avg", "exp_avg_sq"]
    again = tiny_state(0)
    with Checkpointer(ckdir, engine=engine, every_steps=100, signals=("USR2",)) as ck:
        assert ck.register(**again) == 3
        assert list(again["optimizer"].state_dict()["state"][0]) == ["step", "exp_avg", "exp_avg_sq"]
        assert _bytes(again["optimizer"].state_dict()) == want
        ck.close()
