from __future__ import annotations

import math
import os
import random
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hpcckpt.api import Checkpointer, RequeueExit
from hpcckpt.errors import ConfigError
from hpcckpt.state import Flat, TrainState, flatten, unflatten
from tests.helpers import tiny_state, train_step


def test_flatten_roundtrip_keeps_structure_and_types() -> None:
    obj = {"a": torch.arange(6).reshape(2, 3), "b": {"c": (1, 2.5, "x", None, True)},
           "ints": {0: torch.ones(2), 7: {"exp_avg": torch.zeros(3, dtype=torch.bfloat16)}},
           "nan": math.nan, "inf": -math.inf, "np": np.arange(5, dtype=np.uint32),
           "dtype": torch.float16, "slash/key": [torch.tensor(3.0)]}
    table: dict[str, torch.Tensor] = {}
    meta = flatten(obj, "root", table)
    import json
    meta = json.loads(json.dumps(meta))  # must be pure JSON
    back = unflatten(meta, table)
    assert torch.equal(back["a"], obj["a"])
    assert back["b"]["c"] == (1, 2.5, "x", None, True)
    assert set(back["ints"]) == {0, 7} and back["ints"][7]["exp_avg"].dtype == torch.bfloat16
    assert math.isnan(back["nan"]) and back["inf"] == -math.inf
    assert isinstance(back["np"], np.ndarray) and back["np"].dtype == np.uint32
    assert back["dtype"] is torch.float16
    assert torch.equal(back["slash/key"][0], torch.tensor(3.0))
    assert "root/slash%2Fkey/0" in table


def test_unsupported_object_is_refused_not_pickled() -> None:
    with pytest.raises(ConfigError, match="without pickling"):
        flatten({"f": object()}, "x", {})


def test_register_requires_state_dict() -> None:
    with pytest.raises(ConfigError, match="state_dict"):
        TrainState().register("thing", object())


def test_capture_restore_reproduces_the_next_steps_bit_for_bit() -> None:
    a = tiny_state(0)
    for _ in range(5):
        train_step(a)
    st = TrainState()
    for k, v in a.items():
        st.register(k, v)
    flat = st.capture(step=5)
    # deep-copy the captured tensors (capture aliases live state)
    saved = Flat({k: v.clone() for k, v in flat.tensors.items()}, flat.meta)
    expected = [train_step(a) for _ in range(5)]
    expected_params = [p.clone() for p in a["model"].parameters()]

    b = tiny_state(1)  # different init, different RNG position
    random.random()
    st2 = TrainState()
    for k, v in b.items():
        st2.register(k, v)
    tree = st2.restore(saved)
    assert tree["step"] == 5
    got = [train_step(b) for _ in range(5)]
    assert [float.hex(x) for x in got] == [float.hex(x) for x in expected]
    for p, q in zip(b["model"].parameters(), expected_params):
        assert torch.equal(p, q)


def test_restore_names_missing_objects() -> None:
    st = TrainState()
    st.register("model", torch.nn.Linear(2, 2))
    flat = st.capture(step=0)
    st2 = TrainState()
    st2.register("net", torch.nn.Linear(2, 2))
    with pytest.raises(ConfigError, match="net"):
        st2.restore(flat)


# --- exact state whatever its layout (issue 22 item 7) ------------------------------------------
# Fused AdamW walks a parameter and its state as flat memory: a transposed weight whose
# restored exp_avg were contiguous would pair the wrong elements; same for channels_last.
# Each is preempted (a real SIGUSR2), resumed with both engines, compared bit for bit.

def model_and_opt(kind: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    if kind == "transposed":
        m = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
        m[0].weight = torch.nn.Parameter(m[0].weight.detach().t().contiguous().t())  # strides (1, 5)
    else:
        m = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                                torch.nn.Flatten(), torch.nn.Linear(4 * 4 * 4, 3))
        m = m.to(memory_format=torch.channels_last)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True)
    return m, opt


def batch(kind: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(8, 6, generator=g) if kind == "transposed" else torch.randn(8, 3, 6, 6, generator=g)
    return x, torch.randint(0, 3, (8,), generator=g)


def run_layout(ckdir: Path, kind: str, engine: str, losses: list[str], stop_at: int | None = None) -> Any:
    m, opt = model_and_opt(kind)
    with Checkpointer(ckdir, engine=engine, every_steps=None) as ck:
        ck.register(model=m, optimizer=opt)
        for step in ck.steps(12):
            x, y = batch(kind, step)
            loss = torch.nn.functional.cross_entropy(m(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float.hex(loss.item()))
            if step + 1 == stop_at:
                os.kill(os.getpid(), signal.SIGUSR2)
    return m, opt


@pytest.mark.native
@pytest.mark.parametrize("engine", ["sync", "concurrent"])
@pytest.mark.parametrize("kind", ["transposed", "channels_last"])
def test_fused_adamw_over_strided_parameters_resumes_bit_identical(kind: str, engine: str, tmp_path: Path) -> None:
    ref: list[str] = []
    ref_m, _ = run_layout(tmp_path / "ref", kind, engine, ref)
    losses: list[str] = []
    with pytest.raises(RequeueExit):
        run_layout(tmp_path / "run", kind, engine, losses, stop_at=5)
    m, opt = run_layout(tmp_path / "run", kind, engine, losses)
    assert losses == ref
    for p, q in zip(m.state_dict().values(), ref_m.state_dict().values()):
        assert torch.equal(p, q)
    for p in (p for g in opt.param_groups for p in g["params"]):
        for v in opt.state[p].values():
            if v.dim() == p.dim():
                assert v.stride() == p.stride()  # the layout fused kernels rely on


@pytest.mark.native
def test_an_optimizer_that_gained_a_param_group_says_what_to_do(tmp_path: Path) -> None:
    torch.manual_seed(0)
    head, body = torch.nn.Linear(4, 2), torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(head.parameters(), lr=0.1)
    opt.add_param_group({"params": body.parameters(), "lr": 0.01})  # unfrozen during training
    with Checkpointer(tmp_path, every_steps=None) as ck:
        ck.register(head=head, body=body, optimizer=opt)
        ck.save(block=True)
    fresh = torch.optim.SGD(head.parameters(), lr=0.1)  # as the script builds it at the start
    with Checkpointer(tmp_path, every_steps=None) as ck:
        with pytest.raises(ConfigError, match=r"2 parameter group\(s\).*now has 1.*add_param_group"):
            ck.register(head=head, body=body, optimizer=fresh)


def test_python_rng_state_is_saved_as_an_array_and_the_older_list_still_restores() -> None:
    """The Mersenne Twister's 625 words go in as an array (not 625 JSON numbers in every
    manifest); a checkpoint written before, with a list, restores the same."""
    from hpcckpt.state import python_rng, rng_state, set_rng_state
    random.seed(1234)
    state = rng_state()
    words = state["python"][1]
    assert isinstance(words, np.ndarray) and words.dtype == np.uint32 and words.shape == (625,)
    want = [random.random() for _ in range(5)]
    for saved in (state["python"], (state["python"][0], words.tolist(), state["python"][2])):
        set_rng_state({**state, "python": saved})
        assert [random.random() for _ in range(5)] == want
        assert python_rng(saved) == python_rng(state["python"])


def _same_numpy_state(a: Any, b: Any) -> bool:
    return a[0] == b[0] and bool((a[1] == b[1]).all()) and tuple(a[2:]) == tuple(b[2:])


def test_rng_state_read_again_only_when_it_can_have_changed() -> None:
    """``rng_state`` keeps the last NumPy and Python states while nothing drew (a small state
    saved at every step would otherwise pay ~0.2 ms to copy the same 624 words); every way
    the state can change is seen: draws, a pending Gaussian taken without a draw, seed,
    set_state, and the Python RNG's own draws."""
    from hpcckpt.state import rng_state
    np.random.seed(7)
    first = rng_state()
    assert rng_state()["numpy"] is first["numpy"]  # nothing drew: the same state, not read again
    changes = [lambda: np.random.rand(3), lambda: np.random.standard_normal(),
               lambda: np.random.standard_normal(),  # the pair's second: has_gauss 1 -> 0, no draw
               lambda: np.random.seed(7), lambda: np.random.seed(7),
               lambda: np.random.set_state(first["numpy"]), lambda: np.random.randint(0, 9, size=700)]
    for i, change in enumerate(changes):
        change()
        got = rng_state()
        assert _same_numpy_state(got["numpy"], np.random.get_state()), i
        want = [np.random.rand() for _ in range(3)]
        np.random.set_state(got["numpy"])
        assert [np.random.rand() for _ in range(3)] == want, i
        np.random.set_state(got["numpy"])
    random.seed(3)
    before = rng_state()["python"]
    random.random()
    after = rng_state()["python"]
    assert tuple(after[1].tolist()) == random.getstate()[1] != tuple(before[1].tolist())
