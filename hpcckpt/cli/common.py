"""Small helpers shared by verbs."""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from ..errors import ConfigError, NoCheckpoint


def add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="machine-readable output on stdout")


def emit(args: argparse.Namespace, data: Any, text: str) -> None:
    if getattr(args, "json", False):
        json.dump(data, sys.stdout, indent=1, default=str)
        sys.stdout.write("\n")
    else:
        print(text)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def directory(path: Path, *, option: str, must_exist: bool = True) -> Path:
    """``path`` if it is a directory (or, with ``must_exist=False``, not there yet).

    A file where a directory is expected is a usage error naming ``option`` (e.g.
    "--dir" or "DIR"); a missing one, when it must exist, is "nothing to act on".
    """
    if path.is_dir():
        return path
    if path.exists() or path.is_symlink():
        raise ConfigError(f"{option}={path} is not a directory; pass the checkpoint directory "
                          f"(the one holding step-*/ and ledger.jsonl), e.g. {option}=/scratch/$USER/run1/ckpt")
    if must_exist:
        raise NoCheckpoint(f"{option}={path} does not exist; check the path (it is the directory the "
                           "job was given as HPCCKPT_DIR or --dir)")
    if any(p.exists() and not p.is_dir() for p in path.parents):
        raise ConfigError(f"{option}={path}: a parent of it is a file, not a directory; pick another path")
    return path


def positive_int(text: str) -> int:
    """argparse ``type=``: a whole number >= 1 (argparse names the option in its error)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number (e.g. 3)") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 1 (e.g. 3)")
    return value


def positive_seconds(text: str) -> float:
    """argparse ``type=``: finite seconds > 0 (nan, inf, 0 and negatives are refused)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds (e.g. 60)") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number of seconds > 0 (e.g. 60)")
    return value
