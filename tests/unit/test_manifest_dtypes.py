"""The manifest reader's table of element sizes (it reads manifests without importing torch)
agrees with torch for every dtype in it, and a name outside it is still judged by torch."""
from __future__ import annotations

import pytest
import torch

from hpcckpt.store.manifest import ITEMSIZE, Invalid, _itemsize


@pytest.mark.parametrize("name", sorted(ITEMSIZE))
def test_each_size_is_torchs(name: str) -> None:
    dtype = getattr(torch, name)
    assert isinstance(dtype, torch.dtype) and str(dtype) == f"torch.{name}"
    assert ITEMSIZE[name] == dtype.itemsize == _itemsize(name, "t")


def test_names_outside_the_table_are_asked_of_torch() -> None:
    assert _itemsize("float", "t") == 4 and _itemsize("double", "t") == 8  # aliases torch knows
    for bad in ("qint8", "Tensor", "no_such", "__class__", 3, None):
        with pytest.raises(Invalid, match="not a plain torch dtype"):
            _itemsize(bad, "t")
