"""What ``hpcckpt demo`` and ``hpcckpt bench`` share: the device, the children, the work dir.

Children are started with ``python -P -m MODULE`` (``-P``: Python 3.11+) or, before
3.11, through ``-c`` with the working directory removed from ``sys.path``: run from a
source checkout with a regular install, ``-m`` would otherwise put the checkout first
on the path and the children would import the source tree (which has no compiled
core) instead of the installed package.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from ..errors import ConfigError

DEVICES = ("auto", "cuda", "cpu")
# cuBLAS needs a fixed workspace for deterministic GEMMs (CUDA >= 10.2).
CUBLAS_WORKSPACE = ":4096:8"


def cuda_available() -> bool:
    import torch
    return bool(torch.cuda.is_available())


def resolve_device(value: str, *, option: str = "--device") -> str:
    """``auto`` -> ``cuda`` when a GPU is visible, else ``cpu``; ``cuda`` without one is an error."""
    v = value.strip().lower()
    if v not in DEVICES:
        raise ConfigError(f"{option} {value!r} is not a device; use one of {', '.join(DEVICES)} (e.g. {option} cpu)")
    if v == "auto":
        return "cuda" if cuda_available() else "cpu"
    if v == "cuda" and not cuda_available():
        raise ConfigError(f"{option} cuda: no CUDA device is visible to torch (torch.cuda.is_available() is "
                          "False; check CUDA_VISIBLE_DEVICES, the driver, and that torch is a CUDA build); "
                          f"use {option} cpu or {option} auto")
    return v


def child_env(device: str) -> dict[str, str]:
    """The environment of a training child: deterministic cuBLAS on CUDA."""
    env = dict(os.environ)
    if device == "cuda":
        env.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    return env


def module_cmd(module: str) -> list[str]:
    """``python -m module`` without the working directory on the child's import path."""
    if sys.version_info >= (3, 11):
        return [sys.executable, "-P", "-m", module]
    # -c puts '' (the working directory) first on sys.path: drop it before importing anything.
    code = ("import sys, runpy; sys.path[:] = [p for p in sys.path if p not in ('', '.')]; "
            f"sys.argv[0] = {module!r}; runpy.run_module({module!r}, run_name='__main__', alter_sys=True)")
    return [sys.executable, "-c", code]


def work_dir(path: Path, *, option: str = "--dir") -> Path:
    """``path`` as a directory we can write into: created (with parents) when missing."""
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{option} {path}: is a file, not a directory; give a directory "
                          f"(e.g. {option} /tmp/hpcckpt-work)")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{option} {path}: cannot create the directory ({exc.strerror}); "
                          f"give a writable directory (e.g. {option} /tmp/hpcckpt-work)") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"{option} {path}: not writable by this user; give a writable directory "
                          f"(e.g. {option} /tmp/hpcckpt-work)")
    return path
