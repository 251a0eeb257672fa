"""Small helpers shared by verbs."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any


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
