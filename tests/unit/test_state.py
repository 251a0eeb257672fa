from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

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
