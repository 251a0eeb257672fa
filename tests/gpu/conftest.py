"""The GPU tier (``pytest -m gpu``, or ``scripts/test-gpu`` on a GPU node).

Every test under tests/gpu/ is marked ``gpu`` and skips, saying why, where no CUDA
device is visible (CI never has one). Each test cleans up after itself: child
processes are killed and reaped, pipes closed, pinned memory released.
"""
from __future__ import annotations

import pytest


def cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="needs a CUDA device and a CUDA build of torch (run scripts/test-gpu on a GPU node)")
    have = cuda_available()
    for item in items:
        if "tests/gpu/" in item.nodeid.replace("\\", "/") or item.nodeid.startswith("gpu/"):
            item.add_marker(pytest.mark.gpu)
            if not have:
                item.add_marker(skip)
